"""Build a Qwen35Backend from a Hugging Face directory or from GGUF files (decoder + optional mmproj)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import jax.numpy as jnp

from luxjax.checkpoint.weights import WeightSource
from luxjax.errors import ModelFormatError
from luxjax.models.qwen35.backend import Qwen35Backend
from luxjax.models.qwen35.config import ModelConfig
from luxjax.models.qwen35.model import Qwen35Model
from luxjax.models.qwen35.preprocess import Qwen35ImageProcessor
from luxjax.models.qwen35.weights_hf import read_hf_config, read_safetensors


def _prepare_tensors(tensors: dict) -> dict:
    """HF stores the DeltaNet conv as [C, 1, K]; the layer wants [C, K]."""
    for name in [n for n in tensors if n.endswith("linear_attn.conv1d.weight")]:
        w = tensors[name]
        tensors[name] = w.reshape(w.shape[0], w.shape[-1])
    return tensors


def build(cfg: ModelConfig, tensors: dict, tokenizer, processor, dtype, *, origin: str, max_context=None):
    dtype = jnp.dtype(dtype)
    model = Qwen35Model(cfg, WeightSource(_prepare_tensors(tensors), dtype, origin=origin), dtype)
    return Qwen35Backend(cfg, model, tokenizer, processor, dtype, max_context=max_context)


def load_hf_dir(path, dtype="bfloat16", *, max_context=None, progress=True) -> Qwen35Backend:
    from luxjax.text.tokenizer import Tokenizer

    path = Path(path)
    raw = read_hf_config(path)
    cfg = ModelConfig.from_hf(raw)
    tensors = read_safetensors(path, progress=progress)
    has_vision = cfg.vision is not None and any(n.startswith("model.visual.") for n in tensors)
    if not has_vision:
        cfg = cfg.replace(vision=None)
    processor = None
    pre = path / "preprocessor_config.json"
    if has_vision:
        if not pre.exists():
            raise ModelFormatError(f"{path}: vision checkpoint without preprocessor_config.json")
        processor = Qwen35ImageProcessor.from_preprocessor_config(json.loads(pre.read_text()))
    tokenizer = Tokenizer.from_hf_dir(path)
    return build(cfg, tensors, tokenizer, processor, dtype, origin=str(path), max_context=max_context)


def load_gguf(path, mmproj=None, dtype="bfloat16", *, max_context=None, progress=True) -> Qwen35Backend:
    from luxjax.checkpoint.gguf_mmproj import load_qwen35_mmproj
    from luxjax.checkpoint.gguf_qwen35 import load_qwen35_gguf
    from luxjax.text.tokenizer import Tokenizer

    started = time.perf_counter()
    decoder = load_qwen35_gguf(path, progress=progress)
    tensors = dict(decoder.tensors)
    raw = {"text_config": decoder.text_config, **decoder.extra_config} if hasattr(decoder, "extra_config") else {
        "text_config": decoder.text_config}
    processor = None
    if mmproj is not None:
        projector = load_qwen35_mmproj(mmproj, progress=progress)
        tensors.update(projector.tensors)
        raw["vision_config"] = projector.vision_config
        processor = Qwen35ImageProcessor.from_preprocessor_config(projector.preprocessor_config)
    tokenizer = Tokenizer.from_gguf(path)
    for key, token in (("image_token_id", "<|image_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
                       ("vision_end_token_id", "<|vision_end|>")):
        raw.setdefault(key, tokenizer.token_to_id(token))
    cfg = ModelConfig.from_hf(raw)
    backend = build(cfg, tensors, tokenizer, processor, dtype, origin=str(path), max_context=max_context)
    backend.load_report = {"seconds": time.perf_counter() - started}
    return backend
