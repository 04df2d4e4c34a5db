"""In-kernel decoders of ggml blocks into int8 words, for the int8 decode GEMV (quant_gemv_int8.py).

Each format decodes a step of its packed planes ([BN, KB, ...] per 256 values) into Groups: uint32 words of four
integer weights each (one signed byte per weight, low byte first), each term paired with the slice of x's int8
words it multiplies, and per sub-block the float scale (and offset) that turns their integer dot product into
weights times x. x's words come in one of two orders, made by quant_gemv_int8's quantization kernels: IQ4_XS's
(the order its codebook's byte permutes emit values) and the natural one (word i holds values 4i .. 4i + 3), which
the K-quants take because their nibbles lie in value order inside a 32-bit word: a mask or a shift gives four
weights at once, without a single shuffle. (Q8_0 is not here: its bytes are already int8, and on an H200 its float
reduce streams at 2.1-2.8 TB/s, which the int8 form matched at best: benchmarks/RESULTS.md, session 22.)

Values stay exact: unsigned codes (Q4_K's and Q5_K's 0..31, Q6_K's 0..63) go into the dot products as they are. A
Q4_K/Q5_K sub-block's minimum becomes an offset times the sub-block's sum of x (computed from x before it was
quantized), as in the float kernels; Q6_K's -32 comes off each integer dot product as 32 times the sum of x's
levels over its 16 values (exact: a float offset there measured 10x the float kernel's logit error on the Q6_K
fixture, from cancelling two sums each ~32 times their difference), so no weight is shifted in the loop. Planes
other than IQ4_XS's codes are stored as bytes (luxjax.checkpoint.quant_formats); `words` builds each uint32 from
four of them in registers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from gguf.constants import GGMLQuantizationType as T

from pallas_kernels.quant_decode import Magic, _f16, _s2f, _u2f, iq4_xs_scales, iq4_xs_signed_bytes

ALL = slice(None)
NIBBLES = 0x0F0F0F0F


class Group(NamedTuple):
    """Sub-block sums of one kind, all [BN, KB, *acc] after their word axis is summed: terms (int32 words [BN, KB,
    *acc, W], index of the matching words in x's [KB, *x_words] view of one row and slot), less code_bias times x's
    level sums at `x_levels` (per slot: the paired 16-bit values' or a further level's, before they are combined);
    scale [BN, KB, *acc] times x's scales at `x_scale`; offset [BN, KB, *acc] (or None) times the sum of x's float
    sums at each `x_sums` index."""

    terms: tuple[tuple[jax.Array, tuple], ...]
    scale: jax.Array
    x_scale: tuple
    offset: jax.Array | None = None
    x_sums: tuple[tuple, ...] = ()
    code_bias: int = 0
    x_levels: tuple = ()


@dataclass(frozen=True)
class Int8Format:
    planes: dict[str, tuple[int, ...]]  # plane name -> trailing view per 256 values (a free reshape)
    x_order: str  # "iq4" or "natural": which quantization kernel makes x's words
    x_words: tuple[int, ...]  # view of one 256-value block's 64 words of x (one row, one level)
    x_scales: tuple[int, ...]  # view of its x scales (iq4: 8 per 32 values; natural: 16, each 32's twice)
    acc: tuple[int, ...]  # sub-block sums per block and weight row (every group's shape after [BN, KB])
    groups: Callable  # (loaded planes {name: [BN, KB, *view]}, Magic) -> [Group]
    x_sums: tuple[int, ...] | None = None  # view of one block's 16 sums (natural order: per 16 values) ...
    sums: str | None = None  # ... of x as floats ("float": offsets) or of each level's integers ("levels": code_bias)
    split_planes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # plane -> view axes loaded an index
    # at a time: {index tuple: load}

    @property
    def small_planes(self) -> tuple[str, ...]:
        """Planes of at most 16 values a block (scales, minima): a K step of them is a few bytes a thread, cheap to
        hold a step ahead in registers (quant_gemv_int8.BlockSizes.prefetch "small")."""
        return tuple(name for name, view in self.planes.items() if math.prod(view) <= 16)

    @property
    def code_planes(self) -> tuple[str, ...]:
        """The planes of the weights' codes (all but the small and the split ones): the bulk of the bytes."""
        return tuple(name for name in self.planes if name not in self.small_planes and name not in self.split_planes)


def words(b: jax.Array) -> jax.Array:
    """Bytes [..., 16] (uint8 or int8) -> uint32 words [..., 4], byte i of a word at bits 8i (memory order,
    little-endian). Planes are loaded 16 bytes to a run (the last axis) so that Triton gives each thread 16
    contiguous bytes, one wide load; split into words in the thread, the sums over a word's bytes and over the 4
    words stay in registers (runs of 4 bytes put the words of a run on different threads: a Q4_K step compiled to
    672 SASS instructions, 102 of them shuffles; in runs of 16, to 328, against 368 for IQ4_XS)."""
    b = b.reshape(*b.shape[:-1], 4, 4)
    shift = 8 * lax.broadcasted_iota(jnp.uint32, b.shape, b.ndim - 1)
    return jnp.sum((b.astype(jnp.uint32) & 0xFF) << shift, axis=-1)


def _iota(shape, dim) -> jax.Array:
    return lax.broadcasted_iota(jnp.uint32, shape, dim)


def _iq4_xs(p, magic: Magic) -> list[Group]:
    """Codes looked up as signed bytes by byte permutes: half h of word (g2, gp, w) multiplies x words (g2, gp, h,
    w) of the IQ4 order; sub-block 2*g2 + gp's scale."""
    halves = iq4_xs_signed_bytes(p, ALL, magic)  # 2 x [BN, KB, 4, 2, 4]
    terms = tuple((half, (ALL, ALL, h)) for h, half in enumerate(halves))
    return [Group(terms, iq4_xs_scales(p, ALL, magic), ())]


def _k_scales_mins(scales: dict, nib: int, magic: Magic) -> tuple[jax.Array, jax.Array]:
    """6-bit scales and minima of sub-blocks 4h + 2g + nib as float32 [BN, KB, 2, 2, 1] (h, g), from the 12 scale
    bytes viewed (3, 2, 2), byte 4r + 2g + nib loaded as scales[r, nib] [BN, KB, 2] (gguf's get_scale_min_k4)."""
    r0, r1, r2 = (scales[r, nib][:, :, None].astype(jnp.uint32) for r in range(3))  # [BN, KB, 1, 2]
    low = _iota((1, 1, 2, 1), 2) == 0
    sc = jnp.where(low, r0 & 0x3F, (r2 & 0xF) | ((r0 >> 6) << 4))
    mn = jnp.where(low, r1 & 0x3F, (r2 >> 4) | ((r1 >> 6) << 4))
    return _u2f(sc, magic)[..., None], _u2f(mn, magic)[..., None]


def _k_quant(p, magic: Magic, with_qh: bool) -> list[Group]:
    """Q4_K / Q5_K: qs word (h, g, w) holds sub-block 4h + 2g's values 4w .. 4w + 3 in its low nibbles and
    sub-block 4h + 2g + 1's in its high nibbles (x words (h, g, nib, w)); Q5_K's fifth bit of sub-block i is bit i
    of each qh byte. w = d * scale * q - dmin * min. A group per nibble; each sums a sub-block's 16-value halves
    apart (w // 4), so that the sum over words stays in a thread."""
    d, dmin = (_f16(p[name])[..., None, None] for name in ("d", "dmin"))  # [BN, KB, 1, 1, 1]
    qs = words(p["qs"])  # [BN, KB, 2, 2, 2, 4] (h, g, w // 4, w % 4)
    qh = words(p["qh"])[:, :, None, None] if with_qh else None  # [BN, KB, 1, 1, 2, 4]
    groups = []
    for nib in range(2):
        sc, mn = _k_scales_mins(p["scales"], nib, magic)
        q = (qs >> (4 * nib)) & NIBBLES
        if with_qh:
            sub = 4 * _iota((1, 1, 2, 2, 1, 1), 2) + 2 * _iota((1, 1, 2, 2, 1, 1), 3) + nib
            q = q | (((qh >> sub) & 0x01010101) << 4)
        index = (ALL, ALL, nib)  # x's words (h, g, nib, w // 4, w % 4); its per-16 scales and sums (h, g, nib, w // 4)
        groups.append(Group(((q, index),), d * sc, index, -(dmin * mn), (index,)))
    return groups


def _q6_k(p, magic: Magic) -> list[Group]:
    """Q6_K: in half n of a block, ql word (n, a, w) and qh word (n, w) make quarter k = 2s + a (s: ql's nibble,
    qh's bits 2k, 2k + 1), values 128n + 32k + 4w .. + 3 (x words (n, s, a, w)); sub-block of 16 values 8n + 2k +
    w // 4. w = d * scale * (q - 32), q in 0..63."""
    ql = words(p["ql"])  # [BN, KB, 2, 2, 2, 4] (n, a, w // 4, w % 4)
    qh = words(p["qh"])[:, :, :, None]  # [BN, KB, 2, 1, 2, 4]
    d = _f16(p["d"])[..., None, None]  # [BN, KB, 1, 1, 1]
    a = _iota((1, 1, 1, 2, 1, 1), 3)
    groups = []
    for s in range(2):
        q = ((ql >> (4 * s)) & NIBBLES) | (((qh >> (4 * s + 2 * a)) & 0x03030303) << 4)
        scale = d * _s2f(p["scales"][(s,)])  # [BN, KB, 2, 2, 2] (n, a, w // 4)
        index = (ALL, s)
        groups.append(Group(((q, index),), scale, index, code_bias=32, x_levels=index))
    return groups


_K_PLANES = {"d": (1,), "dmin": (1,), "scales": (3, 2, 2), "qs": (2, 2, 2, 16)}
_K_VIEW = dict(x_order="natural", x_words=(2, 2, 2, 2, 4), x_scales=(2, 2, 2, 2), acc=(2, 2, 2), x_sums=(2, 2, 2, 2),
               sums="float", split_planes={"scales": (0, 2)})

INT8_FORMATS: dict[T, Int8Format] = {
    T.IQ4_XS: Int8Format({"d": (1,), "scales_h": (1,), "scales_l": (4,), "qs": (4, 2, 4)}, "iq4", (4, 2, 2, 4),
                         (4, 2), (4, 2), _iq4_xs),
    T.Q4_K: Int8Format(_K_PLANES, groups=lambda p, magic: _k_quant(p, magic, with_qh=False), **_K_VIEW),
    T.Q5_K: Int8Format({**_K_PLANES, "qh": (2, 16)}, groups=lambda p, magic: _k_quant(p, magic, with_qh=True),
                       **_K_VIEW),
    T.Q6_K: Int8Format({"ql": (2, 2, 2, 16), "qh": (2, 2, 16), "scales": (2, 2, 2, 2), "d": (1,)}, "natural",
                       (2, 2, 2, 2, 4), (2, 2, 2, 2), (2, 2, 2), _q6_k, x_sums=(2, 2, 2, 2), sums="levels",
                       split_planes={"scales": (1,)}),
}
