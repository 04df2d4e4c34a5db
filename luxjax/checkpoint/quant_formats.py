"""Block layouts of ggml quantized types and their jnp decoders, mirroring gguf.quants.

A format names the fields of one block in byte order; each field becomes its own device plane of shape
[rows, blocks_per_row, n] (n = field bytes / itemsize), so a decoder reads aligned fields without byte gathers.
A decoder maps those planes to float32 [rows, blocks_per_row, block_size]. IQ4_XS's codes are viewed as uint32
words (four bytes each, little-endian) for the GPU kernel, which looks codes up a word at a time
(pallas_kernels/quant_decode.py).

Why the results are bit-identical to gguf.quants (numpy): every scale-times-quant product below is exact in
float32 (an f16 scale has at most 11 significant bits; sub-scale and quant together add at most 12), so neither the order
of the products nor fused multiply-adds can change a bit, and the one rounding step (subtracting or adding a min)
sees the same two exact operands as numpy. Scale products are never float32 subnormals (every operand is a
multiple of 2^-24), except MXFP4's, which is built from exponent bits instead (see _times_pow2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

Planes = Mapping[str, jax.Array]

# gguf.quants.IQ4_NL.kvalues (shared by IQ4_XS) and MXFP4.kvalues (e2m1 values, doubled).
IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


@dataclass(frozen=True)
class Field:
    name: str
    nbytes: int
    dtype: type  # numpy dtype the field's bytes are viewed as


@dataclass(frozen=True)
class QuantFormat:
    fields: tuple[Field, ...]
    decode: Callable[[Planes], jax.Array]


def _f16(bits: jax.Array) -> jax.Array:
    """float16 bits -> float32, exact (like numpy's view(float16).astype(float32))."""
    return lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _unpack(x: jax.Array, group: int, shifts, mask: int) -> jax.Array:
    """[..., k*group] -> [..., k, len(shifts), group] bit fields, as gguf's
    `x.reshape(..., -1, 1, group) >> shifts.reshape(-1, 1)` followed by `& mask`."""
    x = x.reshape(*x.shape[:-1], -1, 1, group)
    return (x >> jnp.asarray(shifts, x.dtype).reshape(-1, 1)) & mask


def _merge(x: jax.Array, n: int) -> jax.Array:
    """Flatten the last n axes into one."""
    return x.reshape(*x.shape[:-n], -1)


def _lookup(table, idx: jax.Array) -> jax.Array:
    return jnp.asarray(table, jnp.float32)[idx.astype(jnp.int32)]


def _nibbles32(qs: jax.Array) -> jax.Array:
    """16 bytes per 32-value block -> 32 nibbles: all low nibbles, then all high ones."""
    return _merge(_unpack(qs, 16, (0, 4), 0xF), 3)


def _bits32(qh: jax.Array) -> jax.Array:
    """uint32 [..., 1] -> [..., 32] of its bits, bit i for value i (Q5_0 / Q5_1 high bits)."""
    return _merge(_unpack(qh, 1, range(32), 1), 3)


def _times_pow2(x: jax.Array, n: jax.Array) -> jax.Array:
    """x * 2**n for small exact float32 x, composed on the exponent bits.

    MXFP4's E8M0 scales 0 and 1 are float32 subnormals (2^-128, 2^-127) that XLA:CPU flushes to zero in any
    float multiply; building the bits gives numpy's exact product (subnormal, normal or inf) on every backend.
    """
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    sign = bits & jnp.uint32(0x80000000)
    mant = bits & 0x7FFFFF
    field = ((bits >> 23) & 0xFF).astype(jnp.int32) + n  # biased exponent of the product
    normal = (field.astype(jnp.uint32) << 23) | mant
    subnormal = (mant | 0x800000) >> jnp.clip(1 - field, 0, 31).astype(jnp.uint32)
    mag = jnp.where(field >= 255, jnp.uint32(0x7F800000), jnp.where(field >= 1, normal, subnormal))
    mag = jnp.where((bits & 0x7FFFFFFF) == 0, jnp.uint32(0), mag)
    return lax.bitcast_convert_type(sign | mag, jnp.float32)


def _k_scale_min(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q4_K/Q5_K: 12 bytes of packed 6-bit values -> 8 sub-block scales and 8 mins (gguf Q4_K.get_scale_min)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4_0(p: Planes) -> jax.Array:
    q = _nibbles32(p["qs"]).astype(jnp.int32) - 8
    return _f16(p["d"]) * q.astype(jnp.float32)


def _q4_1(p: Planes) -> jax.Array:
    return _f16(p["d"]) * _nibbles32(p["qs"]).astype(jnp.float32) + _f16(p["m"])


def _q5(p: Planes) -> jax.Array:
    """5-bit values of Q5_0/Q5_1, unsigned."""
    return (_nibbles32(p["qs"]) | (_bits32(p["qh"]).astype(jnp.uint8) << 4)).astype(jnp.int32)


def _q5_0(p: Planes) -> jax.Array:
    return _f16(p["d"]) * (_q5(p) - 16).astype(jnp.float32)


def _q5_1(p: Planes) -> jax.Array:
    return _f16(p["d"]) * _q5(p).astype(jnp.float32) + _f16(p["m"])


def _q8_0(p: Planes) -> jax.Array:
    return p["qs"].astype(jnp.float32) * _f16(p["d"])


def _iq4_nl(p: Planes) -> jax.Array:
    return _f16(p["d"]) * _lookup(IQ4_KVALUES, _nibbles32(p["qs"]))


def _mxfp4(p: Planes) -> jax.Array:
    """value = e2m1(q) * 2^(e - 128): gguf's e8m0_to_fp32_half(e) is exactly 2^(e-128) for every e."""
    k = _lookup(E2M1_DOUBLED, _nibbles32(p["qs"]))
    return _times_pow2(k, p["e"].astype(jnp.int32) - 128)


def _q2_k(p: Planes) -> jax.Array:
    sc = p["scales"]
    dl = (_f16(p["d"]) * (sc & 0xF).astype(jnp.float32))[..., None]
    ml = (_f16(p["dmin"]) * (sc >> 4).astype(jnp.float32))[..., None]
    q = _unpack(p["qs"], 32, (0, 2, 4, 6), 3)
    q = q.reshape(*q.shape[:-3], 16, 16).astype(jnp.float32)
    return _merge(dl * q - ml, 2)


def _q3_k(p: Planes) -> jax.Array:
    s = p["scales"]
    lo = _merge(_unpack(s[..., :8], 8, (0, 4), 0xF), 3)
    hi = _merge(_unpack(s[..., 8:], 4, (0, 2, 4, 6), 3), 3)
    scales = ((lo | (hi << 4)).astype(jnp.int32) - 32).astype(jnp.float32)
    dl = (_f16(p["d"]) * scales)[..., None]
    ql = _unpack(p["qs"], 32, (0, 2, 4, 6), 3)
    ql = ql.reshape(*ql.shape[:-3], 16, 16).astype(jnp.int32)
    qh = _unpack(p["hmask"], 32, range(8), 1) ^ 1  # the -4 offset applies where the mask bit is 0
    qh = qh.reshape(*qh.shape[:-3], 16, 16).astype(jnp.int32)
    return _merge(dl * (ql - (qh << 2)).astype(jnp.float32), 2)


def _k_scaled(p: Planes, q: jax.Array) -> jax.Array:
    """Q4_K/Q5_K: d*sc * q - dmin*m over 8 sub-blocks of 32 unsigned values q [..., 8, 32]."""
    sc, mn = _k_scale_min(p["scales"])
    d = (_f16(p["d"]) * sc.astype(jnp.float32))[..., None]
    dm = (_f16(p["dmin"]) * mn.astype(jnp.float32))[..., None]
    return _merge(d * q.astype(jnp.float32) - dm, 2)


def _k_low_nibbles(qs: jax.Array) -> jax.Array:
    """128 bytes -> [..., 8, 32]: per 32-byte group, its low nibbles then its high nibbles."""
    q = _unpack(qs, 32, (0, 4), 0xF)
    return q.reshape(*q.shape[:-3], 8, 32)


def _q4_k(p: Planes) -> jax.Array:
    return _k_scaled(p, _k_low_nibbles(p["qs"]))


def _q5_k(p: Planes) -> jax.Array:
    qh = _unpack(p["qh"], 32, range(8), 1)
    qh = qh.reshape(*qh.shape[:-3], 8, 32)
    return _k_scaled(p, _k_low_nibbles(p["qs"]) | (qh << 4))


def _q6_k(p: Planes) -> jax.Array:
    ql = _unpack(p["ql"], 64, (0, 4), 0xF)
    ql = ql.reshape(*ql.shape[:-3], 8, 32)
    qh = _unpack(p["qh"], 32, (0, 2, 4, 6), 3)
    qh = qh.reshape(*qh.shape[:-3], 8, 32)
    q = (ql | (qh << 4)).astype(jnp.int32) - 32
    q = q.reshape(*q.shape[:-2], 16, 16).astype(jnp.float32)
    d = (_f16(p["d"]) * p["scales"].astype(jnp.float32))[..., None]
    return _merge(d * q, 2)


def _bytes(words: jax.Array) -> jax.Array:
    """uint32 [..., n] -> uint8 [..., 4n], the bytes in memory order (little-endian words)."""
    return _merge(_unpack(words, 1, (0, 8, 16, 24), 0xFF), 3).astype(jnp.uint8)


def _iq4_xs(p: Planes) -> jax.Array:
    lo = _merge(_unpack(p["scales_l"], 1, (0, 4), 0xF), 3)  # byte-wise: low nibble, then high
    hi = _merge(_unpack(p["scales_h"], 1, range(0, 16, 2), 3), 3)
    scales = (lo.astype(jnp.int32) | (hi.astype(jnp.int32) << 4)) - 32
    dl = (_f16(p["d"]) * scales.astype(jnp.float32))[..., None]
    q = _unpack(_bytes(p["qs"]), 16, (0, 4), 0xF)
    q = q.reshape(*q.shape[:-3], 8, 32)
    return _merge(dl * _lookup(IQ4_KVALUES, q), 2)


u8, i8, u16, u32 = np.uint8, np.int8, np.uint16, np.uint32

FORMATS: dict[T, QuantFormat] = {
    T.Q4_0: QuantFormat((Field("d", 2, u16), Field("qs", 16, u8)), _q4_0),
    T.Q4_1: QuantFormat((Field("d", 2, u16), Field("m", 2, u16), Field("qs", 16, u8)), _q4_1),
    T.Q5_0: QuantFormat((Field("d", 2, u16), Field("qh", 4, u32), Field("qs", 16, u8)), _q5_0),
    T.Q5_1: QuantFormat((Field("d", 2, u16), Field("m", 2, u16), Field("qh", 4, u32), Field("qs", 16, u8)), _q5_1),
    T.Q8_0: QuantFormat((Field("d", 2, u16), Field("qs", 32, i8)), _q8_0),
    T.IQ4_NL: QuantFormat((Field("d", 2, u16), Field("qs", 16, u8)), _iq4_nl),
    T.MXFP4: QuantFormat((Field("e", 1, u8), Field("qs", 16, u8)), _mxfp4),
    T.Q2_K: QuantFormat(
        (Field("scales", 16, u8), Field("qs", 64, u8), Field("d", 2, u16), Field("dmin", 2, u16)), _q2_k),
    T.Q3_K: QuantFormat(
        (Field("hmask", 32, u8), Field("qs", 64, u8), Field("scales", 12, u8), Field("d", 2, u16)), _q3_k),
    T.Q4_K: QuantFormat(
        (Field("d", 2, u16), Field("dmin", 2, u16), Field("scales", 12, u8), Field("qs", 128, u8)), _q4_k),
    T.Q5_K: QuantFormat(
        (Field("d", 2, u16), Field("dmin", 2, u16), Field("scales", 12, u8), Field("qh", 32, u8),
         Field("qs", 128, u8)), _q5_k),
    T.Q6_K: QuantFormat(
        (Field("ql", 128, u8), Field("qh", 64, u8), Field("scales", 16, i8), Field("d", 2, u16)), _q6_k),
    T.IQ4_XS: QuantFormat(
        (Field("d", 2, u16), Field("scales_h", 2, u16), Field("scales_l", 4, u8), Field("qs", 128, u32)), _iq4_xs),
}


def _check_block_sizes() -> None:
    for ggml_type, fmt in FORMATS.items():
        assert sum(f.nbytes for f in fmt.fields) == GGML_QUANT_SIZES[ggml_type][1], ggml_type.name


_check_block_sizes()
