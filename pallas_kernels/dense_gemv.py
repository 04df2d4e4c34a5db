"""Skinny matmul y = x @ W[layer].T for a dense (bf16 / f16 / f32) weight stacked over layers, read in place.

Why: the decoder scans over layers whose weights are stacked [L, out, in]. Handing XLA's dot the scan's slice
W[layer] makes XLA copy the slice into its own buffer before the GEMM (measured on an H200: benchmarks/
bench_layer_scan.py), so a decode step reads every weight three times. This kernel takes the whole stacked array
and the layer index and streams that layer's rows once.

Two regimes by the rows M of x (decode: 1..16):
- M == 1: each program owns BN output rows and multiply-adds [BN, BK] tiles in float32 registers along K,
  reduced once at the end (no tensor cores: a GEMV is bound by reading W);
- 2 <= M <= 16: x padded to 16 rows, one tensor-core dot per [16, BK] x [BK, BN] step; up to 32 rows the same at
  32 (both bf16 parts of 16 float32 rows, ops.linear.split_linear, in one read of W).
Weights with few output rows (a DeltaNet gate projection has 48, a key/value projection 1,024) would give too few
programs to keep every multiprocessor streaming, and one 5,120-row output gives 160 programs: 1.2 waves on an H200's
132 multiprocessors. Such shapes split K over `splits` programs per row tile, which write float32 partial sums that
one small XLA reduction adds up.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import dot

MAX_ROWS = 16  # rows of x a decode step's product has (more: prefill's GEMM)
PARTS_MAX_ROWS = 32  # rows the kernel takes: a float32 x's two bf16 parts stacked


@dataclass(frozen=True)
class BlockSizes:
    block_n: int  # output rows (W rows) per program
    block_k: int  # K columns per step
    num_warps: int
    num_stages: int
    splits: int = 1  # programs sharing one row tile, each over k / splits columns

    @classmethod
    def get_default(cls, m: int, n: int | tuple[int, ...], k: int) -> BlockSizes | None:
        """Largest power-of-two tiles up to the preferred ones that divide every n and k; None if none fits.
        Preferred: the fastest of a sweep on an H200 (27B shapes, in the decoder's layer scan;
        bench_decode_gemv.py --dense-sweep: 1 and 2 rows, what batch-1 decode runs; 128-wide K steps for more rows,
        where 256 measured 2% slower end to end at batch 16). K is split until there are MIN_PROGRAMS programs (or
        the steps run out)."""
        ns = n if isinstance(n, tuple) else (n,)
        want_n, want_k = (16, 512) if m == 1 else (32, 256) if m == 2 else (32, 128)
        block_n, block_k = pow2_divisor(math.gcd(*ns), want_n), pow2_divisor(k, want_k)
        if block_n < (1 if m == 1 else 16) or block_k < 16:
            return None
        return cls(block_n, block_k, 8 if m == 1 else 4, 3, split_count(sum(ns) // block_n, k // block_k))


MIN_PROGRAMS = 264  # two waves of an H200's 132 multiprocessors (more splits measured no faster on 5,120 rows)


def split_count(row_tiles: int, steps: int, min_programs: int = MIN_PROGRAMS) -> int:
    """The fewest power-of-two K splits (each a whole number of steps) giving row_tiles * splits >= min_programs."""
    splits = 1
    while row_tiles * splits < min_programs and steps % (2 * splits) == 0:
        splits *= 2
    return splits


def split_out_shape(splits: int, rows: int, n: int, out_dtype) -> jax.ShapeDtypeStruct:
    """A K-split kernel's output: [splits, rows, n], float32 partial sums when split, else out_dtype directly."""
    return jax.ShapeDtypeStruct((splits, rows, n), out_dtype if splits == 1 else jnp.float32)


def sum_splits(y: jax.Array, out_dtype) -> jax.Array:
    """[rows, n] in out_dtype from a split_out_shape output: its partial sums added."""
    return y[0] if y.shape[0] == 1 else y.sum(axis=0).astype(out_dtype)


