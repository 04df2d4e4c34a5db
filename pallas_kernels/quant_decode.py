"""In-kernel decoders of ggml blocks for the fused dequantize-matmul (quant_matmul.py).

Each format says how to view its planes (free row-major reshapes of QuantizedTensor.planes, so every load in the
kernel has a power-of-two size, as Triton requires) and in which order the values of a block come out; the
wrapper permutes x into that order once, so the kernel never shuffles weights. `pieces` decodes KB blocks of
BN rows into Pieces: integer-valued float32 values, each paired with the index of the matching slice of the
permuted x, and their sub-block scales (and offsets).

Values are exact float32 (as in luxjax.checkpoint.quant_formats): small integers become floats by the
2^23 magic-number trick (integer add/or + one float subtract) instead of int->float conversions, which run at
1/8 of the FMA rate on NVIDIA GPUs and would bound the decode GEMV.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from gguf.constants import GGMLQuantizationType as T

from luxjax.checkpoint.quant_formats import IQ4_KVALUES
from pallas_kernels.byte_perm import byte_perm
from pallas_kernels.fma import fma

MAGIC = 0x4B000000  # float32 bits of 2^23: OR in an integer < 2^23 and subtract 2^23 to get it as a float
SIGNED_MAGIC = 0x4B400000  # 1.5 * 2^23: add a signed integer in [-2^22, 2^22), subtract 1.5 * 2^23
ROUND_MAGIC = 12582912.0  # 1.5 * 2^23, where float32 spacing is 1: adding it rounds to an integer


class Magic(NamedTuple):
    """The magic numbers as values loaded at run time, not literals: an OR with a register folds into the mask
    before it (one LOP3 on NVIDIA instead of two), and compilers cannot fold the rounding trick's constant additions
    away (XLA turns (a + (c + M)) - M into a + c). The kernel wrapper passes KERNEL_CONSTANTS, and whether to look
    IQ4 codes up by byte permutes (`use_byte_perm`, static: where the platform has the instruction)."""

    bits: jax.Array  # uint32 MAGIC
    round: jax.Array  # float32 ROUND_MAGIC
    iq4_table: tuple[jax.Array, ...]  # four uint32 words: IQ4 codebook + IQ4_BIAS, one byte per code
    use_byte_perm: bool = False


IQ4_BIAS = 128  # added to the codebook so each value is an unsigned byte (1..241)
IQ4_TABLE_WORDS = tuple(sum((IQ4_KVALUES[4 * w + i] + IQ4_BIAS) << (8 * i) for i in range(4)) for w in range(4))
IQ4_SIGNED_TABLE_WORDS = tuple(sum((IQ4_KVALUES[4 * w + i] & 0xFF) << (8 * i) for i in range(4)) for w in range(4))
# uint32: MAGIC; SIGNED_MAGIC, which are the bits of ROUND_MAGIC; the IQ4 table words
KERNEL_CONSTANTS = (MAGIC, SIGNED_MAGIC, *IQ4_TABLE_WORDS)


def kernel_magic(const_ref, *, use_byte_perm: bool, interpret: bool) -> Magic:
    """The Magic numbers from a kernel's ref of KERNEL_CONSTANTS."""
    magic = (const_ref[0], lax.bitcast_convert_type(const_ref[1], jnp.float32),
             tuple(const_ref[2 + i] for i in range(len(KERNEL_CONSTANTS) - 2)))
    if interpret:  # interpreted, the kernel is XLA ops on a constant input: keep XLA from folding the rounding away
        magic = lax.optimization_barrier(magic)
    return Magic(*magic, use_byte_perm=use_byte_perm)


def _u2f(v: jax.Array, magic: Magic, bias: float = 0.0) -> jax.Array:
    """Unsigned integers < 2^23 -> float32 (v - bias), exact."""
    f = lax.bitcast_convert_type(v.astype(jnp.uint32) | magic.bits, jnp.float32)
    return f - (8388608.0 + bias)


def _s2f(v: jax.Array) -> jax.Array:
    """Signed integers (int8 planes) -> float32, exact."""
    f = lax.bitcast_convert_type(v.astype(jnp.int32) + SIGNED_MAGIC, jnp.float32)
    return f - 12582912.0


