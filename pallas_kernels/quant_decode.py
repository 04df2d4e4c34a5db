"""In-kernel decoders of ggml blocks for the fused dequantize-matmul (quant_matmul.py).

Each format says how to view its planes (free row-major reshapes of QuantizedTensor.planes, so every load in the
kernel has a power-of-two size, as Triton requires) and in which order the values of a block come out; the
wrapper permutes x into that order once, so the kernel never shuffles weights. `pieces` decodes KB blocks of
BN rows into float32 pieces, each paired with the index of the matching slice of the permuted x.

Values are exact float32 (as in luxjax.checkpoint.quant_formats): small integers become floats by the
2^23 magic-number trick (integer add/or + one float subtract) instead of int->float conversions, which run at
1/8 of the FMA rate on NVIDIA GPUs and would bound the decode GEMV.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from gguf.constants import GGMLQuantizationType as T

from luxjax.checkpoint.quant_formats import IQ4_KVALUES

MAGIC = 0x4B000000  # float32 bits of 2^23: OR in an integer < 2^23 and subtract 2^23 to get it as a float
SIGNED_MAGIC = 0x4B400000  # 1.5 * 2^23: add a signed integer in [-2^22, 2^22), subtract 1.5 * 2^23


def _u2f(v: jax.Array, bias: float = 0.0) -> jax.Array:
    """Unsigned integers < 2^23 -> float32 (v - bias), exact."""
    f = lax.bitcast_convert_type(v.astype(jnp.uint32) | MAGIC, jnp.float32)
    return f - (8388608.0 + bias)


def _s2f(v: jax.Array) -> jax.Array:
    """Signed integers (int8 planes) -> float32, exact."""
    f = lax.bitcast_convert_type(v.astype(jnp.int32) + SIGNED_MAGIC, jnp.float32)
    return f - 12582912.0


def _f16(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _iota(shape, dim) -> jax.Array:
    return lax.broadcasted_iota(jnp.uint32, shape, dim)


@dataclass(frozen=True)
class KernelFormat:
    block: int  # values per ggml block
    planes: dict[str, tuple[int, ...]]  # plane name -> trailing shape after [rows, blocks]
    x_split: tuple[int, ...]  # one block of x, split into these axes ...
    x_perm: tuple[int, ...]  # ... and transposed into the order the pieces come out
    piece: tuple[int, ...]  # trailing shape of every piece after [BN, KB]
    pieces: Callable  # (plane refs, block slice) -> [(w [BN, KB, *piece] f32, x index)]


def _q8_0(p, sl):
    d = _f16(p["d"][:, sl, :])  # [BN, KB, 1]
    return [(_s2f(p["qs"][:, sl, :]) * d, ())]  # [BN, KB, 32]


def _k_quant(p, sl, with_qh: bool):
    """Q4_K / Q5_K. Sub-block i = 4h + 2g + nib covers qs bytes (h, g, :), low (nib 0) or high nibbles."""
    d, dmin = _f16(p["d"][:, sl, :])[..., None], _f16(p["dmin"][:, sl, :])[..., None]  # [BN, KB, 1, 1]
    out = []
    for h in range(2):
        qs = p["qs"][:, sl, h].astype(jnp.uint32)  # [BN, KB, 2, 32]
        qh = p["qh"][:, sl, :][:, :, None].astype(jnp.uint32) if with_qh else None  # [BN, KB, 1, 32]
        for nib in range(2):
            # 6-bit scale/min of sub-blocks 4h + 2g + nib, g = 0, 1 (gguf Q4_K.get_scale_min).
            r0, r1, r2 = (p["scales"][:, sl, r, :, nib].astype(jnp.uint32) for r in range(3))  # [BN, KB, 2]
            if h == 0:
                sc, mn = r0 & 0x3F, r1 & 0x3F
            else:
                sc, mn = (r2 & 0xF) | ((r0 >> 6) << 4), (r2 >> 4) | ((r1 >> 6) << 4)
            q = (qs >> (4 * nib)) & 0xF
            if with_qh:
                shift = 4 * h + nib + 2 * _iota((1, 1, 2, 1), 2)
                q = q | (((qh >> shift) & 1) << 4)
            w = (d * _u2f(sc)[..., None]) * _u2f(q) - dmin * _u2f(mn)[..., None]
            out.append((w, (h, nib)))
    return out


def _q6_k(p, sl):
    """Value (half, shift, c, j): ql byte (half, c, j) nibble `shift`, qh byte (half, j) bits 4*shift + 2c."""
    d = _f16(p["d"][:, sl, :])[..., None, None]  # [BN, KB, 1, 1, 1]
    out = []
    for half in range(2):
        ql = p["ql"][:, sl, half].astype(jnp.uint32)  # [BN, KB, 2, 2, 16]
        qh = p["qh"][:, sl, half][:, :, None].astype(jnp.uint32)  # [BN, KB, 1, 2, 16]
        for shift in range(2):
            hi = (qh >> (4 * shift + 2 * _iota((1, 1, 2, 1, 1), 2))) & 3
            q = ((ql >> (4 * shift)) & 0xF) | (hi << 4)
            sc = _s2f(p["scales"][:, sl, half, shift])[..., None]  # [BN, KB, 2, 2, 1]
            out.append(((d * sc) * _u2f(q, 32.0), (half, shift)))
    return out


# IQ4's 16 codebook values as a degree-4 polynomial in the code q that misses none by more than 0.433 (minimax fit),
# so rounding it to the nearest integer gives the table exactly; float32 Horner error is ~1e-5. q is not shifted and
# the rounding is floor(p + 0.5), not the 1.5 * 2^23 add-and-subtract: compilers fold chains of constant additions
# (XLA:CPU turned q - 2^23 - 7.5 into q - (2^23 + 8), and optimised the rounding trick away).
_IQ4_POLY = (0.0015860428102314472, 0.03108643926680088, -1.37192702293396, 24.173830032348633, -126.56700897216797)


def _iq4_table(q: jax.Array) -> jax.Array:
    """IQ4 codebook lookup for 4-bit codes q, in float arithmetic (4 FMAs and a rounding) rather than a gather or
    a chain of integer selects and shifts (integer ops run at half the float32 rate on recent GPUs). Measured on
    an H200, the GEMV was about as fast as with the select chain (benchmarks/RESULTS.md, session 4)."""
    x = _u2f(q)
    p = jnp.full_like(x, _IQ4_POLY[0])
    for c in _IQ4_POLY[1:]:
        p = p * x + c
    return jnp.floor(p + 0.5)


def _iq4_xs(p, sl):
    """Sub-block g = 2*g2 + gp covers qs bytes (g2, gp, :): low nibbles are values 0..15, high ones 16..31."""
    d = _f16(p["d"][:, sl, :])[..., None]  # [BN, KB, 1, 1]
    sh = p["scales_h"][:, sl, :].astype(jnp.uint32)  # [BN, KB, 1]
    sl_bytes = p["scales_l"][:, sl, :].astype(jnp.uint32)  # [BN, KB, 4]
    out = []
    for gp in range(2):
        qs = p["qs"][:, sl, :, gp].astype(jnp.uint32)  # [BN, KB, 4, 16]
        hi = (sh >> (4 * _iota((1, 1, 4), 2) + 2 * gp)) & 3
        scale = _u2f(((sl_bytes >> (4 * gp)) & 0xF) | (hi << 4), 32.0)[..., None]  # [BN, KB, 4, 1]
        for nib in range(2):
            out.append(((d * scale) * _iq4_table((qs >> (4 * nib)) & 0xF), (gp, nib)))
    return out


_K_PLANES = {"d": (1,), "dmin": (1,), "scales": (3, 2, 2), "qs": (2, 2, 32)}

KERNEL_FORMATS: dict[T, KernelFormat] = {
    T.Q8_0: KernelFormat(32, {"d": (1,), "qs": (32,)}, (32,), (0,), (32,), _q8_0),
    T.Q4_K: KernelFormat(256, _K_PLANES, (2, 2, 2, 32), (0, 2, 1, 3), (2, 32),
                         lambda p, sl: _k_quant(p, sl, with_qh=False)),
    T.Q5_K: KernelFormat(256, {**_K_PLANES, "qh": (32,)}, (2, 2, 2, 32), (0, 2, 1, 3), (2, 32),
                         lambda p, sl: _k_quant(p, sl, with_qh=True)),
    T.Q6_K: KernelFormat(256, {"ql": (2, 2, 2, 16), "qh": (2, 2, 16), "scales": (2, 2, 2, 2), "d": (1,)},
                         (2, 2, 2, 2, 16), (0, 1, 2, 3, 4), (2, 2, 16), _q6_k),
    T.IQ4_XS: KernelFormat(256, {"d": (1,), "scales_h": (1,), "scales_l": (4,), "qs": (4, 2, 16)},
                           (4, 2, 2, 16), (1, 2, 0, 3), (4, 16), _iq4_xs),
}
