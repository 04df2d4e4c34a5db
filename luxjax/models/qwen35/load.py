"""Build a Qwen35Backend from a Hugging Face directory or from GGUF files (decoder + optional mmproj)."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from luxjax.checkpoint import param_cache
from luxjax.checkpoint.quants import tensor_nbytes
from luxjax.checkpoint.weights import WeightSource
from luxjax.errors import ModelFormatError
from luxjax.models.qwen35.backend import Qwen35Backend
from luxjax.models.qwen35.config import ModelConfig
from luxjax.models.qwen35.model import Qwen35Model
from luxjax.models.qwen35.preprocess import Qwen35ImageProcessor
from luxjax.models.qwen35.weights_hf import read_hf_config, read_safetensors

log = logging.getLogger("luxjax.load")


def build(cfg: ModelConfig, tensors: dict, tokenizer, processor, dtype, *, origin: str, max_context=None):
    dtype = jnp.dtype(dtype)
    model = Qwen35Model(cfg, WeightSource(tensors, dtype, origin=origin), dtype)
    return Qwen35Backend(cfg, model, tokenizer, processor, dtype, max_context=max_context)


def load_hf_dir(path, dtype="bfloat16", *, max_context=None, progress=True, cache_dir=None) -> Qwen35Backend:
    from luxjax.text.tokenizer import Tokenizer

    started = time.perf_counter()
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.is_file())
    return _load(files, dtype, Tokenizer.from_hf_dir(path), lambda: _read_hf_dir(path, progress), origin=str(path),
                 started=started, max_context=max_context, cache_dir=cache_dir)


def _read_hf_dir(path: Path, progress: bool) -> tuple[dict, dict | None, dict]:
    raw = read_hf_config(path)
    tensors = read_safetensors(path, progress=progress)
    has_vision = bool(raw.get("vision_config")) and any(n.startswith("model.visual.") for n in tensors)
    if not has_vision:
        return {**raw, "vision_config": None}, None, tensors
    return raw, read_image_processor_config(path), tensors


def read_image_processor_config(path: Path) -> dict:
    """The image processor settings, found as transformers finds them: the "image_processor" object of
    processor_config.json (how transformers 5 saves a processor) first, else preprocessor_config.json."""
    nested = path / "processor_config.json"
    if nested.exists():
        processor = json.loads(nested.read_text())
        if isinstance(processor, dict) and isinstance(processor.get("image_processor"), dict):
            return processor["image_processor"]
    legacy = path / "preprocessor_config.json"
    if not legacy.exists():
        raise ModelFormatError(f"{path}: vision checkpoint without image processor settings (preprocessor_config.json,"
                               " or processor_config.json holding \"image_processor\")")
    return json.loads(legacy.read_text())


def load_gguf(path, mmproj=None, dtype="bfloat16", *, max_context=None, progress=True,
              cache_dir=None) -> Qwen35Backend:
    from gguf import GGUFReader

    from luxjax.checkpoint.gguf_reader import metadata_of, split_parts
    from luxjax.text.tokenizer import Tokenizer

    started = time.perf_counter()
    reader = GGUFReader(path)  # one parse of the header for the tokenizer and the list of split parts
    tokenizer = Tokenizer.from_gguf(reader)
    files = split_parts(path, metadata_of(reader)) + ([mmproj] if mmproj is not None else [])
    return _load(files, dtype, tokenizer, lambda: _read_gguf(path, mmproj, tokenizer, progress), origin=str(path),
                 started=started, max_context=max_context, cache_dir=cache_dir)


def _read_gguf(path, mmproj, tokenizer, progress: bool) -> tuple[dict, dict | None, dict]:
    from luxjax.checkpoint.gguf_mmproj import load_qwen35_mmproj
    from luxjax.checkpoint.gguf_qwen35 import load_qwen35_gguf

    decoder = load_qwen35_gguf(path, progress=progress)
    tensors = dict(decoder.tensors)
    raw = {"text_config": decoder.text_config}
    preprocessor = None
    if mmproj is not None:
        projector = load_qwen35_mmproj(mmproj, progress=progress)
        tensors.update(projector.tensors)
        raw["vision_config"] = projector.vision_config
        preprocessor = projector.preprocessor_config
    for key, token in (("image_token_id", "<|image_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
                       ("vision_end_token_id", "<|vision_end|>")):
        raw.setdefault(key, tokenizer.token_to_id(token))
    return raw, preprocessor, tensors


def _load(files, dtype, tokenizer, read, *, origin: str, started: float, max_context, cache_dir) -> Qwen35Backend:
    """Restore the prepared parameters from `cache_dir` when it holds these files, else `read()` the checkpoint
    -> (HF-style config, preprocessor config or None, tensors), build, and fill the cache."""
    key = param_cache.cache_key(files, dtype) if cache_dir is not None else None
    manifest = param_cache.load_manifest(cache_dir, key) if key is not None else None
    if manifest is not None:
        backend = _restore(cache_dir, key, manifest, tokenizer, dtype, max_context)
        return _report(backend, files, started, cache="hit")
    raw, preprocessor, tensors = read()
    manifest = {"config": raw, "preprocessor": preprocessor, "tensors": param_cache.tensor_specs(tensors)}
    backend = build(ModelConfig.from_hf(raw), tensors, tokenizer, _processor(preprocessor), dtype, origin=origin,
                    max_context=max_context)
    if key is None:
        return _report(backend, files, started, cache=None)
    param_cache.save_params(cache_dir, key, backend.state)
    param_cache.save_manifest(cache_dir, key, manifest)
    return _report(backend, files, started, cache="miss")


def _restore(cache_dir, key: str, manifest: dict, tokenizer, dtype, max_context) -> Qwen35Backend:
    """Build the model abstractly from the manifest (no tensor is read or converted), then fill it from the cache."""
    cfg = ModelConfig.from_hf(manifest["config"])
    dtype = jnp.dtype(dtype)
    abstract = nnx.eval_shape(
        lambda: Qwen35Model(cfg, WeightSource(param_cache.zero_tensors(manifest["tensors"]), dtype), dtype))
    graphdef, abstract_state = nnx.split(abstract)
    model = nnx.merge(graphdef, param_cache.load_params(cache_dir, key, abstract_state))
    return Qwen35Backend(cfg, model, tokenizer, _processor(manifest["preprocessor"]), dtype, max_context=max_context)


def _processor(preprocessor: dict | None) -> Qwen35ImageProcessor | None:
    return None if preprocessor is None else Qwen35ImageProcessor.from_preprocessor_config(preprocessor)


def _report(backend: Qwen35Backend, files, started: float, *, cache: str | None) -> Qwen35Backend:
    """Attach and log what the load cost: bytes on disk, bytes resident on device, wall time, and whether the
    parameter cache was used ("hit", "miss", or None without a cache)."""
    report = backend.load_report = {
        "file_bytes": sum(os.path.getsize(f) for f in files),
        "device_bytes": tensor_nbytes(backend.state),
        "seconds": time.perf_counter() - started,
        "cache": cache,
    }
    log.info("loaded %s: %d file bytes, %d device bytes, %.2f s, cache %s", ", ".join(Path(f).name for f in files),
             report["file_bytes"], report["device_bytes"], report["seconds"], cache)
    return backend
