"""Generic GGUF reading: metadata as Python values, tensors by name, and a planned, checked tensor load.

Model-specific modules (gguf_qwen35.py, gguf_mmproj.py) describe what they want as a list of `Wanted`; this module
checks presence and shapes for the whole list before anything is moved, then loads with a progress bar.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField, ReaderTensor
from gguf.quants import dequantize
from tqdm import tqdm

from luxjax.checkpoint.quants import tensor_nbytes
from luxjax.errors import ModelFormatError

# (raw tensor.data, ggml type, logical numpy-order shape) -> device array or packed QuantizedTensor
Materialize = Callable[[np.ndarray, GGMLQuantizationType, tuple[int, ...]], Any]

FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


@dataclass(frozen=True)
class LoadedCheckpoint:
    """Tensors under Hugging Face names plus HF-style configs; only the configs of the loaded part are set."""

    tensors: dict[str, Any]
    metadata: dict[str, Any]
    file_bytes: int
    text_config: dict[str, Any] | None = None
    vision_config: dict[str, Any] | None = None
    preprocessor_config: dict[str, Any] | None = None

    @property
    def device_bytes(self) -> int:
        return tensor_nbytes(self.tensors)


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (GGUF lists dims innermost-first; this is reversed)
    raw: np.ndarray  # tensor.data as GGUFReader maps it (packed bytes for quantized types)


@dataclass(frozen=True)
class Wanted:
    """One output tensor: its HF name, the GGUF tensor(s) it comes from and their expected numpy-order shape.

    Without `transform` the single source goes to `materialize` untouched (quantized data stays packed).
    With it, the sources are decoded to float32 and the transform's result is materialized as F32;
    `float_only` refuses quantized sources (the transform is only exact on float data), otherwise they are
    dequantized first (for small tensors that must be reshaped).
    """

    hf_name: str
    sources: tuple[str, ...]
    shape: tuple[int, ...]
    transform: Callable[..., np.ndarray] | None = None
    float_only: bool = True


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Every key/value pair of a GGUF file as Python values (str, int, float, bool, lists)."""
    return metadata_of(GGUFReader(path))


def metadata_of(reader: GGUFReader) -> dict[str, Any]:
    return {name: _field_value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _field_value(field: ReaderField) -> Any:
    """GGUF stores float32; give the shortest decimal that rounds to it (1e-06, not 9.999999974752427e-07)."""
    value = field.contents()
    if field.types[-1] != GGUFValueType.FLOAT32:
        return value
    if isinstance(value, list):
        return [_shortest_float32(v) for v in value]
    return _shortest_float32(value)


def _shortest_float32(value: float) -> float:
    return float(str(np.float32(value)))


def tensors_of(reader: GGUFReader) -> dict[str, GGUFTensor]:
    return {t.name: _tensor(t) for t in reader.tensors}


# llama.cpp's gguf-split (llama_split_path): PREFIX-00001-of-00003.gguf ...; the first part holds the metadata, every
# part its own tensors and the keys split.no (0-based), split.count and split.tensors.count (the total).
SPLIT_FILE_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_parts(path: str | os.PathLike, metadata: dict[str, Any]) -> list[Path]:
    """The files of a GGUF checkpoint, in order: [path] alone unless its metadata says it was split."""
    count = int(metadata.get("split.count") or 1)
    if count <= 1:
        return [Path(path)]
    number = int(metadata.get("split.no") or 0)
    if number != 0:
        raise ModelFormatError(f"{os.fspath(path)} is part {number + 1} of a GGUF split in {count}: give the first "
                               "part (...-00001-of-...), which holds the metadata")
    match = SPLIT_FILE_NAME.match(Path(path).name)
    if match is None or int(match["count"]) != count:
        raise ModelFormatError(f"{os.fspath(path)}: the first of {count} split parts, but its name is not llama.cpp's "
                               f"PREFIX-00001-of-{count:05d}.gguf, so the other parts cannot be found")
    parts = [Path(path).with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelFormatError(f"{os.fspath(path)}: split GGUF parts missing beside it: {', '.join(missing)}")
    return parts


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, GGUFTensor], int]:
    """(metadata, tensors, bytes on disk) of a GGUF checkpoint, a single file or the first of its split parts."""
    reader = GGUFReader(path)
    metadata = metadata_of(reader)
    parts = split_parts(path, metadata)
    tensors = tensors_of(reader)
    for number, part in enumerate(parts[1:], start=1):
        part_reader = GGUFReader(part)
        found = part_reader.fields.get("split.no")
        if found is None or int(found.contents()) != number:
            raise ModelFormatError(f"{part}: not part {number + 1} of the split GGUF {os.fspath(path)} (split.no)")
        for name, tensor in tensors_of(part_reader).items():
            if name in tensors:
                raise ModelFormatError(f"{part}: tensor {name} is also in an earlier split part")
            tensors[name] = tensor
    expected = int(metadata.get("split.tensors.count") or len(tensors))
    if len(parts) > 1 and len(tensors) != expected:
        raise ModelFormatError(f"{os.fspath(path)}: the split parts hold {len(tensors)} tensors, split.tensors.count "
                               f"says {expected}")
    return metadata, tensors, sum(os.path.getsize(p) for p in parts)


