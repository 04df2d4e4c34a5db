"""Model-agnostic containers passed from the image pipeline to a model backend."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from luxjax.vision.patch_codes import PatchCodes


@dataclass(frozen=True)
class ImageInputs:
    """Preprocessed images, concatenated in prompt order.

    pixel_values: float32 [total_patches, patch_dim] (rows of all images back to back), or PatchCodes standing
                  for them (a preprocessor's compact form; np.asarray gives the rows)
    grid_thw:     int64 [num_images, 3] (temporal, height, width) in patches
    num_tokens:   LLM tokens each image expands to
    hashes:       content hash of each decoded image (for caches)
    """

    pixel_values: np.ndarray | PatchCodes
    grid_thw: np.ndarray
    num_tokens: list[int]
    hashes: list[str] = field(default_factory=list)

    @property
    def num_images(self) -> int:
        return len(self.num_tokens)