def _f16(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _iota(shape, dim) -> jax.Array:
    return lax.broadcasted_iota(jnp.uint32, shape, dim)


class Piece(NamedTuple):
    """Part of a tile of weights, w = values * scale + offset, for each (values, x index) term: integer-valued
    float32 values [BN, KB, *piece] (the x index says which slice of the permuted x block they multiply) and, per
    group along the last axis (one ggml sub-block, or two halves of one), `scale` and an optional `offset`
    [BN, KB, *piece[:-1], 1]. The GEMV sums values * x over each group's terms before scaling it, and takes the
    offset times the group's sum of x, so a weight costs one multiply-add, not two."""

    terms: tuple[tuple[jax.Array, tuple[int, ...]], ...]
    scale: jax.Array
    offset: jax.Array | None = None


@dataclass(frozen=True)
class KernelFormat:
    block: int  # values per ggml block
    planes: dict[str, tuple[int, ...]]  # plane name -> trailing shape after [rows, blocks]
    x_split: tuple[int, ...]  # one block of x, split into these axes ...
    x_perm: tuple[int, ...]  # ... and transposed into the order the pieces come out
    piece: tuple[int, ...]  # trailing shape of every piece after [BN, KB]
    pieces: Callable  # (plane refs, block slice, Magic) -> [Piece]
    has_offset: bool = False  # whether pieces carry offsets (one term each; the kernel then needs x's group sums)
    # Most rows of x the GEMV reduce takes by default (each weight decoded once, one multiply-add per row); more go
    # to the tensor-core regime. Where each measured faster on an H200 (benchmarks/bench_decode_gemv.py --rows-sweep).
    reduce_rows: int = 1


def in_kernel_order(x: jax.Array, fmt: KernelFormat) -> jax.Array:
    """x [..., K] -> [..., K / block, *permuted block]: each block's values in the order the format's pieces emit
    them, so that a kernel multiplies decoded weights by x without shuffling either."""
    xp = x.reshape(*x.shape[:-1], x.shape[-1] // fmt.block, *fmt.x_split)
    lead = x.ndim
    return xp.transpose(*range(lead), *(lead + a for a in fmt.x_perm))


def _q8_0(p, sl, magic):
    d = _f16(p["d"][:, sl, :])  # [BN, KB, 1]
    return [Piece(((_s2f(p["qs"][:, sl, :]), ()),), d)]  # [BN, KB, 32]


def _k_quant(p, sl, magic, with_qh: bool):
    """Q4_K / Q5_K. Sub-block i = 4h + 2g + nib covers qs bytes (h, g, :), low (nib 0) or high nibbles. High
    nibbles stay in place (16 q, no shift) and their scale is divided by 16, exactly."""
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
            scale = d * _u2f(sc, magic)[..., None]
            offset = -(dmin * _u2f(mn, magic)[..., None])
            if with_qh:
                q = (qs >> (4 * nib)) & 0xF
                shift = 4 * h + nib + 2 * _iota((1, 1, 2, 1), 2)
                values = _u2f(q | (((qh >> shift) & 1) << 4), magic)
            else:
                values = _u2f(qs & (0xF << (4 * nib)), magic)
                scale = scale * (1.0 / 16**nib)
            out.append(Piece(((values, (h, nib)),), scale, offset))
    return out


def _q6_k(p, sl, magic):
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
            out.append(Piece(((_u2f(q, magic, 32.0), (half, shift)),), d * sc))
    return out


# IQ4's 16 codebook values as -127 + a degree-4 polynomial in the code q, the minimax fit with that integer constant
# term: it misses no value by more than 0.440, and float32 Horner adds ~1e-5. Adding ROUND_MAGIC in the last
# multiply-add rounds to the nearest integer for free; subtracting it again gives the table value exactly.
_IQ4_POLY = (0.0014480184763669968, 0.03627324849367142, -1.4385637044906616, 24.500598907470703)
_IQ4_CONSTANT = -127.0


def _iq4_table(q: jax.Array, magic: Magic) -> jax.Array:
    """IQ4 codebook lookup for 4-bit codes in float arithmetic: 4 fused multiply-adds and one subtraction per
    value, rather than a gather (none in Triton's Pallas) or a chain of integer selects. Where the platform has a
    byte permute, iq4_codes_by_byte_perm is cheaper."""
    x = _u2f(q, magic)
    p = jnp.full_like(x, _IQ4_POLY[0])
    for c in _IQ4_POLY[1:]:
        p = fma(p, x, c)
    return fma(p, x, _IQ4_CONSTANT + magic.round) - magic.round


def iq4_codes_by_byte_perm(words: jax.Array, magic: Magic) -> list[jax.Array]:
    """Table bytes (magic.iq4_table's: IQ4_TABLE_WORDS, the codebook + IQ4_BIAS, for the float decoders;
    IQ4_SIGNED_TABLE_WORDS for integer dot products) of the eight codes in each uint32 word, as two words of four bytes:
    [code 0, 1, 2, 3] and [code 4, 5, 6, 7] (code i = nibble i). Each half looks its four codes' low three bits up
    in both halves of the table, then picks per code by its top bit: 12 instructions per eight codes on NVIDIA (six
    permutes, the index's mask and the selector's shift, mask and merge, and a shift of each for the second half)."""
    t0, t1, t2, t3 = magic.iq4_table
    index = words & 0x77777777
    pick = ((words >> 1) & 0x44444444) | 0x32103210  # per code: byte i of the low (0..3) or high (4..7) lookup
    out = []
    for half in range(2):
        idx, sel = index >> (16 * half), pick >> (16 * half)
        out.append(byte_perm(byte_perm(t0, t1, idx), byte_perm(t2, t3, idx), sel))
    return out


def iq4_xs_scales(p, sl, magic) -> jax.Array:
    """The sub-block scales d * (6-bit scale - 32) of IQ4_XS blocks, [BN, KB, 4, 2]: sub-block g = 2*g2 + gp."""
    d = _f16(p["d"][:, sl, :])[..., None]  # [BN, KB, 1, 1]
    sh = p["scales_h"][:, sl, :][..., None].astype(jnp.uint32)  # [BN, KB, 1, 1]
    sl_bytes = p["scales_l"][:, sl, :][..., None].astype(jnp.uint32)  # [BN, KB, 4, 1]
    g2, gp = _iota((1, 1, 4, 2), 2), _iota((1, 1, 4, 2), 3)
    six_bits = ((sl_bytes >> (4 * gp)) & 0xF) | (((sh >> (4 * g2 + 2 * gp)) & 3) << 4)
    return d * _u2f(six_bits, magic, 32.0)


def iq4_xs_signed_bytes(p, sl, magic) -> list[jax.Array]:
    """IQ4_XS codes of KB blocks looked up as signed bytes (magic.iq4_table must be IQ4_SIGNED_TABLE_WORDS), for
    integer dot products: two [BN, KB, 4, 2, 4] uint32 words per qs word (g2, gp, w) of a block, half h holding the
    values 4w + 2h, 16 + 4w + 2h, 4w + 2h + 1, 16 + 4w + 2h + 1 of sub-block 2*g2 + gp, low byte first."""
    return iq4_codes_by_byte_perm(p["qs"][:, sl].astype(jnp.uint32), magic)


def _iq4_xs(p, sl, magic):
    """Sub-block g = 2*g2 + gp covers qs words (g2, gp, :) of a block: word w holds the sub-block's values 4w + j
    (low nibble of byte j) and 16 + 4w + j (high nibble), term (h, j) for value 16h + 4w + j."""
    scale = iq4_xs_scales(p, sl, magic)[..., None]  # [BN, KB, 4, 2, 1]
    words = p["qs"][:, sl].astype(jnp.uint32)  # [BN, KB, 4, 2, 4]
    terms = []
    if magic.use_byte_perm:
        halves = iq4_codes_by_byte_perm(words, magic)
        for h in range(2):
            for j in range(4):  # byte 2 * (j % 2) + h of half j // 2, under the magic exponent
                bits = byte_perm(halves[j // 2], magic.bits, 0x7650 | (2 * (j % 2) + h))
                terms.append((lax.bitcast_convert_type(bits, jnp.float32) - (8388608.0 + IQ4_BIAS), (h, j)))
    else:
        for h in range(2):
            for j in range(4):
                terms.append((_iq4_table((words >> (8 * j + 4 * h)) & 0xF, magic), (h, j)))
    return [Piece(tuple(terms), scale)]


_K_PLANES = {"d": (1,), "dmin": (1,), "scales": (3, 2, 2), "qs": (2, 2, 32)}

KERNEL_FORMATS: dict[T, KernelFormat] = {
    T.Q8_0: KernelFormat(32, {"d": (1,), "qs": (32,)}, (32,), (0,), (32,), _q8_0),
    T.Q4_K: KernelFormat(256, _K_PLANES, (2, 2, 2, 32), (0, 2, 1, 3), (2, 32),
                         lambda p, sl, magic: _k_quant(p, sl, magic, with_qh=False), has_offset=True, reduce_rows=2),
    T.Q5_K: KernelFormat(256, {**_K_PLANES, "qh": (32,)}, (2, 2, 2, 32), (0, 2, 1, 3), (2, 32),
                         lambda p, sl, magic: _k_quant(p, sl, magic, with_qh=True), has_offset=True, reduce_rows=2),
    T.Q6_K: KernelFormat(256, {"ql": (2, 2, 2, 16), "qh": (2, 2, 16), "scales": (2, 2, 2, 2), "d": (1,)},
                         (2, 2, 2, 2, 16), (0, 1, 2, 3, 4), (2, 2, 16), _q6_k),
    T.IQ4_XS: KernelFormat(256, {"d": (1,), "scales_h": (1,), "scales_l": (4,), "qs": (4, 2, 4)},
                           (4, 2, 2, 4, 4), (2, 4, 0, 1, 3), (4, 2, 4), _iq4_xs, reduce_rows=4),
}
