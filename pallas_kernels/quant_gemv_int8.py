"""Packed decode GEMV on int8 dot products: y = x @ W.T for 1..4 rows of x and IQ4_XS W, Pallas on Triton.

Why: quant_matmul's GEMV reduce is bound by instruction issue (an H200 profile: 81% of issue slots busy, 28% of
memory throughput), at one float multiply-add per weight and row besides the decoding. Here the decoder's output
stays integer: the IQ4 codebook is looked up by byte permutes straight into signed bytes, and one dot4 (DP4A)
multiplies four of them by four int8 values of x and adds them to an int32. Measured on an H200 (17408 x 5120, one
row of bf16 x; benchmarks/RESULTS.md, 2026-12-02): 3.7 instructions per weight instead of 6.5, 25.6 instead of 33.4
us; the kernel is then bound by latency, not issue (4 warps: 80 registers, 29% of warps resident, 40% of DRAM
throughput, the x and scale tiles reaching the weights' register layout through shared memory and barriers).

x is quantized per 32 values (an IQ4_XS sub-block) in `levels` int8 levels: d = max|x| / 127 over the 32, level 0 the
rounding of x / d, each further level the rounding of what is left at 128 times finer steps. So x = d * (q0 + q1 /
128 + q2 / 128^2 ...) + e with |e| <= d / (2 * 128^(levels - 1)): two levels for 16-bit x (|e| <= max / 32,512 of
the 32: below bf16's own rounding of every value larger than max / 64), three for float32 x (max / 4,161,536:
what ops.linear.split_linear sends for the DeltaNet, whose inputs are kept in float32 for accuracy). The integer
sums are exact; each sub-block's level sums become floats (the 2^23 magic number), are combined and scaled once.

The kernel reads W's packed planes in place (stacked over layers, one layer at a time, as the decoder does), each
program owning BN output rows and streaming their blocks along K; x is quantized once per call by a small kernel
(quantized_words) into the order the byte permutes emit values, four values of a level to an int32 word.
int8_quant_matmul_many runs the projections of one input (gate and up; q, k and v; the DeltaNet's four) as one
launch with x quantized once: in a 27B decode step on an H200 that took batch-1 decode from 86 to 102 tokens/s
(benchmarks/RESULTS.md, session 18). Programs with long K
loops load the next step's words before decoding the current one's (BlockSizes.prefetch). Used where dot4 and
byte_perm are single instructions (CUDA); elsewhere quant_matmul's float reduce stays (see uses_int8).
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from gguf.constants import GGMLQuantizationType as T

from luxjax.checkpoint.quants import QuantizedTensor
from luxjax.ops import backend
from pallas_kernels import dot4
from pallas_kernels.dense_gemv import (
    per_weight_tile, split_count, split_out_shape, sum_splits, weight_outputs)
from pallas_kernels.fma import fma
from pallas_kernels.quant_decode import (
    IQ4_SIGNED_TABLE_WORDS, KERNEL_FORMATS, MAGIC, SIGNED_MAGIC, _s2f, iq4_xs_scales, iq4_xs_signed_bytes,
    kernel_magic)
from pallas_kernels.quant_matmul import WHOLE, RowView, _pad_to, blocks_per_step, uses_byte_perm

MAX_ROWS = 4  # rows of x per program (each weight decoded once for all of them)
GROUP = 32  # values of x per int8 scale: one IQ4_XS sub-block
LEVEL_STEP = 128.0  # each level of x is this much finer than the last
TINY = 2.0**-100
PREFETCH_MIN_STEPS = 8  # K steps per row tile from which BlockSizes.prefetch's default loads ahead
FORMATS = (T.IQ4_XS,)
PLANES = ("d", "scales_h", "scales_l", "qs")  # IQ4_XS's, in the kernel's argument order
_CONSTANTS = (MAGIC, SIGNED_MAGIC, *IQ4_SIGNED_TABLE_WORDS)  # laid out as quant_decode.KERNEL_CONSTANTS


@dataclass(frozen=True)
class BlockSizes:
    block_n: int  # output rows (W rows) per row tile
    blocks_k: int  # ggml blocks per K step (lowered to a power of two dividing the blocks per row)
    num_warps: int
    num_stages: int = 3
    splits: int | None = None  # programs sharing one row tile, each over 1/splits of K (None: enough for the GPU)
    prefetch: bool | None = None  # load the next K step's words before decoding this one's (None: for long loops)
    tiles: int = 1  # row tiles per program, streamed one after another in one loop

    @classmethod
    def get_default(cls, rows: int, n: int) -> BlockSizes:
        """Fastest of a sweep on an H200 (bench_decode_gemv.py --int8-sweep): 16 rows, 4 blocks per K step and 8
        warps; one block per step where the rows give fewer tiles than multiprocessors, so that K splits fill it.
        Several row tiles per program measured slower (--stream-sweep: 1,022-1,537 against 2,186 GB/s)."""
        return cls(16, 4 if n // 16 >= 132 else 1, 8)

    def prefetches(self, steps: int) -> bool:
        """Whether a program of `steps` K steps per row tile loads ahead: by default where the loop is long enough
        to hide loads behind (an H200, --stream-sweep: 5120 x 17408 with 17 steps 1,889 against 1,757 GB/s, 1024 x
        5120 with 10 steps 537 against 473; at 5 or 6 steps equal or up to 9% slower)."""
        return steps >= PREFETCH_MIN_STEPS if self.prefetch is None else self.prefetch


def levels_for(dtype) -> int:
    """int8 levels of x: two for 16-bit x, three for float32 (see the module doc)."""
    return 3 if jnp.dtype(dtype) == jnp.float32 else 2


def quantize_x(x: jax.Array, levels: int) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (int8 levels [M, levels, K], scales d [M, K / GROUP] float32): x ~ d * sum_l q_l / 128^l per
    group of 32 values (error bound in the module doc)."""
    m, k = x.shape
    groups = x.astype(jnp.float32).reshape(m, k // GROUP, GROUP)
    # groups below 2^-100 quantize to zeros (their steps would be subnormal, which GPUs flush)
    d = jnp.maximum(jnp.max(jnp.abs(groups), axis=-1, keepdims=True), TINY) / 127.0
    rest, qs = groups, []
    for level in range(levels):
        step = d / LEVEL_STEP**level  # exact: a power-of-two division
        q = jnp.clip(jnp.round(rest / step), -127, 127)
        qs.append(q.astype(jnp.int8))
        rest = rest - q * step
    return jnp.stack(qs, axis=1).reshape(m, levels, k), d[..., 0]


def iq4_words(q: jax.Array) -> jax.Array:
    """int8 levels [M, L, K] -> int32 words [M, L, K / 256, 4, 2, 2, 4] in iq4_xs_signed_bytes' order: word
    (g2, gp, h, w) holds values 4w + 2h, 16 + 4w + 2h, 4w + 2h + 1, 16 + 4w + 2h + 1 of sub-block 2*g2 + gp."""
    m, levels, k = q.shape
    # a block's value 64*g2 + 32*gp + 16*hi + 4*w + 2*h + b goes to byte 2*b + hi of word (g2, gp, h, w)
    v = q.reshape(m, levels, k // 256, 4, 2, 2, 4, 2, 2)  # (g2, gp, hi, w, h, b)
    v = v.transpose(0, 1, 2, 3, 4, 7, 6, 8, 5)  # (g2, gp, h, w, b, hi)
    return lax.bitcast_convert_type(v.reshape(*v.shape[:7], 4), jnp.int32)


def _quantize_kernel(const_ref, x_ref, q_ref, d_ref, *, levels, interpret):
    """One 256-value block of one row of x: quantize_x and iq4_words in one pass. x_ref [4, 2, 2, 4, 2, 2] is the
    block as (g2, gp, hi, w, h, b) (value 64*g2 + 32*gp + 16*hi + 4*w + 2*h + b); q_ref [levels, 4, 2, 2, 4] its
    words (g2, gp, h, w), byte 2*b + hi; d_ref [4, 2] the scales of its sub-blocks (g2, gp). Rounds by adding and
    subtracting 1.5 * 2^23 (to nearest, ties to even: jnp.round's rule) with the constant loaded at run time."""
    rounding = kernel_magic(const_ref, use_byte_perm=True, interpret=interpret).round
    bytes_at = list(itertools.product(range(2), range(2), range(2)))  # (hi, h, b)
    rest = [x_ref[:, :, hi, :, h, b].astype(jnp.float32) for hi, h, b in bytes_at]  # each [4, 2, 4]: (g2, gp, w)
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(v), axis=-1) for v in rest])
    d = jnp.maximum(amax, TINY) / 127.0  # [4, 2]: groups below 2^-100 quantize to zeros, as in quantize_x
    d_ref[...] = d
    for level in range(levels):
        step = (d / LEVEL_STEP**level)[..., None]
        words = [jnp.zeros((4, 2, 4), jnp.int32) for _ in range(2)]  # per h
        for i, (hi, h, b) in enumerate(bytes_at):
            q = jnp.clip((rest[i] / step + rounding) - rounding, -127.0, 127.0)
            rest[i] = rest[i] - q * step
            words[h] = words[h] | jnp.left_shift(q.astype(jnp.int32) & 0xFF, 8 * (2 * b + hi))
        for h in range(2):
            q_ref[level, :, :, h, :] = words[h]