def _tensor(t: ReaderTensor) -> GGUFTensor:
    shape = tuple(int(d) for d in reversed(t.shape))
    return GGUFTensor(t.name, GGMLQuantizationType(t.tensor_type), shape, t.data)


def require_key(metadata: dict[str, Any], key: str, path: str | os.PathLike) -> Any:
    if key not in metadata:
        raise ModelFormatError(f"{os.fspath(path)}: metadata key {key!r} is missing")
    return metadata[key]


def load_wanted(
    tensors: dict[str, GGUFTensor],
    wanted: Sequence[Wanted],
    *,
    path: str | os.PathLike,
    materialize: Materialize,
    progress: bool,
) -> dict[str, Any]:
    """Check every wanted tensor (presence, shape, float type where required) first, then load them all."""
    _check_present(tensors, wanted, path)
    for w in wanted:
        for name in w.sources:
            _check_tensor(tensors[name], w, path)
    loaded = {}
    for w in tqdm(wanted, desc=f"loading {os.path.basename(path)}", unit="tensor", disable=not progress):
        try:
            loaded[w.hf_name] = _load_one(tensors, w, materialize)
        except ModelFormatError as e:
            raise ModelFormatError(f"{os.fspath(path)}: tensor {', '.join(w.sources)}: {e}") from e
    return loaded


def _check_present(tensors: dict[str, GGUFTensor], wanted: Sequence[Wanted], path: str | os.PathLike) -> None:
    missing = [name for w in wanted for name in w.sources if name not in tensors]
    if missing:
        raise ModelFormatError(f"{os.fspath(path)}: missing required tensors: {', '.join(missing)}")


def _check_tensor(t: GGUFTensor, w: Wanted, path: str | os.PathLike) -> None:
    if t.shape != w.shape:
        raise ModelFormatError(
            f"{os.fspath(path)}: tensor {t.name} has shape {list(t.shape)} (numpy order), expected {list(w.shape)} "
            "from the metadata"
        )
    if w.transform is not None and w.float_only and t.ggml_type not in FLOAT_TYPES:
        raise ModelFormatError(
            f"{os.fspath(path)}: tensor {t.name} is {t.ggml_type.name}; it must be F32/F16/BF16 "
            f"(it needs a value transform to become {w.hf_name})"
        )


def _load_one(tensors: dict[str, GGUFTensor], w: Wanted, materialize: Materialize) -> Any:
    sources = [tensors[name] for name in w.sources]
    if w.transform is None:
        (t,) = sources
        return materialize(t.raw, t.ggml_type, t.shape)
    values = np.ascontiguousarray(w.transform(*(_float32_values(t) for t in sources)), dtype=np.float32)
    return materialize(values, GGMLQuantizationType.F32, values.shape)


def _float32_values(t: GGUFTensor) -> np.ndarray:
    return dequantize(t.raw, t.ggml_type).reshape(t.shape).astype(np.float32, copy=False)
