"""The contract between the image pipeline and a model backend's image preprocessing."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from PIL import Image

from luxjax.vision.types import ImageInputs


@runtime_checkable
class ImagePreprocessor(Protocol):
    """Turns decoded RGB images into the vision encoder's inputs, and says how many LLM tokens each becomes."""

    def __call__(self, images: Sequence[Image.Image]) -> ImageInputs:
        """All images, concatenated in the given (prompt) order."""
        ...

    def num_tokens(self, width: int, height: int) -> int:
        """LLM tokens an image of this size expands to (without decoding it)."""
        ...
