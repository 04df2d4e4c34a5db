"""An on-disk cache of prepared parameters, so that a second start skips reading and converting the checkpoint.

An entry is a folder DIR/<key>/ holding `params/` (an orbax checkpoint of the model's nnx state: float arrays in
the compute dtype, quantized weights as their packed planes) and `manifest.json` (what rebuilds the abstract state
without the checkpoint: the configs and the shape, dtype and packing of every source tensor). The manifest is
written last, so an entry without one is incomplete and misses.

The key fingerprints each file (path, size, mtime, first and last MiB), the dtype, the luxjax version and the
packed planes' layout (quant_formats.FORMATS): a changed file, release or packing misses instead of restoring stale
weights (the layout apart from the version, because an editable install keeps its version string while the code
moves). Hashing only the ends keeps the key cheap on 100 GB files; the size and mtime catch edits in the middle.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from gguf import GGMLQuantizationType

from luxjax.checkpoint.quant_formats import FORMATS
from luxjax.checkpoint.quants import QuantizedTensor

FINGERPRINT_BYTES = 1 << 20
MANIFEST = "manifest.json"
PARAMS = "params"


def cache_key(files: Sequence[str | os.PathLike], dtype) -> str:
    digest = hashlib.sha256()
    digest.update(f"luxjax {importlib.metadata.version('luxjax')} dtype {jnp.dtype(dtype).name}\n".encode())
    digest.update(packing_layout().encode())
    for file in files:
        _fingerprint(digest, Path(file))
    return digest.hexdigest()


def packing_layout() -> str:
    """Every quantized format's planes as name/bytes/dtype, one line per format."""
    return "".join(f"{t.name}: " + " ".join(f"{f.name}/{f.nbytes}/{np.dtype(f.dtype).name}" for f in fmt.fields) + "\n"
                   for t, fmt in FORMATS.items())


def _fingerprint(digest, path: Path) -> None:
    stat = path.stat()
    digest.update(f"{path.resolve()} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    with path.open("rb") as f:
        digest.update(f.read(FINGERPRINT_BYTES))
        f.seek(max(stat.st_size - FINGERPRINT_BYTES, 0))
        digest.update(f.read(FINGERPRINT_BYTES))


def save_params(directory: str | os.PathLike, key: str, state) -> None:
    """Write the state (any pytree of arrays, QuantizedTensors included) under the key, replacing a partial one."""
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(_entry(directory, key) / PARAMS, state, force=True)


def load_params(directory: str | os.PathLike, key: str, abstract_state):
    """The state saved under the key, restored into the structure of `abstract_state` (ShapeDtypeStruct leaves),
    on the default device."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract_state)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(_entry(directory, key) / PARAMS, target)


def save_manifest(directory: str | os.PathLike, key: str, manifest: dict[str, Any]) -> None:
    path = _entry(directory, key) / MANIFEST
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(manifest))
    partial.replace(path)


def load_manifest(directory: str | os.PathLike, key: str) -> dict[str, Any] | None:
    """The entry's manifest, or None when there is no complete entry for the key."""
    path = _entry(directory, key) / MANIFEST
    return json.loads(path.read_text()) if path.exists() else None


def _entry(directory: str | os.PathLike, key: str) -> Path:
    return Path(directory).resolve() / key


def tensor_specs(tensors: dict[str, Any]) -> dict[str, dict]:
    """JSON description of loaded tensors (arrays or QuantizedTensors), enough to rebuild them abstractly."""
    return {name: _spec(value) for name, value in tensors.items()}


def _spec(value) -> dict:
    if isinstance(value, QuantizedTensor):
        return {
            "ggml_type": int(value.ggml_type),
            "shape": list(value.shape),
            "dtype": np.dtype(value.dtype).name,
            "planes": {k: _spec(p) for k, p in value.planes.items()},
        }
    return {"shape": list(value.shape), "dtype": np.dtype(value.dtype).name}


def zero_tensors(specs: dict[str, dict]) -> dict[str, Any]:
    """Zero tensors of the described shapes; meant to run under eval_shape, where they cost nothing."""
    return {name: _zeros(spec) for name, spec in specs.items()}


def _zeros(spec: dict):
    if "planes" in spec:
        planes = {k: _zeros(p) for k, p in spec["planes"].items()}
        return QuantizedTensor(planes, GGMLQuantizationType(spec["ggml_type"]), tuple(spec["shape"]), jnp.dtype(spec["dtype"]))
    return jnp.zeros(spec["shape"], jnp.dtype(spec["dtype"]))
