"""GGUF weights on device: float tensors as plain arrays, quantized ones packed, dequantized inside jitted code.

The packed form keeps the file's bytes (one device plane per block field, see quant_formats), so device memory
equals file size; dequantization is pure jnp and bit-identical to gguf.quants.dequantize.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from luxjax.checkpoint.quant_formats import FORMATS
from luxjax.errors import ModelFormatError

# Float types stay plain arrays in their file dtype (no copy to a wider type).
_FLOAT_DTYPES = {
    GGMLQuantizationType.F32: np.dtype(np.float32),
    GGMLQuantizationType.F16: np.dtype(np.float16),
    GGMLQuantizationType.BF16: np.dtype(jnp.bfloat16),
}


def _unsupported(ggml_type) -> ModelFormatError:
    name = getattr(ggml_type, "name", str(ggml_type))
    known = ", ".join(t.name for t in (*_FLOAT_DTYPES, *FORMATS))
    return ModelFormatError(f"GGML tensor type {name} is not supported (supported: {known})")


def _ggml_type(ggml_type) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType(ggml_type)
    except ValueError:
        raise _unsupported(ggml_type) from None


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A ggml-quantized tensor kept packed on device.

    planes: one array per block field, each [rows, blocks_per_row, n], rows = prod(shape[:-1]).
    shape: logical numpy shape; ggml blocks run along the last axis. dtype: default output dtype of dequantize.
    """

    planes: dict[str, jax.Array]
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    dtype: np.dtype

    @classmethod
    def from_gguf(cls, raw: np.ndarray, ggml_type, shape, dtype=jnp.float32) -> QuantizedTensor:
        """Pack raw block bytes (e.g. GGUFReader's tensor.data) of logical numpy shape `shape` onto the device."""
        ggml_type = _ggml_type(ggml_type)
        fmt = FORMATS.get(ggml_type)
        if fmt is None:
            raise _unsupported(ggml_type)
        shape = tuple(int(s) for s in shape)
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        if not shape or shape[-1] % block_size:
            raise ModelFormatError(
                f"{ggml_type.name} tensor of shape {shape}: last axis must be a multiple of {block_size}")
        rows, blocks = math.prod(shape[:-1]), shape[-1] // block_size
        raw = np.ascontiguousarray(raw).view(np.uint8)
        if raw.size != rows * blocks * type_size:
            raise ModelFormatError(
                f"{ggml_type.name} tensor of shape {shape} needs {rows * blocks * type_size} bytes, got {raw.size}")
        raw = raw.reshape(rows, blocks, type_size)
        planes, offset = {}, 0
        for f in fmt.fields:
            field = np.ascontiguousarray(raw[..., offset:offset + f.nbytes]).view(f.dtype)
            planes[f.name] = jnp.asarray(field)
            offset += f.nbytes
        return cls(planes, ggml_type, shape, jnp.dtype(dtype))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.planes.values())

    @property
    def ndim(self) -> int:
        return len(self.shape)


jax.tree_util.register_dataclass(
    QuantizedTensor, data_fields=["planes"], meta_fields=["ggml_type", "shape", "dtype"])

Weight = jax.Array | QuantizedTensor


def to_device_weight(raw: np.ndarray, ggml_type, shape, dtype=jnp.float32) -> Weight:
    """A GGUF tensor on device: F32/F16/BF16 as a plain array of that dtype, anything else as QuantizedTensor.

    `dtype` is the output dtype of dequantize for quantized tensors.
    """
    ggml_type = _ggml_type(ggml_type)
    float_dtype = _FLOAT_DTYPES.get(ggml_type)
    if float_dtype is None:
        return QuantizedTensor.from_gguf(raw, ggml_type, shape, dtype)
    data = np.ascontiguousarray(raw).view(np.uint8).view(float_dtype)
    if data.size != math.prod(shape):
        raise ModelFormatError(f"{ggml_type.name} tensor of shape {tuple(shape)} has {data.size} elements")
    return jnp.asarray(data.reshape(shape))


def dequantize(w: Weight, dtype=None) -> jax.Array:
    """The full tensor in `dtype` (default: w.dtype). Jittable; plain arrays are only cast."""
    if not isinstance(w, QuantizedTensor):
        return w if dtype is None else w.astype(dtype)
    blocks = FORMATS[w.ggml_type].decode(w.planes)
    return blocks.reshape(w.shape).astype(dtype or w.dtype)


def dequantize_rows(w: Weight, row_ids, dtype=None) -> jax.Array:
    """Rows `row_ids` (any int shape) of w viewed as [rows, shape[-1]] -> row_ids.shape + (shape[-1],).

    For embedding lookups: only the selected rows' blocks are gathered and decoded.
    """
    ids = jnp.asarray(row_ids)
    if not isinstance(w, QuantizedTensor):
        rows = w.reshape(-1, w.shape[-1])[ids]
        return rows if dtype is None else rows.astype(dtype)
    planes = {k: v[ids.reshape(-1)] for k, v in w.planes.items()}
    blocks = FORMATS[w.ggml_type].decode(planes)
    return blocks.reshape(*ids.shape, w.shape[-1]).astype(dtype or w.dtype)


def tensor_nbytes(tree) -> int:
    """Device bytes of all arrays in a pytree of params (QuantizedTensors count their packed planes)."""
    return sum(int(leaf.nbytes) for leaf in jax.tree_util.tree_leaves(tree) if hasattr(leaf, "nbytes"))