@functools.partial(jax.jit, static_argnames=("levels", "interpret"))
def quantized_words(x: jax.Array, levels: int, *, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(iq4_words(q), d reshaped [M, K / 256, 4, 2]) for (q, d) = quantize_x(x, levels), as one kernel launch of one
    program per 256 values: in XLA they were three fusions (the groups' maxima, the scales, the levels' words) per
    GEMV launch (H200 profile of an IQ4_XS 27B decode step: 744 launches, 1.0 ms of 10.2; with this kernel 248
    launches, 0.38 ms). Not bit for bit quantize_x where a compiler divides or fuses differently (a level may move
    by one); within the same error bound."""
    m, k = x.shape
    blocks = k // 256
    words, scales = pl.pallas_call(
        functools.partial(_quantize_kernel, levels=levels, interpret=interpret),
        out_shape=(jax.ShapeDtypeStruct((m, levels, blocks, 4, 2, 2, 4), jnp.int32),
                   jax.ShapeDtypeStruct((m, blocks, 4, 2), jnp.float32)),
        grid=(m, blocks),
        in_specs=[WHOLE, pl.BlockSpec((None, None, 4, 2, 2, 4, 2, 2), lambda r, j: (r, j, 0, 0, 0, 0, 0, 0))],
        out_specs=(pl.BlockSpec((None, levels, None, 4, 2, 2, 4), lambda r, j: (r, 0, j, 0, 0, 0, 0)),
                   pl.BlockSpec((None, None, 4, 2), lambda r, j: (r, j, 0, 0))),
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="quantize_x",
    )(jnp.asarray(_CONSTANTS, jnp.uint32), x.reshape(m, blocks, 4, 2, 2, 4, 2, 2))
    return words, scales


def _load_step(planes, sl) -> dict:
    """The packed planes of this program's rows over the K step `sl`, loaded: {name: [BN, KB, ...]}."""
    return {name: planes[name][:, sl] for name in PLANES}


def _kernel(*refs, tile_counts, stacked, block_n, tiles, kb, steps, levels, prefetch, interpret):
    """Program (0, j, split): row block j of the weights' outputs side by side (weight i owns tile_counts[i] blocks
    of tiles * BN rows), K steps split * steps ... of it; o [1, BM, tiles * BN] is that block's output."""
    # [layer], constants, per weight its planes (d, scales_h, scales_l, qs) whole, x words [BM, L, blocks, 4, 2, 2,
    # 4], x scales [BM, blocks, 4, 2], o [1, BM, tiles * BN]
    refs = list(refs)
    layer = refs.pop(0)[0] if stacked else None
    const_ref, *plane_refs, xq_ref, xd_ref, o_ref = refs
    magic = kernel_magic(const_ref, use_byte_perm=True, interpret=interpret)
    block, split = pl.program_id(1), pl.program_id(2)
    stream = functools.partial(_stream_rows, xq_ref=xq_ref, xd_ref=xd_ref, o_ref=o_ref, magic=magic, layer=layer,
                               split=split, block_n=block_n, tiles=tiles, kb=kb, steps=steps, levels=levels,
                               prefetch=prefetch)
    per_weight_tile(block, tile_counts, lambda i, local: stream(
        plane_refs[len(PLANES) * i: len(PLANES) * (i + 1)], local * tiles * block_n))


def _stream_rows(plane_refs, first_row, *, xq_ref, xd_ref, o_ref, magic, layer, split, block_n, tiles, kb, steps,
                 levels, prefetch):
    """o = x @ W[first_row : first_row + tiles * BN].T over this split's K steps, one weight's planes: the row
    tiles one after another, their K steps in one loop (flat step i: tile i // steps, K step i % steps)."""
    rows = o_ref.shape[1]

    def tile_planes(t):
        out_rows = pl.ds(pl.multiple_of(first_row + t * block_n, block_n), block_n)
        prefix = (out_rows,) if layer is None else (layer, out_rows)
        return {name: RowView(ref, prefix) for name, ref in zip(PLANES, plane_refs)}

    def k_slice(s):
        return pl.ds(pl.multiple_of((split * steps + s) * kb, kb), kb)

    def load(i):  # lax.div / lax.rem: jnp's floor forms do not lower to Triton here
        return _load_step(tile_planes(lax.div(i, steps)), k_slice(lax.rem(i, steps)))

    def accumulate(loaded, s, accs):
        sl, whole = k_slice(s), slice(None)
        scale = iq4_xs_scales(loaded, whole, magic)  # [BN, KB, 4, 2]
        halves = iq4_xs_signed_bytes(loaded, whole, magic)  # 2 x [BN, KB, 4, 2, 4]
        new = []
        for r, acc in enumerate(accs):
            total = None
            for level in range(levels):
                isum = jnp.zeros(halves[0].shape, jnp.int32)
                for h, half in enumerate(halves):
                    isum = dot4.dot4(half, xq_ref[r, level, sl, :, :, h, :][None], isum)
                part = _s2f(jnp.sum(isum, axis=-1))  # [BN, KB, 4, 2], exact
                total = part if total is None else fma(part, LEVEL_STEP**-level, total)
            new.append(fma(total, scale * xd_ref[r, sl][None], acc))
        return tuple(new)

    def store(t, accs):
        for r, acc in enumerate(accs):
            o_ref[0, pl.ds(r, 1), pl.ds(t * block_n, block_n)] = acc.sum(axis=(1, 2, 3))[None, :].astype(o_ref.dtype)

    zeros = (jnp.zeros((block_n, kb, 4, 2), jnp.float32),) * rows
    total = tiles * steps

    def step(i, carry):
        if prefetch:  # the next step's words are in flight while this one's are decoded
            loaded, accs = carry
            upcoming = load(jnp.minimum(i + 1, total - 1))
        else:
            loaded, accs = load(i), carry
        accs = accumulate(loaded, lax.rem(i, steps), accs)
        if tiles > 1:
            last = lax.rem(i, steps) == steps - 1

            @pl.when(last)
            def _():
                store(lax.div(i, steps), accs)

            accs = tuple(jnp.where(last, 0.0, a) for a in accs)
        return (upcoming, accs) if prefetch else accs

    carry = lax.fori_loop(0, total, step, (load(0), zeros) if prefetch else zeros)
    if tiles == 1:
        store(0, carry[1] if prefetch else carry)


def _program_rows(bs: BlockSizes) -> int:
    return bs.block_n * bs.tiles


def uses_int8(interpret: bool) -> bool:
    """Whether decode GEMVs take this kernel: where dot4 and byte_perm (quant_matmul.uses_byte_perm) are single
    instructions (CUDA), and interpreted (their XLA forms, so the tests check it); never with int8 activations off."""
    if not (backend.int8_activations() and dot4.REGISTERED and uses_byte_perm(interpret)):
        return False
    return interpret or backend.gpu_platform() in dot4.NATIVE_PLATFORMS


def supported(x_shape, w: QuantizedTensor, stacked: bool) -> bool:
    """Whether int8_quant_matmul takes x [..., in] @ W.T (W[layer].T when stacked)."""
    return supported_many(x_shape, (w,), stacked)


def supported_many(x_shape, ws, stacked: bool) -> bool:
    """Whether int8_quant_matmul_many takes x [..., in] and the packed weights ws (stacked: each [L, out_i, in],
    one L): one format it has, every in equal to x's, rows that whole row blocks cover when stacked."""
    m, ns = math.prod(x_shape[:-1]), [w.shape[0] for w in ws]
    if not (ws and 0 < m <= MAX_ROWS and all(w.ggml_type in FORMATS and w.ndim == 2 for w in ws)):
        return False
    if len({w.ggml_type for w in ws}) != 1 or any(w.shape[1] != x_shape[-1] for w in ws):
        return False
    if stacked and len({w.planes["d"].shape[0] for w in ws}) != 1:
        return False
    return not stacked or all(n % _program_rows(BlockSizes.get_default(m, sum(ns))) == 0 for n in ns)


@functools.partial(jax.jit, static_argnames=("block_sizes", "levels", "out_dtype", "interpret", "debug"))
def int8_quant_matmul(x: jax.Array, w: QuantizedTensor, layer: jax.Array | None = None, *,
                      block_sizes: BlockSizes | None = None, levels: int | None = None, out_dtype=None,
                      interpret: bool = False, debug: bool = False) -> jax.Array:
    """x [M, in] @ W.T (W[layer].T for W stacked over layers, every plane [L, rows, ...], read in place) -> [M, out]
    in out_dtype (default x's), M <= MAX_ROWS, x quantized to `levels` int8 levels (default levels_for(x.dtype))."""
    return int8_quant_matmul_many(x, (w,), layer, block_sizes=block_sizes, levels=levels, out_dtype=out_dtype,
                                  interpret=interpret, debug=debug)[0]


@functools.partial(jax.jit, static_argnames=("block_sizes", "levels", "out_dtype", "interpret", "debug"))
def int8_quant_matmul_many(x: jax.Array, ws: tuple[QuantizedTensor, ...], layer: jax.Array | None = None, *,
                           block_sizes: BlockSizes | None = None, levels: int | None = None, out_dtype=None,
                           interpret: bool = False, debug: bool = False) -> tuple[jax.Array, ...]:
    """(int8_quant_matmul(x, w, layer) for w in ws) in one launch: the projections of one input (gate and up; q, k
    and v; the DeltaNet's four), x quantized once, one grid over all their row blocks. A decode step's products are
    short (a 17408 x 5120 IQ4_XS weight streams in ~25 us on an H200): each launch costs its start, its last wave's
    idle multiprocessors and x's quantization, and a small weight alone (48 or 1,024 rows) cannot fill the GPU."""
    ws = tuple(ws)
    (m, k) = x.shape
    for w in ws:
        if w.ggml_type not in FORMATS:
            raise NotImplementedError(f"no int8 GEMV for {w.ggml_type.name} (have {[t.name for t in FORMATS]})")
        if w.ndim != 2 or w.shape[1] != k:
            raise ValueError(f"x {x.shape} @ W.T needs every W [out, {k}]; got {[w.shape for w in ws]}")
    if not 0 < m <= MAX_ROWS:
        raise ValueError(f"x {x.shape} needs 1..{MAX_ROWS} rows")
    if len({w.ggml_type for w in ws}) != 1:
        raise NotImplementedError(f"one format per launch, got {[w.ggml_type.name for w in ws]}")
    fmt = KERNEL_FORMATS[ws[0].ggml_type]
    ns = tuple(w.shape[0] for w in ws)
    bs = block_sizes or BlockSizes.get_default(m, sum(ns))
    blocks = k // fmt.block
    kb = blocks_per_step(blocks, bs.blocks_k)
    program_rows = _program_rows(bs)
    if layer is None:  # rows padded to whole tiles (a stacked weight cannot be: it would be copied)
        planes = [[_pad_to(w.planes[name].reshape(n, blocks, *fmt.planes[name]), 0, program_rows) for name in PLANES]
                  for w, n in zip(ws, ns)]
    elif any(n % program_rows for n in ns) or len({w.planes["d"].shape[0] for w in ws}) != 1:
        raise ValueError(f"stacked weights of one depth with rows a multiple of block_n * tiles = {program_rows}; "
                         f"got {[(w.planes['d'].shape[0], n) for w, n in zip(ws, ns)]}")
    else:
        planes = [[w.planes[name].reshape(-1, n, blocks, *fmt.planes[name]) for name in PLANES]
                  for w, n in zip(ws, ns)]
    padded = tuple(p[0].shape[-3] for p in planes)  # d: [(L,) rows, blocks, 1]
    tile_counts = tuple(n // program_rows for n in padded)
    levels = levels or levels_for(x.dtype)
    xq, xd = quantized_words(x, levels, interpret=interpret)
    splits = bs.splits or split_count(sum(tile_counts), blocks // kb)
    if blocks % (kb * splits):
        raise ValueError(f"{splits} K splits of {kb}-block steps do not divide {blocks} blocks")
    out_dtype = out_dtype or x.dtype
    steps = blocks // (kb * splits)
    kernel = functools.partial(_kernel, tile_counts=tile_counts, stacked=layer is not None,
                               block_n=bs.block_n, tiles=bs.tiles, kb=kb, steps=steps, levels=levels,
                               prefetch=bs.prefetches(steps), interpret=interpret)
    x_specs = [pl.BlockSpec(a.shape, lambda i, j, s, nd=a.ndim: (0,) * nd) for a in (xq, xd)]
    flat_planes = [p for weight_planes in planes for p in weight_planes]
    y = pl.pallas_call(
        kernel,
        out_shape=split_out_shape(splits, m, sum(padded), out_dtype),
        grid=(1, sum(tile_counts), splits),
        in_specs=[*(WHOLE for _ in range(len(flat_planes) + 1 + (layer is not None))), *x_specs],
        out_specs=pl.BlockSpec((1, m, program_rows), lambda i, j, s: (s, 0, j)),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret, debug=debug, name=f"int8_gemv_{ws[0].ggml_type.name.lower()}",
    )(*([] if layer is None else [jnp.reshape(layer, (1,)).astype(jnp.int32)]),
      jnp.asarray(_CONSTANTS, jnp.uint32), *flat_planes, xq, xd)
    return weight_outputs(sum_splits(y, out_dtype), padded, ns)
