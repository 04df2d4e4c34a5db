"""Hugging Face directory loader: config.json + (sharded) safetensors in bf16/f16/f32."""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm import tqdm

from luxjax.errors import ModelFormatError

SUPPORTED_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")


def read_hf_config(path: Path) -> dict:
    cfg = json.loads((path / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs) and cfg.get("model_type") not in ("qwen3_5", "qwen3_5_text"):
        raise ModelFormatError(f"{path}: architectures {archs} / model_type {cfg.get('model_type')!r} is not Qwen3.5")
    quantization = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise ModelFormatError(f"{path}: a {method!r}-quantized Hugging Face checkpoint (config.json "
                               "quantization_config); luxjax reads bf16/f16/f32 safetensors, or GGUF files for packed "
                               "weights")
    return cfg


def _safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{path}: no .safetensors files")
    return files


def read_safetensors(path: Path, *, progress: bool = True) -> dict[str, np.ndarray]:
    """All tensors as numpy (bf16 via ml_dtypes), with HF text-only prefixes mapped to the VL names."""
    tensors: dict[str, np.ndarray] = {}
    files = _safetensor_files(path)
    for file in tqdm(files, desc="reading safetensors", unit="file", disable=not progress or len(files) < 2):
        for name, array in _memmap_safetensors(file).items():
            if name.startswith("mtp."):
                continue  # multi-token-prediction head: not used for generation
            tensors[_canonical_name(name)] = array
    return tensors


_SAFETENSORS_DTYPES = {
    "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def _memmap_safetensors(file: Path) -> dict[str, np.ndarray]:
    """Zero-copy views of a safetensors file (numpy itself cannot read bf16 through the safetensors package)."""
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + header_len)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ModelFormatError(f"{file.name}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        out[name] = data[begin:end].view(_SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def _canonical_name(name: str) -> str:
    """Qwen3_5ForCausalLM checkpoints store `model.layers...`; the VL model stores `model.language_model.layers...`."""
    if name.startswith("model.") and not name.startswith(("model.language_model.", "model.visual.")):
        return "model.language_model." + name[len("model."):]
    return name
