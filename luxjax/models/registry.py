"""The one explicit table from architecture name to loader. Adding a model = a folder + one line here."""
from __future__ import annotations

import json
from pathlib import Path

from luxjax.errors import ModelFormatError
from luxjax.models.qwen35 import load as qwen35

HF_ARCHITECTURES = {
    "Qwen3_5ForConditionalGeneration": qwen35.load_hf_dir,
    "Qwen3_5ForCausalLM": qwen35.load_hf_dir,
}
HF_MODEL_TYPES = {  # for a config.json without "architectures" (transformers' Auto classes go by model_type)
    "qwen3_5": qwen35.load_hf_dir,
    "qwen3_5_text": qwen35.load_hf_dir,
}
GGUF_ARCHITECTURES = {
    "qwen35": qwen35.load_gguf,
}


def load_backend(path: Path, mmproj: Path | None, dtype, **kw):
    if path.is_dir():
        if mmproj is not None:
            raise ModelFormatError("--mmproj goes with a GGUF decoder; a Hugging Face directory carries its own vision tower")
        config = path / "config.json"
        if not config.exists():
            raise ModelFormatError(f"{path}: not a Hugging Face model directory (no config.json)")
        raw = json.loads(config.read_text())
        archs = raw.get("architectures") or []
        for arch in archs:
            if arch in HF_ARCHITECTURES:
                return HF_ARCHITECTURES[arch](path, dtype, **kw)
        if not archs and raw.get("model_type") in HF_MODEL_TYPES:
            return HF_MODEL_TYPES[raw["model_type"]](path, dtype, **kw)
        raise ModelFormatError(f"{path}: architectures {archs} / model_type {raw.get('model_type')!r} are not supported "
                               f"(known: {sorted(HF_ARCHITECTURES)}, model types {sorted(HF_MODEL_TYPES)})")
    if path.suffix == ".gguf":
        from luxjax.checkpoint.gguf_reader import read_gguf_metadata

        arch = read_gguf_metadata(path).get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ModelFormatError(f"{path}: GGUF architecture {arch!r} is not supported (known: {sorted(GGUF_ARCHITECTURES)})")
        return GGUF_ARCHITECTURES[arch](path, mmproj, dtype, **kw)
    raise ModelFormatError(f"{path}: expected a Hugging Face directory or a .gguf file")
