"""Prefill-sized matmul y = x @ W[layer].T for a dense (bf16 / f16) weight stacked over layers, read in place.

Why: the decoder scans over layers whose weights are stacked [L, out, in]. Handed the scan's slice W[layer], XLA
copies it into its own buffer before cuBLAS (dense_gemv.py says the same of decode); in a 1,012-token prefill of
the 27B those copies took 24 ms of 159 (an H200 profile, benchmarks/RESULTS.md). XLA's dynamic-slice fusion flag
did not remove them. This kernel takes the whole stacked array and the layer index: in a scan of eight
17,408 x 5,120 layers at M = 1,024 on an H200 (benchmarks/bench_layer_scan.py) it ran at 516 TFLOP/s, where XLA's
dot reached 460 on the scan's slice and 590 on separate arrays; the 27B's prefill lost its 24 ms of copies.

A [BM, BN] output tile per program, the K loop in float32 on the tensor cores; program (i, j) takes row tile i of
x and row tile j of W, i varying fastest, so the programs running together share W's tile (read once from
memory, again from L2). Where few output tiles would leave multiprocessors idle, K is split over `splits`
programs whose float32 partial sums XLA adds.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import ROCM_SHARED_BYTES, dot, on_rocm
from pallas_kernels.dense_gemv import MAX_ROWS as GEMV_MAX_ROWS
from pallas_kernels.dense_gemv import pow2_divisor, split_count, split_out_shape, sum_splits

DTYPES = (jnp.bfloat16, jnp.float16)  # float32 stays on cuBLAS: its full-precision products are not this kernel's


@dataclass(frozen=True)
class BlockSizes:
    block_m: int  # x rows per program
    block_n: int  # output rows (W rows) per program
    block_k: int  # K columns per step
    num_warps: int
    num_stages: int
    splits: int = 1  # programs sharing one output tile, each over k / splits columns

    @classmethod
    def get_default(cls, m: int, n: int, k: int) -> BlockSizes | None:
        """The fastest of an H200 sweep at the 27B's shapes, M = 1,024 (benchmarks/bench_kernels.py --only gemm
        --sweep): 128 x 256 tiles for wide outputs or long K, 128 x 128 otherwise, K split in two where the tiles
        are too few for two waves (more splits measured slower), lowered to powers of two dividing n and k; block_m
        the smallest power of two >= 16 holding m, up to 128. None if no tile fits."""
        block_m = 16
        while block_m < min(m, 128):
            block_m *= 2
        wide = n >= 12288 or k >= 16384
        block_n, block_k = pow2_divisor(n, 256 if wide else 128), pow2_divisor(k, 64)
        if block_n < 16 or block_k < 16:
            return None
        splits = min(2, split_count(-(-m // block_m) * (n // block_n), k // block_k))  # toward two waves
        bs = cls(block_m, block_n, block_k, 8 if block_m * block_n >= 128 * 256 else 4, 4 if splits == 1 else 3,
                 splits)
        return dataclasses.replace(bs, num_stages=bs.fitted_stages(x_tiles=1))

    def fitted_stages(self, x_tiles: int) -> int:
        """num_stages, fewer where the platform's shared memory holds fewer: on ROCm AMD's pipeliner keeps
        num_stages - 1 stages of tiles (x_tiles x tiles and a W tile, 16-bit) in LDS (gfx942, cross_compile.py:
        128 x 256 x 64 tiles 48 / 96 / 144 KiB at 2 / 3 / 4 stages), so at most 1 + ROCM_SHARED_BYTES // a
        stage's bytes; elsewhere as chosen."""
        if not on_rocm():
            return self.num_stages
        stage_bytes = 2 * (x_tiles * self.block_m + self.block_n) * self.block_k
        return max(1, min(self.num_stages, 1 + ROCM_SHARED_BYTES // stage_bytes))


def supported(x_shape, w_shape, x_dtype, w_dtype) -> bool:
    """Whether stacked_gemm takes x [..., in] @ W[layer].T for W [L, out, in]: more rows than the decode kernels
    take, one 16-bit dtype for both, and tiles that divide out and in."""
    m = math.prod(x_shape[:-1])
    if m <= GEMV_MAX_ROWS or len(w_shape) != 3 or x_shape[-1] != w_shape[2]:
        return False
    if jnp.dtype(x_dtype) != jnp.dtype(w_dtype) or jnp.dtype(w_dtype) not in DTYPES:
        return False
    return BlockSizes.get_default(m, w_shape[1], w_shape[2]) is not None


def _kernel(layer_ref, x_ref, *refs, block_n, block_k, steps, split_x):
    """Program (i, j, s): output tile (i, j), K steps s * steps ... (s + 1) * steps - 1; with split_x, both parts
    of x times each W tile into one accumulator."""
    *x_lo_ref, w_ref, o_ref = refs
    j, split = pl.program_id(1), pl.program_id(2)
    rows = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)
    layer = layer_ref[0]

    def step(s, acc):
        cols = pl.ds(pl.multiple_of((split * steps + s) * block_k, block_k), block_k)
        w = w_ref[layer, rows, cols]
        acc = acc + dot(x_ref[:, cols], w, ((1,), (1,)))
        if split_x:
            acc = acc + dot(x_lo_ref[0][:, cols], w, ((1,), (1,)))
        return acc

    acc = lax.fori_loop(0, steps, step, jnp.zeros((x_ref.shape[0], block_n), jnp.float32))
    o_ref[0] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_sizes", "out_dtype", "interpret", "debug"))
def stacked_gemm(x: jax.Array, w: jax.Array, layer: jax.Array, *, x_lo: jax.Array | None = None,
                 block_sizes: BlockSizes | None = None, out_dtype=None, interpret: bool = False,
                 debug: bool = False) -> jax.Array:
    """x [M, in] @ w[layer].T for w [L, out, in] -> [M, out] in out_dtype (default x.dtype), float32 accumulation.

    x_lo: a second part of x ([M, in], x's dtype), for (x + x_lo) @ w[layer].T with both parts multiplied in 16-bit
    (ops.linear.split_linear's float32 x as bf16 high and low parts): each W tile is loaded once for both and the
    products share one accumulator, instead of stacking the parts as rows and adding two outputs."""
    m, k = x.shape
    if w.ndim != 3 or w.shape[2] != k:
        raise ValueError(f"x {x.shape} @ w[layer].T needs x [M, in] and w [L, out, in]; got w {w.shape}")
    if x.dtype != w.dtype or jnp.dtype(x.dtype) not in DTYPES:
        raise ValueError(f"x and w of one 16-bit float dtype, got {x.dtype} and {w.dtype}")
    if x_lo is not None and (x_lo.shape != x.shape or x_lo.dtype != x.dtype):
        raise ValueError(f"x_lo {x_lo.shape} {x_lo.dtype} must match x {x.shape} {x.dtype}")
    n = w.shape[1]
    bs = block_sizes or BlockSizes.get_default(m, n, k)
    if bs is None or n % bs.block_n or k % (bs.block_k * bs.splits):
        raise ValueError(f"no tiles fit x {x.shape} @ w {w.shape} (block sizes {bs})")
    if x_lo is not None and block_sizes is None:  # a second x tile per stage: 4 stages of 128 x 256 overflow smem
        bs = dataclasses.replace(bs, num_stages=min(bs.num_stages, 3, bs.fitted_stages(x_tiles=2)))
    xs = [jnp.pad(a, ((0, -m % bs.block_m), (0, 0))) for a in (x, x_lo) if a is not None]
    rows = xs[0].shape[0]
    out_dtype = out_dtype or x.dtype
    kernel = functools.partial(_kernel, block_n=bs.block_n, block_k=bs.block_k, steps=k // (bs.block_k * bs.splits),
                               split_x=x_lo is not None)
    x_spec = pl.BlockSpec((bs.block_m, k), lambda i, j, s: (i, 0))
    y = pl.pallas_call(
        kernel,
        out_shape=split_out_shape(bs.splits, rows, n, out_dtype),
        grid=(rows // bs.block_m, n // bs.block_n, bs.splits),
        in_specs=[pl.BlockSpec(), *(x_spec for _ in xs), pl.BlockSpec()],
        out_specs=pl.BlockSpec((1, bs.block_m, bs.block_n), lambda i, j, s: (s, i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret, debug=debug, name="stacked_gemm",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), *xs, w)
    return sum_splits(y, out_dtype)[:m]


def stacked_gemm_reference(x: jax.Array, w: jax.Array, layer: jax.Array, out_dtype=None) -> jax.Array:
    """float32 x @ w[layer].T with exact float32 products."""
    wl = lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False).astype(jnp.float32)
    y = jnp.dot(x.astype(jnp.float32), wl.T, precision=lax.Precision.HIGHEST)
    return y.astype(out_dtype or x.dtype)
