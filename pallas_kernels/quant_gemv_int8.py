"""Packed decode GEMV on int8 dot products: y = x @ W.T for 1..4 rows of x and IQ4_XS, Q4_K, Q5_K or Q6_K W,
Pallas on Triton.

Why: quant_matmul's GEMV reduce is bound by instruction issue (an H200 profile: 81% of issue slots busy, 28% of
memory throughput), at one float multiply-add per weight and row besides the decoding. Here the decoder's output
stays integer: the IQ4 codebook is looked up by byte permutes straight into signed bytes, and one dot4 (DP4A)
multiplies four of them by four int8 values of x and adds them to an int32. Measured on an H200 (17408 x 5120, one
row of bf16 x; benchmarks/RESULTS.md, 2026-12-02): 3.7 instructions per weight instead of 6.5, 25.6 instead of 33.4
us; the kernel is then bound by latency, not issue (4 warps: 80 registers, 29% of warps resident, 40% of DRAM
throughput, the x and scale tiles reaching the weights' register layout through shared memory and barriers).

x is quantized per 32 values (an IQ4_XS sub-block) in `levels` int8 levels: d = max|x| / 127 over the 32, level 0 the
rounding of x / d, each further level the rounding of what is left at 128 times finer steps. So x = d * (q0 + q1 / 128
+ q2 / 128^2 ...) + e with |e| <= d / (2 * 128^(levels - 1)): two levels for 16-bit x (|e| <= max / 32,512 of the 32:
below bf16's own rounding of every value larger than max / 64), three for float32 x (max / 4,161,536: what
ops.linear.split_linear sends for the DeltaNet, whose inputs are kept in float32 for accuracy). At one row of x
(PAIRED_ROWS) the first two levels reach the kernel as one 16-bit value, v = round(x / (d / 128)) (128 q0 + q1 in one
rounding, |v| <= 16,256, within the same bound), with the scale d / 128, and a weight word's four bytes meet them in
two dot2 (DP2A: two 16-bit values times two bytes) where two levels took two dot4: the same dot-product instructions,
but one sum a sub-block to reduce, convert and combine instead of two (27B gate + up at one bf16 row, read without a
GPU: 213 -> 203 instructions a K step, 64 -> 52 registers; 27B batch-1 decode +1.4%: PAIRED_ROWS). Further levels stay
int8 words for dot4. The integer sums are exact; each sub-block's sums become floats (the 16-bit pairs' by a
conversion, exact below 2^24 and rounded by at most 2^-24 of the sum above it; the int8 levels' by the 2^23 magic
number), are combined and scaled once.

The kernel reads W's packed planes in place (stacked over layers, one layer at a time, as the decoder does), each
program owning BN output rows and streaming their blocks along K; x is quantized once per call by a small kernel
into the order the format's decoder emits values, four values of a level to an int32 word: IQ4_XS's byte-permute
order (quantized_words) or value order for the K-quants (natural_words, with the sums their offsets need). The
formats' decoders are in int8_decode.py; one kernel body sums every format's groups. The K-quants took the 27B
Q4_K_M model's batch-1 decode from 79.8 to 89.2 tokens/s and batch 4 from 131.6 to 165.6 (H200, session 22).
int8_quant_matmul_many runs the projections of one input (gate and up; q, k and v; the DeltaNet's four) as one
launch with x quantized once: in a 27B decode step on an H200 that took batch-1 decode from 86 to 102 tokens/s
(benchmarks/RESULTS.md, session 18). Programs with long K loops load the next step's words before decoding the
current one's, and some products only its small planes, the scales (BlockSizes.prefetch; SMALL_AHEAD). Triton's
own software pipelining of the loop (cp.async copies of the next steps into shared memory, asked for by the
`tt.num_stages` attribute on the loop, which Pallas does not set: tried through a lowering rule) measured 1.05-1.9x
slower on every 27B decode product (session 26). A row tile may load in parts (BlockSizes.parts), so that a thread
multiplies words of several rows by one load of x's words: fewer registers where x has three levels (TWO_PARTS).
Two more ways to load a step: the codes as one run a row (BlockSizes.flat) and the small planes in pieces that Triton
loads straight into the words' layout (BlockSizes.split_small); IQ4_XS takes them at 3-4 rows of x (LOADS_AT_ROWS).
Used where dot4 and byte_perm are single instructions (CUDA); elsewhere quant_matmul's float reduce stays (see
uses_int8).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from gguf.constants import GGMLQuantizationType as T
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from luxjax.checkpoint.quants import QuantizedTensor
from luxjax.ops import backend
from luxjax.ops.deferred import Deferred, GatedInput, GatedNormedInput, NormedInput
from pallas_kernels import dot4
from pallas_kernels.dense_gemv import (
    per_weight_tile, split_count, split_out_shape, sum_splits, weight_out_specs)
from pallas_kernels.fma import fma
from pallas_kernels.int8_decode import INT8_FORMATS, Int8Format
from pallas_kernels.quant_decode import IQ4_SIGNED_TABLE_WORDS, MAGIC, SIGNED_MAGIC, _s2f, kernel_magic
from pallas_kernels.quant_matmul import WHOLE, RowView, _pad_to, blocks_per_step, uses_byte_perm

# Rows of x per program (each weight decoded once for all of them), and the most for which ops.linear takes this
# kernel: every format here measured faster than the float reduce at 1..4 rows on the 27B's decode shapes on an H200
# (session 22 had Q5_K and Q6_K behind it at 4 rows on the MLP's down projection, 0.80x and 0.59x, loading the next
# K step ahead; without that and at FEW_TILES' tiles, session 23's --split-sweep: 78.9 and 95.2 us a layer against
# the float reduce's 119.8 and 110.0).
MAX_ROWS = 4
GROUP = 32  # values of x per int8 scale: one IQ4_XS sub-block
LEVEL_STEP = 128.0  # each level of x is this much finer than the last
PAIRED = 2  # x's first two levels go to the kernel as one 16-bit value, round(x / (d / 128)) (module doc) ...
# ... at up to this many rows of x: 27B IQ4_XS decode on an H100, runs alternated (benchmarks/RESULTS.md, session
# 43), batch 1 119.31 / 119.43 / 119.31 -> 121.16 / 120.95 / 120.98 tokens/s, but batch 4 (paired at 4 rows then)
# 264.66 / 264.93 / 264.78 -> 263.70 / 263.92 / 263.34; 2 and 3 rows not measured, so they stay as they were
PAIRED_ROWS = 1


def pairs_levels(rows: int, levels: int) -> bool:
    """Whether x of `rows` rows in `levels` levels reaches the GEMV with its first two levels as 16-bit values."""
    return levels >= PAIRED and rows <= PAIRED_ROWS


TINY = 2.0**-100
PREFETCH_MIN_STEPS = 8  # K steps per row tile from which BlockSizes.prefetch's default loads ahead
BLOCK = 256  # values per K block of every format here
FORMATS = tuple(INT8_FORMATS)
_CONSTANTS = (MAGIC, SIGNED_MAGIC, *IQ4_SIGNED_TABLE_WORDS)  # laid out as quant_decode.KERNEL_CONSTANTS
# The weights' bytes are read once a call: loaded as first to leave L2, they leave the step's small operands (x's
# words, the DeltaNet state, caches, the next launch's inputs) in place. Batch-1 IQ4_XS decode of the 27B on an H200
# 122.0 / 122.0 -> 123.3 / 123.6 tokens/s, and 122.7 / 122.8 -> 124.0 / 124.4 in another call (runs alternated;
# batch 4 and the products timed alone unchanged within 1%: benchmarks/RESULTS.md, session 31).
WEIGHT_EVICTION = "evict_first"


@dataclass(frozen=True)
class BlockSizes:
    block_n: int  # output rows (W rows) per row tile
    blocks_k: int  # ggml blocks per K step (lowered to a power of two dividing the blocks per row)
    num_warps: int
    num_stages: int = 3
    splits: int | None = None  # programs sharing one row tile, each over 1/splits of K (None: enough for the GPU)
    # load the next K step's planes before decoding this one's (None: for long loops; "small": only the planes of a
    # few bytes a block, Int8Format.small_planes)
    prefetch: bool | str | None = None
    tiles: int = 1  # row tiles per program, streamed one after another in one loop
    # a row tile's planes loaded as this many tensors of block_n / parts rows each, decoded alike, every one
    # multiplied by one load of x: Triton lays each out alike, so a thread holds words of `parts` rows at the same
    # K positions and loads their x words once (in one tensor of block_n rows, a thread's words lie along K, one
    # row, and its x words are as many as its weights / 2 at two levels)
    parts: int = 1
    # the codes (Int8Format.code_planes) of a row's K step loaded as one run of words or bytes ([BN', KB * block
    # bytes], reshaped in the kernel): Triton lays a warp's threads along the run, so that a warp reads 512
    # contiguous bytes of one row, where a [BN', KB, *view] load (contiguous to Triton only along its last axis) puts
    # them along the rows, a warp's wide load touching 32 lines 16 bytes each (where: LOADS_AT_ROWS)
    flat: bool = False
    # the small planes (Int8Format.small_planes that the format does not split) loaded in pieces of fewer values
    # than the program has threads (small_pieces): Triton moves a load into its user's layout only when it has fewer
    # values than threads (its isExpensiveLoadOrStore); a larger one keeps a layout of its own and reaches the words'
    # layout through shared memory, two barriers every K step (IQ4_XS's scales_l at 16 rows, 4 blocks a step and 8
    # warps: 256 bytes; benchmarks/RESULTS.md sessions 39-40; where: LOADS_AT_ROWS)
    split_small: bool = False

    @classmethod
    def get_default(cls, rows: int, n: int, ggml_type: T, blocks: int, levels: int = 2) -> BlockSizes:
        """For x of `rows` rows in `levels` int8 levels times n rows of W (all of a launch's weights) in ggml_type,
        `blocks` blocks per row. Fastest of sweeps on an H200 (bench_decode_gemv.py --int8-sweep): 16 rows, 4 blocks
        per K step and 8 warps; one block per step where the rows give fewer tiles than multiprocessors, so that K
        splits fill it; below one wave of programs, FEW_TILES. Several row tiles per program measured slower
        (--stream-sweep: 1,022-1,537 against 2,186 GB/s). The K-quants do not load whole steps ahead (FEW_TILES'
        sweep: with prefetch 1.1-2x slower); the small planes load ahead where SMALL_AHEAD says, a row tile in
        parts where TWO_PARTS (or, in launches of fewer row tiles, TWO_PARTS_BELOW_MANY_TILES) says, and the small
        planes in pieces (with the codes as one run a row in launches of many row tiles) where LOADS_AT_ROWS says."""
        tiles, prefetch = n // 16, None if ggml_type == T.IQ4_XS else False
        if tiles < 132:
            return cls(16, 1, 8, prefetch=prefetch)
        few = FEW_TILES[ggml_type][rows > 2]
        one_wave = not (tiles < ONE_WAVE_TILES and blocks % (few.blocks_k * (few.splits or 1)) == 0)
        chosen = cls(16, 4, 8, prefetch=prefetch) if one_wave else few
        if levels == 2 and (ggml_type, one_wave, rows > 2) in SMALL_AHEAD:
            chosen = dataclasses.replace(chosen, prefetch="small")
        two_parts = (ggml_type, one_wave, rows, levels)
        if two_parts in TWO_PARTS or (two_parts in TWO_PARTS_BELOW_MANY_TILES and tiles < MANY_TILES):
            chosen = dataclasses.replace(chosen, parts=2)
        if (ggml_type, one_wave, rows > 2) in LOADS_AT_ROWS:
            chosen = dataclasses.replace(chosen, split_small=True, flat=tiles >= MANY_TILES)
        return chosen

    def prefetches(self, steps: int) -> bool | str:
        """Whether a program of `steps` K steps per row tile loads ahead: by default where the loop is long enough
        to hide loads behind (an H200, --stream-sweep: 5120 x 17408 with 17 steps 1,889 against 1,757 GB/s, 1024 x
        5120 with 10 steps 537 against 473; at 5 or 6 steps equal or up to 9% slower)."""
        return steps >= PREFETCH_MIN_STEPS if self.prefetch is None else self.prefetch


ONE_WAVE_TILES = 396  # 16-row programs an H200 holds at once (68-80 registers x 256 threads: 3 a multiprocessor)
# Block sizes for products of fewer row tiles than ONE_WAVE_TILES (the 27B's 5,120-output products: MLP down,
# attention and DeltaNet output, 320 tiles of 16 rows: a fifth of the GPU's program slots idle), per format for
# 1-2 and for 3-4 rows of x: the fastest of `bench_decode_gemv.py --split-sweep` on an H200 (session 23), GPU us per
# layer on 5120 x 17408 at 1 / 4 rows of bf16 x against 16, 4, 8 with prefetch (the previous default): IQ4_XS 33.5
# / 64.1 against 36.8 / 71.1 (5120 x 6144: 17.6 float32 x against 18.9, 22.3 at 4 rows against 32.7); Q4_K 37.8 /
# 68.1 against 49.9 / 72.5; Q5_K 42.6 / 78.9 against 64.9 / 147.9; Q6_K 46.1 / 95.2 against 67.4 / 180.7.
FEW_TILES = {
    T.IQ4_XS: (BlockSizes(16, 2, 8, splits=2), BlockSizes(16, 2, 4, splits=2)),
    # Q4_K at 3-4 rows: loading ahead measured 61.2 against 53.3 us without (--ahead-sweep, session 26)
    T.Q4_K: (BlockSizes(16, 2, 8, splits=2, prefetch=False), BlockSizes(16, 2, 4, splits=2, prefetch=False)),
    T.Q5_K: (BlockSizes(16, 4, 8, prefetch=False), BlockSizes(16, 4, 8, prefetch=False)),
    T.Q6_K: (BlockSizes(16, 2, 4, splits=2), BlockSizes(16, 2, 4, splits=2)),
}

# Where the small planes (scales and minima, Int8Format.small_planes) load a K step ahead in registers by default:
# (format, whether the product fills a wave of programs (not FEW_TILES), rows > 2), for 16-bit x's two int8 levels
# (float32 x's three hold more registers: there it measured slower, e.g. IQ4_XS 16384 x 5120 at 4 rows 53.6 -> 60.0
# us, Q4_K at 1 row 23.1 -> 25.3). `bench_decode_gemv.py --ahead-sweep` on an H200 (session 26), GPU us a layer,
# default -> small planes ahead: IQ4_XS 34816 x 5120 (the MLP's gate + up) at 4 rows 92.9 -> 81.7, 14336 x 5120
# (attention q, k, v) at 4 rows 42.4 -> 39.9; Q4_K 34816 x 5120 at 1 row 45.2 -> 42.8, 5120 x 17408 at 1 row 29.0
# -> 27.1; Q6_K 5120 x 17408 at 1 row 37.1 -> 32.4. Elsewhere equal or slower (IQ4_XS at 1 row 38.4 -> 46.8, its
# 5,120-output products at 4 rows 40.6 -> 50.6; Q5_K; Q6_K 34816 x 5120 at 4 rows 142.5 -> 181.2).
SMALL_AHEAD = {(T.IQ4_XS, True, True), (T.Q4_K, True, False), (T.Q4_K, False, False), (T.Q6_K, False, False)}


# Launches of at least this many row tiles (the 27B's gate + up, 2,176, and the DeltaNet's four, 1,030; not q + k + v,
# 896) load differently from smaller ones: their codes as one run a row at 3-4 rows (LOADS_AT_ROWS), in one part at
# one bf16 row (TWO_PARTS_BELOW_MANY_TILES). The threshold lies between measured launches, not at a measured optimum.
MANY_TILES = 1024

# Where a row tile loads in two parts by default (BlockSizes.parts): (format, whether the product fills a wave of
# programs, rows of x, levels of x). `bench_decode_gemv.py --parts-sweep` on an H100 (session 36), GPU us a layer,
# one part -> two: IQ4_XS 16384 x 5120 at one float32 row (the DeltaNet's four projections; three levels of x, so
# a thread's x words 48 -> 24) 23.9 -> 22.1. Not taken where the gain was within a single run's spread (IQ4_XS at
# 4 rows: 34816 x 5120 81.1 -> 78.8, 5120 x 17408 42.1 -> 41.0; Q6_K 5120 x 17408 at one row 34.2 -> 33.0), and
# slower at one bf16 row (IQ4_XS gate + up 40.3 -> 44.7, Q4_K 45.3 -> 52.2, Q4_K 5120 x 17408 26.9 -> 48.7): there a
# thread's words of one row lie side by side along K, which two parts give up. On an H200 (session 37) the DeltaNet
# case 22.4 -> 20.5 us, 27B batch-1 decode 126.7 / 126.9 -> 127.5 / 127.6 tokens/s (runs alternated); two parts at
# 4 rows (34816 x 5120 80.4 -> 78.6 us there) made batch-4 decode slower, 262.5 -> 257.2 / 257.4 tokens/s.
TWO_PARTS = {(T.IQ4_XS, True, 1, 3)}
# ... and, with the same key, in launches of fewer than MANY_TILES row tiles only: at one bf16 row two parts
# measured slower on gate + up (2,176 tiles: 40.3 -> 45.3 us) but faster on q + k + v (896 tiles: 20.5 -> 18.4 us;
# `bench_decode_gemv.py --ahead-parts-sweep` on an H100, session 41, one run), and 27B IQ4_XS batch-1 decode
# 117.5-117.95 -> 117.9-118.1 tokens/s there (five pairs alternated, faster in each and than the base run after it:
# +0.03-0.39%, mean +0.15%, below the ~0.4% that 2 us x 16 layers predicts). Not measured on an H200.
TWO_PARTS_BELOW_MANY_TILES = {(T.IQ4_XS, True, 1, 2)}

# Where the small planes load in pieces (BlockSizes.split_small), and in launches of at least MANY_TILES row
# tiles the codes as one run a row (BlockSizes.flat): (format, whether the product fills a wave of programs, rows >
# 2). `bench_decode_gemv.py --load-sweep` on an H100 (session 40, two runs within 1% of each other), the decoder's
# own launches at 4 rows, GPU us a layer, default -> pieces / one run and pieces: gate + up (2,176 tiles, bf16 x)
# 79.9 -> 88.7 / 76.5; the DeltaNet's four (1,030 tiles, float32 x) 54.2 -> 55.0 / 53.2; q + k + v (896 tiles)
# 40.2 -> 34.1 / 38.5; down (FEW_TILES) 41.7 -> 51.6 / 44.0, so not there. End to end, batch-4 decode 259.6-259.8
# -> 264.0-264.2 tokens/s (27B IQ4_XS, three pairs alternated). At one row pieces measured slower end to end
# (117.8 / 117.9 -> 116.9 / 117.0 tokens/s; gate + up 40.4 -> 41.8 us), so not there. Not measured on an H200.
LOADS_AT_ROWS = {(T.IQ4_XS, True, True)}


def _x_operands(x, m: int, blocks: int, view: tuple[int, ...]) -> tuple[list, list]:
    """(arrays, in specs) a quantization kernel of grid (row, block) reads for x [m, blocks * 256], each block
    [*view]: x's own blocks; a GatedInput's gate and up blocks; a NormedInput's blocks of x, its sum_sq [m] and the
    stacked weight [L, blocks, *view] whole with the layer [1] (the kernel indexes them: _x_values); a
    GatedNormedInput's blocks of x and gate and its stacked weight as [L, pieces, *view[1:]] (pieces: the head's
    entries along the view's first axis; _x_blocks) whole with the layer [1]."""
    block = pl.BlockSpec((None, None, *view), lambda r, j: (r, j) + (0,) * len(view))
    if isinstance(x, GatedInput):
        return [x.gate.reshape(m, blocks, *view), x.up.reshape(m, blocks, *view)], [block, block]
    if isinstance(x, GatedNormedInput):
        weight = x.weight.reshape(x.weight.shape[0], x.head // (BLOCK // view[0]), *view[1:])
        arrays = [x.x.reshape(m, blocks, *view), x.gate.reshape(m, blocks, *view), weight,
                  jnp.reshape(x.layer, (1,)).astype(jnp.int32)]
        return arrays, [block, block, WHOLE, WHOLE]
    if isinstance(x, NormedInput):
        arrays = [x.x.reshape(m, blocks, *view), x.sum_sq.reshape(m),
                  x.weight.reshape(x.weight.shape[0], blocks, *view), jnp.reshape(x.layer, (1,)).astype(jnp.int32)]
        return arrays, [block, WHOLE, WHOLE, WHOLE]
    return [x.reshape(m, blocks, *view)], [block]


def _x_form(x) -> tuple:
    """What a quantization kernel needs to know of x when tracing: its type (array or deferred), dtype, width and a
    norm's eps (NormedInput, GatedNormedInput)."""
    return type(x), jnp.dtype(x.dtype), x.shape[-1], getattr(x, "eps", None)


def _x_values(x_form, x_refs, index) -> jax.Array:
    """A quantization kernel's block of x at `index` (of its [*view] block), float32, formed where x is deferred
    (x_form: _x_form(x); x_refs: its _x_operands)."""
    kind, dtype, width, eps = x_form
    if kind is GatedInput:
        gate_ref, up_ref = x_refs
        return GatedInput.form(gate_ref[index], up_ref[index]).astype(jnp.float32)
    if kind is NormedInput:
        x_ref, sum_sq_ref, w_ref, layer_ref = x_refs
        row, block = pl.program_id(0), pl.program_id(1)
        weight = w_ref[(layer_ref[0], block, *index)]
        inv_rms = NormedInput.inverse_rms(sum_sq_ref[row], width, eps)
        return NormedInput.form(x_ref[index], inv_rms, weight, dtype).astype(jnp.float32)
    return x_refs[0][index].astype(jnp.float32)


def _sum_after_first_axis(v: jax.Array) -> jax.Array:
    """v summed over every axis but its first (one axis at a time: the reductions Triton lowers)."""
    while v.ndim > 1:
        v = jnp.sum(v, axis=-1)
    return v


def _x_blocks(x_form, x_refs, indices) -> list[jax.Array]:
    """A quantization kernel's block of x at each of `indices`, float32, formed where x is deferred: _x_values at
    each, but for a GatedNormedInput, whose norm sums each head's squares over the loads of all of them. The
    indices together cover the block, each taking the view's first axis whole; a head covers `pieces` consecutive
    entries of that axis (the weight's second axis, _x_operands), so every entry's sum of squares is its head's and
    its weight the piece at its position in the head."""
    kind, dtype, _, eps = x_form
    if kind is not GatedNormedInput:
        return [_x_values(x_form, x_refs, index) for index in indices]
    x_ref, gate_ref, w_ref, layer_ref = x_refs
    xs = [x_ref[index].astype(jnp.float32) for index in indices]
    entries, pieces = x_ref.shape[0], w_ref.shape[1]
    sums = functools.reduce(jnp.add, [_sum_after_first_axis(v * v) for v in xs])  # [entries]
    same_head = (lax.broadcasted_iota(jnp.int32, (entries, entries), 0) // pieces
                 == lax.broadcasted_iota(jnp.int32, (entries, entries), 1) // pieces)
    head_sums = jnp.sum(jnp.where(same_head, sums[None, :], 0.0), axis=1)
    inv_rms = NormedInput.inverse_rms(head_sums, pieces * BLOCK // entries, eps)
    shape = xs[0].shape  # every load's: the view's first axis, then the rest it takes whole
    piece = lax.broadcasted_iota(jnp.int32, shape, 0) % pieces
    inv_rms = inv_rms.reshape(entries, *(1,) * (len(shape) - 1))
    formed = []
    for index, v in zip(indices, xs):
        weight = jnp.broadcast_to(w_ref[(layer_ref[0], 0, *index[1:])][None], shape)
        for p in range(1, pieces):
            weight = jnp.where(piece == p, w_ref[(layer_ref[0], p, *index[1:])][None], weight)
        formed.append(GatedNormedInput.form(v, gate_ref[index], weight, inv_rms, dtype).astype(jnp.float32))
    return formed


def _in_blocks(x, view: tuple[int, ...]):
    """x as a quantization kernel of blocks [*view] takes it: a GatedNormedInput formed first (by XLA) unless each
    of its heads lies within one block and covers whole entries of the view's first axis (_x_blocks)."""
    if isinstance(x, GatedNormedInput) and (x.head % (BLOCK // view[0]) or BLOCK % x.head):
        return x.value()
    return x


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


def _levels(rest: list[jax.Array], d: jax.Array, levels: int, rounding, paired: bool) -> list[list[jax.Array]]:
    """The integers x's words hold for each of a block's loads (float32, d broadcast to each), [load][value], exact
    integers as floats: where paired (pairs_levels) first the 16-bit value v = round(x / (d / 128)) (|v| <= 16,256:
    the first two levels' 128 q0 + q1, by one rounding instead of two, within their bound d / 256), then each
    further level's rounding of what is left; else each level's (level 0's round(x / d)). Rounds by adding and
    subtracting 1.5 * 2^23 (to nearest, ties to even: jnp.round's rule), the constant `rounding` loaded at run
    time."""
    first = PAIRED if paired else 1
    q = [[] for _ in rest]
    for level in range(first - 1, levels):
        step = d / LEVEL_STEP**level  # exact: a power-of-two division
        top = 127.0 * LEVEL_STEP**level if level < first else 127.0
        for i, v in enumerate(rest):
            value = jnp.clip((v / step + rounding) - rounding, -top, top)
            rest[i] = v - value * step
            q[i].append(value)
    return q


def _slot_values(at: list[list[jax.Array]], paired: bool) -> list[list[jax.Array]]:
    """The integers a word's slots hold ([slot][byte p]) from its four values (_levels: at[p][value]): where
    paired, slot 0 the 16-bit values of bytes 0 and 1 and slot 1 zeros (its words hold those of bytes 2 and
    3: _level_words), then each further level's; else the level's."""
    values = [[v[j] for v in at] for j in range(len(at[0]))]
    return [values[0], [jnp.zeros_like(v) for v in values[0]], *values[1:]] if paired else values


def _level_words(at: list[list[jax.Array]], paired: bool) -> list[jax.Array]:
    """A word's int32 slots from its four values (_levels: at[p][value], p its byte): where paired, slots 0 and 1
    the 16-bit values of bytes 0, 1 and of bytes 2, 3 (low half first: dot2's operands), then a word of bytes per
    further level; else a word of bytes per level."""
    words, first = [], 0
    if paired:
        for half in range(2):
            low, high = (at[2 * half + lane][0].astype(jnp.int32) & 0xFFFF for lane in range(2))
            words.append(low | jnp.left_shift(high, 16))
        first = 1
    for j in range(first, len(at[0])):
        words.append(functools.reduce(jnp.bitwise_or, [
            jnp.left_shift(v[j].astype(jnp.int32) & 0xFF, 8 * p) for p, v in enumerate(at)]))
    return words


def _quantize_kernel(const_ref, *refs, x_form, levels, paired, interpret):
    """One 256-value block of one row of x: quantize_x and iq4_words in one pass, the first two levels as 16-bit
    values where paired (_level_words). x's refs (_x_operands; formed by _x_values) give the block [4, 2, 2, 4, 2,
    2] as (g2, gp, hi, w, h, b) (value 64*g2 + 32*gp + 16*hi + 4*w + 2*h + b); q_ref [levels, 4, 2, 2, 4] its words
    (g2, gp, h, w) per slot, that value at position 2*b + hi; d_ref [4, 2] the scales of its sub-blocks (g2, gp), /
    128 where paired."""
    *x_refs, q_ref, d_ref = refs
    rounding = kernel_magic(const_ref, use_byte_perm=True, interpret=interpret).round
    bytes_at = list(itertools.product(range(2), range(2), range(2)))  # (hi, h, b)
    rest = _x_blocks(x_form, x_refs, [(slice(None), slice(None), hi, slice(None), h, b)
                                      for hi, h, b in bytes_at])  # each [4, 2, 4]: (g2, gp, w)
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(v), axis=-1) for v in rest])
    d = jnp.maximum(amax, TINY) / 127.0  # [4, 2]: groups below 2^-100 quantize to zeros, as in quantize_x
    d_ref[...] = d / LEVEL_STEP if paired else d
    q = _levels(rest, d[..., None], levels, rounding, paired)  # q[i][value]
    for h in range(2):  # the word's byte p = 2*b + hi
        at = [q[bytes_at.index((p % 2, h, p // 2))] for p in range(4)]
        for slot, words in enumerate(_level_words(at, paired)):
            q_ref[slot, :, :, h, :] = words


@functools.partial(jax.jit, static_argnames=("levels", "interpret"))
def quantized_words(x: jax.Array | Deferred, levels: int, *, interpret: bool = False
                    ) -> tuple[jax.Array, jax.Array]:
    """(iq4_words(q), d reshaped [M, K / 256, 4, 2]) for (q, d) = quantize_x(x, levels) (a deferred x formed first,
    in the kernel), levels 0 and 1 as 16-bit values with the scale d / 128 where pairs_levels (_levels,
    _level_words), as one kernel launch of one program per 256 values: in XLA they were three fusions (the groups'
    maxima, the scales, the levels' words) per GEMV launch (H200 profile of an IQ4_XS 27B decode step: 744 launches,
    1.0 ms of 10.2; with this kernel 248 launches, 0.38 ms). Not bit for bit quantize_x where a compiler divides or
    fuses differently (a level may move by one); within the same error bound."""
    m, k = x.shape
    blocks = k // 256
    view = (4, 2, 2, 4, 2, 2)
    x = _in_blocks(x, view)
    arrays, specs = _x_operands(x, m, blocks, view)
    words, scales = pl.pallas_call(
        functools.partial(_quantize_kernel, x_form=_x_form(x), levels=levels, paired=pairs_levels(m, levels),
                          interpret=interpret),
        out_shape=(jax.ShapeDtypeStruct((m, levels, blocks, 4, 2, 2, 4), jnp.int32),
                   jax.ShapeDtypeStruct((m, blocks, 4, 2), jnp.float32)),
        grid=(m, blocks),
        in_specs=[WHOLE, *specs],
        out_specs=(pl.BlockSpec((None, levels, None, 4, 2, 2, 4), lambda r, j: (r, 0, j, 0, 0, 0, 0)),
                   pl.BlockSpec((None, None, 4, 2), lambda r, j: (r, j, 0, 0))),
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="quantize_x",
    )(jnp.asarray(_CONSTANTS, jnp.uint32), *arrays)
    return words, scales


def _natural_quantize_kernel(const_ref, *refs, x_form, levels, paired, interpret):
    """One 256-value block of one row of x in value order: x's refs (_x_operands; formed by _x_values) give the
    block [8, 2, 4, 4] as (group of 32, half, word, byte) (value 32g + 16h + 4w + b); q_ref [levels, 8, 2, 4] its
    words per slot (_level_words), position b of word (g, h, w) its value 32g + 16h + 4w + b; d_ref [8, 2] each
    group's scale (twice: once per half), / 128 where paired; s_ref [8, 2] the sum of each 16 values (float32,
    before quantization); ls_ref [levels, 8, 2] each slot's integer sum over each 16 values (_slot_values)."""
    *x_refs, q_ref, d_ref, s_ref, ls_ref = refs
    rounding = kernel_magic(const_ref, use_byte_perm=True, interpret=interpret).round
    rest = _x_blocks(x_form, x_refs, [(slice(None), slice(None), slice(None), b) for b in range(4)])  # each [8, 2, 4]
    s_ref[...] = functools.reduce(jnp.add, [jnp.sum(v, axis=-1) for v in rest])
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(v), axis=-1) for v in rest])  # [8, 2]
    amax = jnp.max(amax, axis=-1, keepdims=True)  # [8, 1]
    d = jnp.broadcast_to(jnp.maximum(amax, TINY) / 127.0, (8, 2))
    d_ref[...] = d / LEVEL_STEP if paired else d
    q = _levels(rest, d[..., None], levels, rounding, paired)  # q[b][value]
    for slot, words in enumerate(_level_words(q, paired)):
        q_ref[slot] = words
    for slot, values in enumerate(_slot_values(q, paired)):  # exact: at most 16 * 16,256
        ls_ref[slot] = functools.reduce(jnp.add, [jnp.sum(v, axis=-1) for v in values]).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("levels", "interpret"))
def natural_words(x: jax.Array | Deferred, levels: int, *, interpret: bool = False
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """x [M, K] (K a multiple of 256; a deferred x formed in the kernel) in `levels` int8 levels, words in value
    order, for the K-quants: (words int32 [M, levels, K / 256, 8, 2, 4], word (g, h, w) of each slot holding values
    32g + 16h + 4w .. + 3: where pairs_levels, slots 0 and 1 their 16-bit values round(x / (d / 128)) (two each, low
    half first), then a slot of bytes (low byte first) per further level, else a slot of bytes per level; scales [M,
    K / 256, 8, 2], max |x| / 127 of each 32 values (/ 128 where paired), twice; sums [M, K / 256, 8, 2] of each 16
    values of x; level sums int32 [M, levels, K / 256, 8, 2] of each slot's integers over each 16 values (slot 1's
    zeros where paired)), one kernel launch of a program per 256 values. The levels are quantize_x's (the same rule
    and bound)."""
    m, k = x.shape
    blocks = k // BLOCK
    view = (8, 2)
    x = _in_blocks(x, (*view, 4, 4))
    arrays, specs = _x_operands(x, m, blocks, (*view, 4, 4))
    return pl.pallas_call(
        functools.partial(_natural_quantize_kernel, x_form=_x_form(x), levels=levels,
                          paired=pairs_levels(m, levels), interpret=interpret),
        out_shape=(jax.ShapeDtypeStruct((m, levels, blocks, *view, 4), jnp.int32),
                   *(jax.ShapeDtypeStruct((m, blocks, *view), jnp.float32) for _ in range(2)),
                   jax.ShapeDtypeStruct((m, levels, blocks, *view), jnp.int32)),
        grid=(m, blocks),
        in_specs=[WHOLE, *specs],
        out_specs=(pl.BlockSpec((None, levels, None, *view, 4), lambda r, j: (r, 0, j, 0, 0, 0)),
                   *(pl.BlockSpec((None, None, *view), lambda r, j: (r, j, 0, 0)) for _ in range(2)),
                   pl.BlockSpec((None, levels, None, *view), lambda r, j: (r, 0, j, 0, 0))),
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="quantize_x_natural",
    )(jnp.asarray(_CONSTANTS, jnp.uint32), *arrays)


def quantized_x(x: jax.Array | Deferred, fmt: Int8Format, levels: int, *, interpret: bool = False
                ) -> tuple[jax.Array, ...]:
    """x [M, K] as the kernel takes it for `fmt`: (words [M, levels, K / 256, *fmt.x_words], its first two slots
    16-bit pairs where pairs_levels (_level_words), scales [M, K / 256, *fmt.x_scales], and where the format
    takes them float sums [M, K / 256, *fmt.x_sums] or level sums [M, levels, K / 256, *fmt.x_sums]), one
    quantization launch."""
    m, k = x.shape
    blocks = k // BLOCK
    if fmt.x_order == "iq4":
        xq, xd = quantized_words(x, levels, interpret=interpret)
    else:
        xq, xd, xs, xl = natural_words(x, levels, interpret=interpret)
    parts = [(xq, (m, levels, blocks, *fmt.x_words)), (xd, (m, blocks, *fmt.x_scales))]
    if fmt.sums == "float":
        parts.append((xs, (m, blocks, *fmt.x_sums)))
    elif fmt.sums == "levels":
        parts.append((xl, (m, levels, blocks, *fmt.x_sums)))
    return tuple(a.reshape(shape) for a, shape in parts)


def small_pieces(fmt: Int8Format, bs: BlockSizes, kb: int) -> dict[str, int]:
    """{small plane: pieces} for BlockSizes.split_small: the fewest halvings of a block's values of the plane that
    leave each load of a K step (BN / parts rows, kb blocks) fewer values than the program's threads."""
    if not bs.split_small:
        return {}
    pieces, threads = {}, 32 * bs.num_warps  # warps of 32: the kernel runs on CUDA only (uses_int8)
    for name in (name for name in fmt.small_planes if name not in fmt.split_planes):
        per_block, count = math.prod(fmt.planes[name]), 1
        while (bs.block_n // bs.parts) * kb * per_block // count >= threads and per_block % (2 * count) == 0:
            count *= 2
        if count > 1:
            pieces[name] = count
    return pieces


def _joined(pieces: list[jax.Array], view: tuple[int, ...]) -> jax.Array:
    """Loads [BN, KB, n] of a block's consecutive runs of n values -> [BN, KB, *view], by selects (each thread holds
    every piece at its positions: nothing moves between threads)."""
    at = lax.broadcasted_iota(jnp.int32, (1, 1, len(pieces), 1), 2)
    whole = pieces[-1][:, :, None, :]
    for i in range(len(pieces) - 2, -1, -1):
        whole = jnp.where(at == i, pieces[i][:, :, None, :], whole)
    return whole.reshape(*whole.shape[:2], *view)


def _load_step(planes, sl, fmt: Int8Format, flat: bool = False, pieces: dict[str, int] | None = None) -> dict:
    """The packed planes of this program's rows over the K step `sl`, loaded: {name: [BN, KB, *view]}, or for the
    format's split planes {indices on the split axes: the load at them} (Triton lowers no slicing of a loaded array,
    and its arrays must have power-of-two sizes: Q4_K's 3 x 4 scale bytes). With `flat` the code planes are views
    [BN, blocks * per block], each loaded as one run per row and reshaped (BlockSizes.flat); a plane in `pieces`
    (small_pieces) is a view [BN, blocks, pieces, per block / pieces], loaded a piece at a time and joined."""
    loaded = {}
    for name, plane in planes.items():
        view, axes = fmt.planes[name], fmt.split_planes.get(name)
        if pieces and name in pieces:
            loaded[name] = _joined([plane[:, sl, i, :] for i in range(pieces[name])], view)
            continue
        if flat and name in fmt.code_planes:
            per_block = math.prod(view)
            run = pl.ds(pl.multiple_of(sl.start * per_block, sl.size * per_block), sl.size * per_block)
            loaded[name] = plane[:, run].reshape(-1, sl.size, *view)
            continue
        if axes is None:
            loaded[name] = plane[:, sl]
            continue
        loaded[name] = {}
        for at in itertools.product(*(range(view[a]) for a in axes)):
            index = [slice(None)] * len(view)
            for a, i in zip(axes, at):
                index[a] = i
            loaded[name][at] = plane[(slice(None), sl, *index)]
    return loaded


def _kernel(*refs, fmt, tile_counts, stacked, block_n, tiles, parts, flat, pieces, kb, steps, levels, prefetch,
            interpret):
    """Program (0, j, split): row block j of the weights' outputs side by side (weight i owns tile_counts[i] blocks
    of tiles * BN rows), K steps split * steps ... of it; weight i's o [1, BM, tiles * BN] is that block's output."""
    # [layer], constants, per weight its planes (fmt.planes' order) whole, x words [BM, L, blocks, *fmt.x_words],
    # x scales [BM, blocks, *fmt.x_scales], [x float or level sums (quantized_x)], per weight o [1, BM, tiles * BN]
    refs = list(refs)
    layer = refs.pop(0)[0] if stacked else None
    const_ref = refs.pop(0)
    o_refs = [refs.pop() for _ in tile_counts][::-1]
    xs_ref = refs.pop() if fmt.sums else None
    xd_ref, xq_ref = refs.pop(), refs.pop()
    magic = kernel_magic(const_ref, use_byte_perm=True, interpret=interpret)
    block, split = pl.program_id(1), pl.program_id(2)
    stream = functools.partial(_stream_rows, fmt=fmt, xq_ref=xq_ref, xd_ref=xd_ref, xs_ref=xs_ref,
                               magic=magic, layer=layer, split=split, block_n=block_n, tiles=tiles, parts=parts,
                               flat=flat, pieces=pieces, kb=kb, steps=steps, levels=levels, prefetch=prefetch)
    count = len(fmt.planes)
    per_weight_tile(block, tile_counts, lambda i, local: stream(
        refs[count * i: count * (i + 1)], local * tiles * block_n, o_ref=o_refs[i]))


def _stream_rows(plane_refs, first_row, *, fmt: Int8Format, xq_ref, xd_ref, xs_ref, o_ref, magic, layer, split,
                 block_n, tiles, parts, flat, pieces, kb, steps, levels, prefetch):
    """o = x @ W[first_row : first_row + tiles * BN].T over this split's K steps, one weight's planes: the row
    tiles one after another, their K steps in one loop (loop step i: tile i // steps, K step i % steps); each tile's
    rows in `parts` parts of BN / parts rows (BlockSizes.parts)."""
    rows, part_n = o_ref.shape[1], block_n // parts

    def tile_planes(t, part):
        out_rows = pl.ds(pl.multiple_of(first_row + t * block_n + part * part_n, part_n), part_n)
        prefix = (out_rows,) if layer is None else (layer, out_rows)
        return {name: RowView(ref, prefix, WEIGHT_EVICTION) for name, ref in zip(fmt.planes, plane_refs)}

    def k_slice(s):
        return pl.ds(pl.multiple_of((split * steps + s) * kb, kb), kb)

    def load(i, names):  # lax.div / lax.rem: jnp's floor forms do not lower to Triton here
        tile, sl = lax.div(i, steps), k_slice(lax.rem(i, steps))
        return tuple(_load_step({name: view for name, view in tile_planes(tile, part).items() if name in names}, sl,
                                fmt, flat, pieces) for part in range(parts))

    def accumulate(loaded, s, accs):
        """accs[part][r] += the step's sums of the part's rows times x row r; x's words and scales loaded once
        for all parts."""
        sl = k_slice(s)
        x_loads = {}

        def x_at(ref, head, tail):
            """ref[(*head, sl, *tail)] with a leading unit axis, loaded once a step."""
            key = (id(ref), head, repr(tail))
            if key not in x_loads:
                x_loads[key] = ref[(*head, sl, *tail)][None]
            return x_loads[key]

        def slot_sum(group, r, slot, paired):
            """The group's integer dot products with row r's x words at `slot` (two slots of 16-bit pairs where
            paired), less its code bias, summed over each word axis [BN', KB, *acc]."""
            isum = jnp.zeros(group.terms[0][0].shape, jnp.int32)
            for words, index in group.terms:
                if paired:
                    isum = dot4.dot2(x_at(xq_ref, (r, slot), index), words, isum, high=False)
                    isum = dot4.dot2(x_at(xq_ref, (r, slot + 1), index), words, isum, high=True)
                else:
                    isum = dot4.dot4(words, x_at(xq_ref, (r, slot), index), isum)
            isum = jnp.sum(isum, axis=-1)
            if group.code_bias:
                isum = isum - group.code_bias * x_at(xs_ref, (r, slot), group.x_levels)
            return isum

        def level_sums(group, r):
            """The group's dot products with row r's x as floats [BN', KB, *acc], in units of x's scale as the
            quantization kernel gives it: the 16-bit pairs' sum (int32 to float: exact below 2^24, one rounding of
            2^-24 above) plus sum_l part_l / 128^(l - 1) over further levels l >= PAIRED; unpaired, sum_l part_l /
            128^l. The further levels first: on float32 x's three levels that held the 27B DeltaNet's four
            projections at 64 registers (70 with the pairs first: a program fewer a multiprocessor; read without a
            GPU)."""
            paired = pairs_levels(rows, levels)
            first = PAIRED if paired else 0
            further = None  # sum over levels l >= first of part_l / 128^(l - first)
            for level in range(first, levels):
                part = _s2f(slot_sum(group, r, level, False))  # exact
                further = part if further is None else fma(part, LEVEL_STEP**-(level - first), further)
            if not paired:
                return further
            pairs = slot_sum(group, r, 0, True).astype(jnp.float32)
            return pairs if further is None else fma(further, 1.0 / LEVEL_STEP, pairs)

        new = []
        for part_loaded, part_accs in zip(loaded, accs):
            groups = fmt.groups(part_loaded, magic)
            part_new = []
            for r, acc in enumerate(part_accs):
                for group in groups:
                    acc = fma(level_sums(group, r), group.scale * x_at(xd_ref, (r,), group.x_scale), acc)
                    if group.offset is not None:
                        x_sum = functools.reduce(jnp.add, [x_at(xs_ref, (r,), index) for index in group.x_sums])
                        acc = fma(group.offset, x_sum, acc)
                part_new.append(acc)
            new.append(tuple(part_new))
        return tuple(new)

    def store(t, accs):
        for part, part_accs in enumerate(accs):
            for r, acc in enumerate(part_accs):
                row = acc.sum(axis=tuple(range(1, acc.ndim)))
                o_ref[0, pl.ds(r, 1), pl.ds(t * block_n + part * part_n, part_n)] = row[None, :].astype(o_ref.dtype)

    zeros = ((jnp.zeros((part_n, kb, *fmt.acc), jnp.float32),) * rows,) * parts
    total = tiles * steps

    ahead = tuple(fmt.planes) if prefetch is True else fmt.small_planes if prefetch == "small" else ()
    now = tuple(name for name in fmt.planes if name not in ahead)

    def step(i, carry):
        loaded, accs = carry  # loaded: the planes in `ahead`, this step's, loaded by the step before
        upcoming = load(jnp.minimum(i + 1, total - 1), ahead)  # in flight while this step is decoded
        current = tuple({**ahead_part, **now_part} for ahead_part, now_part in zip(loaded, load(i, now)))
        accs = accumulate(current, lax.rem(i, steps), accs)
        if tiles > 1:
            last = lax.rem(i, steps) == steps - 1

            @pl.when(last)
            def _():
                store(lax.div(i, steps), accs)

            accs = jax.tree.map(lambda a: jnp.where(last, 0.0, a), accs)
        return upcoming, accs

    _, accs = lax.fori_loop(0, total, step, (load(0, ahead), zeros))
    if tiles == 1:
        store(0, accs)


def _program_rows(bs: BlockSizes) -> int:
    return bs.block_n * bs.tiles


def uses_int8(interpret: bool) -> bool:
    """Whether decode GEMVs take this kernel: where dot4 and byte_perm (quant_matmul.uses_byte_perm) are single
    instructions (CUDA), and interpreted (their XLA forms, so the tests check it); never with int8 activations off."""
    if not (backend.int8_activations() and dot4.REGISTERED and dot4.DOT2_REGISTERED and uses_byte_perm(interpret)):
        return False
    return interpret or backend.gpu_platform() in dot4.NATIVE_PLATFORMS


def supported(x_shape, w: QuantizedTensor, stacked: bool) -> bool:
    """Whether int8_quant_matmul takes x [..., in] @ W.T (W[layer].T when stacked)."""
    return supported_many(x_shape, (w,), stacked)


def supported_many(x_shape, ws, stacked: bool) -> bool:
    """Whether int8_quant_matmul_many takes x [..., in] and the packed weights ws (stacked: each [L, out_i, in],
    one L): one format it has, 1..MAX_ROWS rows of x, every in equal to x's, rows that whole row blocks cover when
    stacked."""
    m, ns = math.prod(x_shape[:-1]), [w.shape[0] for w in ws]
    if not (ws and 0 < m <= MAX_ROWS and all(w.ggml_type in FORMATS and w.ndim == 2 for w in ws)):
        return False
    if len({w.ggml_type for w in ws}) != 1 or any(w.shape[1] != x_shape[-1] for w in ws):
        return False
    if stacked and len({w.planes["d"].shape[0] for w in ws}) != 1:
        return False
    default = BlockSizes.get_default(m, sum(ns), ws[0].ggml_type, x_shape[-1] // BLOCK)
    return not stacked or all(n % _program_rows(default) == 0 for n in ns)


@functools.partial(jax.jit, static_argnames=("block_sizes", "levels", "out_dtype", "interpret", "debug"))
def int8_quant_matmul(x: jax.Array | Deferred, w: QuantizedTensor, layer: jax.Array | None = None, *,
                      block_sizes: BlockSizes | None = None, levels: int | None = None, out_dtype=None,
                      interpret: bool = False, debug: bool = False) -> jax.Array:
    """x [M, in] @ W.T (W[layer].T for W stacked over layers, every plane [L, rows, ...], read in place) -> [M, out]
    in out_dtype (default x's), M <= MAX_ROWS, x quantized to `levels` int8 levels (default levels_for(x.dtype));
    x may be deferred (luxjax.ops.deferred), formed by the quantization kernel."""
    return int8_quant_matmul_many(x, (w,), layer, block_sizes=block_sizes, levels=levels, out_dtype=out_dtype,
                                  interpret=interpret, debug=debug)[0]


@functools.partial(jax.jit, static_argnames=("block_sizes", "levels", "out_dtype", "interpret", "debug"))
def int8_quant_matmul_many(x: jax.Array | Deferred, ws: tuple[QuantizedTensor, ...],
                           layer: jax.Array | None = None, *,
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
    fmt = INT8_FORMATS[ws[0].ggml_type]
    ns = tuple(w.shape[0] for w in ws)
    blocks = k // BLOCK
    levels = levels or levels_for(x.dtype)
    bs = block_sizes or BlockSizes.get_default(m, sum(ns), ws[0].ggml_type, blocks, levels)
    kb = blocks_per_step(blocks, bs.blocks_k)
    if bs.block_n % bs.parts:
        raise ValueError(f"a row tile of {bs.block_n} rows does not split into {bs.parts} parts")
    program_rows = _program_rows(bs)
    pieces = small_pieces(fmt, bs, kb)
    views = {name: (blocks, *view) for name, view in fmt.planes.items()}
    if bs.flat:  # each row's codes as one run (BlockSizes.flat)
        views.update({name: (blocks * math.prod(fmt.planes[name]),) for name in fmt.code_planes})
    views.update({name: (blocks, count, math.prod(fmt.planes[name]) // count) for name, count in pieces.items()})
    if layer is None:  # rows padded to whole tiles (a stacked weight cannot be: it would be copied)
        planes = [[_pad_to(w.planes[name].reshape(n, *views[name]), 0, program_rows) for name in fmt.planes]
                  for w, n in zip(ws, ns)]
    elif any(n % program_rows for n in ns) or len({w.planes["d"].shape[0] for w in ws}) != 1:
        raise ValueError(f"stacked weights of one depth with rows a multiple of block_n * tiles = {program_rows}; "
                         f"got {[(w.planes['d'].shape[0], n) for w, n in zip(ws, ns)]}")
    else:
        planes = [[w.planes[name].reshape(-1, n, *views[name]) for name in fmt.planes] for w, n in zip(ws, ns)]
    padded = tuple(p[0].shape[0 if layer is None else 1] for p in planes)  # each plane [(L,) rows, blocks, ...]
    tile_counts = tuple(n // program_rows for n in padded)
    x_parts = quantized_x(x, fmt, levels, interpret=interpret)
    splits = bs.splits or split_count(sum(tile_counts), blocks // kb)
    if blocks % (kb * splits):
        raise ValueError(f"{splits} K splits of {kb}-block steps do not divide {blocks} blocks")
    out_dtype = out_dtype or x.dtype
    steps = blocks // (kb * splits)
    kernel = functools.partial(_kernel, fmt=fmt, tile_counts=tile_counts, stacked=layer is not None,
                               block_n=bs.block_n, tiles=bs.tiles, parts=bs.parts, flat=bs.flat, pieces=pieces, kb=kb,
                               steps=steps, levels=levels, prefetch=bs.prefetches(steps), interpret=interpret)
    x_specs = [pl.BlockSpec(a.shape, lambda i, j, s, nd=a.ndim: (0,) * nd) for a in x_parts]
    all_planes = [p for weight_planes in planes for p in weight_planes]
    ys = pl.pallas_call(
        kernel,
        out_shape=tuple(split_out_shape(splits, m, n, out_dtype) for n in padded),
        grid=(1, sum(tile_counts), splits),
        in_specs=[*(WHOLE for _ in range(len(all_planes) + 1 + (layer is not None))), *x_specs],
        out_specs=weight_out_specs(tile_counts, (1, m, program_rows)),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret, debug=debug, name=f"int8_gemv_{ws[0].ggml_type.name.lower()}",
    )(*([] if layer is None else [jnp.reshape(layer, (1,)).astype(jnp.int32)]),
      jnp.asarray(_CONSTANTS, jnp.uint32), *all_planes, *x_parts)
    return tuple(sum_splits(y, out_dtype)[:, :n] for y, n in zip(ys, ns))