def per_weight_tile(tile, tile_counts: tuple[int, ...], body) -> None:
    """Inside a kernel over several weights' row tiles side by side (weight i owns tile_counts[i] of them): calls
    body(i, tile within weight i) for the weight that row tile `tile` (a program id) falls in."""
    if len(tile_counts) == 1:
        body(0, tile)
        return
    first = 0
    for i, count in enumerate(tile_counts):
        @pl.when((tile >= first) & (tile < first + count))
        def _(i=i, first=first):
            body(i, tile - first)

        first += count


def weight_out_specs(tile_counts: tuple[int, ...], block_shape: tuple[int, ...]) -> list[pl.BlockSpec]:
    """Out specs giving each weight of a kernel over several weights' row tiles (grid (row block, tile, split)) an
    output of its own, [splits, rows of x, its rows]: program (i, j, s) writes block (s, i, j - first) of weight
    w's output, where w owns tiles [first, first + count); the other weights' specs point it at a clamped block it
    never writes (Triton stores only what the kernel stores). One array per weight rather than slices of one: a
    slice feeding another kernel is a copy of its own (XLA fuses slices only into its own fusions; a 27B decode
    step on an H200 made 176 such launches)."""
    specs, first = [], 0
    for count in tile_counts:
        specs.append(pl.BlockSpec(block_shape, lambda i, j, s, first=first, count=count: (
            s, i, jnp.clip(j - first, 0, count - 1))))
        first += count
    return specs


def pow2_divisor(size: int, most: int) -> int:
    """The largest power of two <= most that divides size (1 at least)."""
    b = most
    while b > 1 and size % b:
        b //= 2
    return b


def _kernel(layer_ref, x_ref, *refs, tiles, block_n, block_k, steps, reduce, dot_dtype):
    """Program (tile, split): row tile `tile` of the weights' outputs side by side (weight i owns tiles[i] of them),
    K steps split * steps ... of it. Weight i's o_ref [splits, M, N_i]: partial sums go to row `split` (0 when
    unsplit)."""
    w_refs, o_refs = refs[:len(tiles)], refs[len(tiles):]
    tile, split = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]

    def product(w_ref, o_ref, rows):
        def step(s, acc):
            cols = pl.ds(pl.multiple_of((split * steps + s) * block_k, block_k), block_k)
            w = w_ref[layer, rows, cols]  # [BN, BK]
            if reduce:
                return acc + w.astype(jnp.float32) * x_ref[0, cols].astype(jnp.float32)[None, :]
            return acc + dot(x_ref[:, cols].astype(dot_dtype), w.astype(dot_dtype), ((1,), (1,)))

        if reduce:
            acc = lax.fori_loop(0, steps, step, jnp.zeros((block_n, block_k), jnp.float32))
            o_ref[split, 0, rows] = acc.sum(axis=1).astype(o_ref.dtype)
        else:
            acc = lax.fori_loop(0, steps, step, jnp.zeros((x_ref.shape[0], block_n), jnp.float32))
            o_ref[split, :, rows] = acc.astype(o_ref.dtype)

    per_weight_tile(tile, tiles, lambda i, local: product(
        w_refs[i], o_refs[i], pl.ds(pl.multiple_of(local * block_n, block_n), block_n)))


_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def supported(x_shape, w_shape, w_dtype) -> bool:
    """Whether stacked_gemv takes x [..., in] @ W[layer].T for W [L, out, in] of this dtype."""
    return supported_many(x_shape, (w_shape,), (w_dtype,))


def supported_many(x_shape, w_shapes, w_dtypes) -> bool:
    """Whether stacked_gemv_many takes x [..., in] and weights [L, out_i, in] of these shapes and dtypes: one dtype,
    one L and one in for all, and tiles that divide every out_i."""
    m = math.prod(x_shape[:-1])
    if not 0 < m <= PARTS_MAX_ROWS or len({jnp.dtype(d) for d in w_dtypes}) != 1:
        return False
    if jnp.dtype(w_dtypes[0]) not in _DTYPES:
        return False
    if any(len(s) != 3 for s in w_shapes) or len({(s[0], s[2]) for s in w_shapes}) != 1:
        return False
    return BlockSizes.get_default(m, tuple(s[1] for s in w_shapes), w_shapes[0][2]) is not None


