"""The notebook API: `luxjax.load(path, mmproj=None, dtype="bfloat16")` -> Model.

Keep these names stable: `Model.image_inputs`, `encode_images`, `forward_logits`, `render_prompt`, `generate`."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import jax
import numpy as np
from PIL import Image

from luxjax.contract import Backend, Prompt
from luxjax.engine.generate import Generation, generate, prompt_logits
from luxjax.errors import ModelFormatError
from luxjax.vision.types import ImageInputs

ASSETS = Path(__file__).parent / "assets"


def default_model_path() -> tuple[Path, Path]:
    """The small demo model that ships inside the package (luxjax/demo): (GGUF decoder, its mmproj GGUF)."""
    folder = ASSETS / "default"
    decoders = [p for p in sorted(folder.glob("*.gguf")) if not p.name.startswith("mmproj")]
    projectors = sorted(folder.glob("mmproj*.gguf"))
    if not decoders or not projectors:
        raise ModelFormatError(f"no default model (a GGUF decoder and an mmproj*.gguf) in {folder}")
    return decoders[0], projectors[0]


MIN_CACHED_COMPILE_SECONDS = 0.1  # JAX's default, 1 s, left the small model's vision tower and sampling uncached


def cache_compiled_programs(directory: str | os.PathLike) -> None:
    """Keep XLA's compiled programs in `directory` (JAX's persistent compilation cache) for this process and later
    ones: a jitted call whose program, shapes, devices and versions were compiled before loads it instead of
    compiling it again, so a server's second start skips its prefill, decode and vision compiles. Process-wide: it
    caches every jit of the process whose compile takes MIN_CACHED_COMPILE_SECONDS or more; an entry that cannot
    be read is compiled again."""
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_CACHED_COMPILE_SECONDS)


class Model:
    def __init__(self, backend: Backend):
        self.backend = backend

    @property
    def has_vision(self) -> bool:
        return self.backend.supports_images

    @property
    def tokenizer(self):
        return self.backend.tokenizer

    def image_inputs(self, images: Sequence[Image.Image]) -> ImageInputs:
        return self.backend.image_inputs(images)

    def encode_images(self, image_inputs: ImageInputs) -> np.ndarray:
        """Merger output, one row per image token: np.float32 [tokens, hidden]."""
        return np.asarray(self.backend.encode_images(image_inputs), dtype=np.float32)

    def render_prompt(self, messages: Sequence[dict], template_kwargs: dict | None = None
                      ) -> tuple[list[int], ImageInputs | None]:
        prompt = self.prompt(messages, template_kwargs)
        return prompt.token_ids, prompt.image_inputs

    def prompt(self, messages: Sequence[dict], template_kwargs: dict | None = None) -> Prompt:
        """template_kwargs: extra chat template variables, as the server's chat_template_kwargs (e.g.
        {"enable_thinking": False} for Qwen's templates)."""
        return self.backend.render_prompt(messages, template_kwargs=template_kwargs or None)

    def forward_logits(self, input_ids: Sequence[int], image_inputs: ImageInputs | None = None) -> np.ndarray:
        """Logits at every position, np.float32 [T, vocab], in one prefill of the whole sequence."""
        return prompt_logits(self.backend, list(input_ids), image_inputs)

    def generate(self, messages: Sequence[dict], max_tokens: int = 64, temperature: float = 0.0,
                 seed: int | None = None, template_kwargs: dict | None = None) -> Generation:
        return generate(self.backend, self.prompt(messages, template_kwargs), max_tokens=max_tokens,
                        temperature=temperature, seed=seed)


def load(path=None, mmproj=None, dtype: str = "bfloat16", *, max_context: int | None = None,
         progress: bool = True, cache_dir=None) -> Model:
    """A Hugging Face directory (config.json + safetensors) or a GGUF decoder (+ optional mmproj GGUF).
    With no path, the default model shipped in the package. `cache_dir`: keep the prepared parameters there, so
    that the next load of the same files skips reading and converting them (luxjax/checkpoint/param_cache.py)."""
    from luxjax.models.registry import load_backend

    if path is None:
        path, default_mmproj = default_model_path()
        mmproj = default_mmproj if mmproj is None else mmproj
    return Model(load_backend(Path(path), None if mmproj is None else Path(mmproj), dtype,
                              max_context=max_context, progress=progress, cache_dir=cache_dir))
