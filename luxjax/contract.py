"""The backend contract: everything the engine, the HTTP server and the notebook API need from a model.

Nothing outside `luxjax/models/<arch>/` names a model; a model folder implements `Backend` and registers its
loader in `luxjax/models/registry.py`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import jax
import numpy as np
from PIL import Image

from luxjax.vision.types import ImageInputs


@dataclass
class Prompt:
    """A rendered, tokenized prompt with its images expanded to their rows."""

    token_ids: list[int]
    image_inputs: ImageInputs | None = None
    image_spans: list[tuple[int, int]] = field(default_factory=list)
    positions: np.ndarray | None = None  # model-specific position ids for every prompt token
    rope_delta: int = 0  # decode position = cached tokens + rope_delta
    text: str = ""  # rendered text before pad expansion (never contains image payloads)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_image_tokens(self) -> int:
        return sum(e - s for s, e in self.image_spans)


class Backend(Protocol):
    supports_images: bool
    image_markers: tuple[str, ...]  # strings refused in client text (forged placeholders)
    keep_images_whole: bool  # whether prefill chunks must not split an image's rows
    max_context: int
    vocab_size: int
    tokenizer: Any
    dtype: Any

    def image_inputs(self, images: Sequence[Image.Image]) -> ImageInputs: ...

    def num_image_tokens(self, width: int, height: int) -> int: ...

    def render_prompt(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                      template_kwargs: dict | None = None, max_tokens: int | None = None) -> Prompt:
        """template_kwargs: a request's extra chat template variables (its chat_template_kwargs). max_tokens: refuse
        (400) text that cannot make fewer tokens before tokenizing it (Tokenizer.encode)."""

    def text_prompt(self, text: str, *, max_tokens: int | None = None) -> Prompt: ...

    def prompt_from_ids(self, token_ids: Sequence[int], image_inputs: ImageInputs | None) -> Prompt: ...

    def encode_images(self, image_inputs: ImageInputs) -> jax.Array: ...

    def init_cache(self, slots: int, max_len: int): ...

    def prefill(self, caches, slot: int, prompt: Prompt, image_rows, begin: int, end: int, *,
                all_logits: bool = False): ...

    def decode(self, caches, token_ids: np.ndarray | jax.Array, cached: np.ndarray, rope_deltas: np.ndarray,
               active: np.ndarray | None = None):
        """One token for each of the first len(token_ids) slots (at most init_cache's `slots`: a step of fewer
        sequences costs less; the other slots' caches are neither read nor written); rows with active False leave
        their caches untouched. token_ids may lie on the device (the engine passes the tokens its last step
        sampled there, unread, so that it can issue the next step before reading them): do not bring them to the
        host. Returns (logits [len(token_ids), vocab], caches)."""
        ...