@functools.partial(jax.jit, static_argnames=("block_sizes", "out_dtype", "interpret", "debug"))
def stacked_gemv(x: jax.Array, w: jax.Array, layer: jax.Array, *, block_sizes: BlockSizes | None = None,
                 out_dtype=None, interpret: bool = False, debug: bool = False) -> jax.Array:
    """x [M, in] (M <= 32) @ w[layer].T for w [L, out, in] -> [M, out] in out_dtype (default x.dtype), float32
    accumulation; float32 operands get full float32 products."""
    return stacked_gemv_many(x, (w,), layer, block_sizes=block_sizes, out_dtype=out_dtype, interpret=interpret,
                             debug=debug)[0]


@functools.partial(jax.jit, static_argnames=("block_sizes", "out_dtype", "interpret", "debug"))
def stacked_gemv_many(x: jax.Array, ws: tuple[jax.Array, ...], layer: jax.Array, *,
                      block_sizes: BlockSizes | None = None, out_dtype=None, interpret: bool = False,
                      debug: bool = False) -> tuple[jax.Array, ...]:
    """(x @ w[layer].T for w in ws) in one kernel launch: the projections of one input (a gate and an up
    projection, or q, k and v) as one grid over all their row tiles. Each launch leaves multiprocessors idle at its
    start and in its last wave, and a small projection alone is too few programs to stream at full rate."""
    m, k = x.shape
    if not 0 < m <= PARTS_MAX_ROWS or any(w.ndim != 3 or w.shape[2] != k or w.shape[0] != ws[0].shape[0] for w in ws):
        raise ValueError(f"x {x.shape} @ w[layer].T needs x [M <= {PARTS_MAX_ROWS}, in] and every w [L, out, in]; "
                         f"got {[w.shape for w in ws]}")
    if len({w.dtype for w in ws}) != 1:
        raise ValueError(f"weights of one dtype, got {[w.dtype for w in ws]}")
    ns = tuple(w.shape[1] for w in ws)
    bs = block_sizes or BlockSizes.get_default(m, ns, k)
    if bs is None or any(n % bs.block_n for n in ns) or k % (bs.block_k * bs.splits):
        raise ValueError(f"no tiles fit weights {[w.shape for w in ws]} (block sizes {bs})")
    reduce = m == 1
    rows = 1 if reduce else MAX_ROWS if m <= MAX_ROWS else PARTS_MAX_ROWS
    xp = jnp.pad(x, ((0, rows - m), (0, 0)))
    dot_dtype = jnp.float32 if jnp.float32 in (x.dtype, ws[0].dtype) else x.dtype
    out_dtype = out_dtype or x.dtype
    tiles = tuple(n // bs.block_n for n in ns)
    kernel = functools.partial(_kernel, tiles=tiles, block_n=bs.block_n, block_k=bs.block_k,
                               steps=k // (bs.block_k * bs.splits), reduce=reduce, dot_dtype=dot_dtype)
    ys = pl.pallas_call(
        kernel,
        out_shape=tuple(split_out_shape(bs.splits, rows, n, out_dtype) for n in ns),  # one per weight: no slices
        grid=(sum(tiles), bs.splits),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret, debug=debug, name="stacked_gemv",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), xp, *ws)
    return tuple(sum_splits(y[:, :m], out_dtype) for y in ys)


def stacked_gemv_reference(x: jax.Array, w: jax.Array, layer: jax.Array, out_dtype=None) -> jax.Array:
    """float32 x @ w[layer].T with exact float32 products."""
    wl = lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False).astype(jnp.float32)
    y = jnp.dot(x.astype(jnp.float32), wl.T, precision=lax.Precision.HIGHEST)
    return y.astype(out_dtype or x.dtype)
