"""Skinny matmul y = x @ W[layer].T for a dense (bf16 / f16 / f32) weight stacked over layers, read in place.

Why: the decoder scans over layers whose weights are stacked [L, out, in]. Handing XLA's dot the scan's slice
W[layer] makes XLA copy the slice into its own buffer before the GEMM (measured on an H200: benchmarks/
bench_layer_scan.py), so a decode step reads every weight three times. This kernel takes the whole stacked array
and the layer index and streams that layer's rows once.

Two regimes by the rows M of x (decode: 1..16):
- M == 1: each program owns BN output rows and multiply-adds [BN, BK] tiles in float32 registers along K,
  reduced once at the end (no tensor cores: a GEMV is bound by reading W);
- 2 <= M <= 16: x padded to 16 rows, one tensor-core dot per [16, BK] x [BK, BN] step.
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

MAX_ROWS = 16


@dataclass(frozen=True)
class BlockSizes:
    block_n: int  # output rows (W rows) per program
    block_k: int  # K columns per step
    num_warps: int
    num_stages: int

    @classmethod
    def get_default(cls, m: int, n: int, k: int) -> BlockSizes | None:
        """Largest power-of-two tiles up to the preferred ones that divide n and k; None if none fits. Preferred:
        the fastest of a sweep on an H200 (27B shapes, in the decoder's layer scan; bench_decode_gemv.py --sweep)."""
        want_n, want_k = (32, 256) if m == 1 else (32, 128)
        block_n, block_k = _pow2_divisor(n, want_n), _pow2_divisor(k, want_k)
        if block_n < (1 if m == 1 else 16) or block_k < 16:
            return None
        return cls(block_n, block_k, 8 if m == 1 else 4, 3)


def _pow2_divisor(size: int, most: int) -> int:
    b = most
    while b > 1 and size % b:
        b //= 2
    return b


def _kernel(layer_ref, x_ref, w_ref, o_ref, *, block_n, block_k, steps, reduce, dot_dtype):
    rows = pl.ds(pl.multiple_of(pl.program_id(0) * block_n, block_n), block_n)
    layer = layer_ref[0]

    def step(s, acc):
        cols = pl.ds(pl.multiple_of(s * block_k, block_k), block_k)
        w = w_ref[layer, rows, cols]  # [BN, BK]
        if reduce:
            return acc + w.astype(jnp.float32) * x_ref[0, cols].astype(jnp.float32)[None, :]
        return acc + dot(x_ref[:, cols].astype(dot_dtype), w.astype(dot_dtype), ((1,), (1,)))

    if reduce:
        acc = lax.fori_loop(0, steps, step, jnp.zeros((block_n, block_k), jnp.float32))
        o_ref[0, rows] = acc.sum(axis=1).astype(o_ref.dtype)
    else:
        acc = lax.fori_loop(0, steps, step, jnp.zeros((x_ref.shape[0], block_n), jnp.float32))
        o_ref[:, rows] = acc.astype(o_ref.dtype)


def supported(x_shape, w_shape, w_dtype) -> bool:
    """Whether stacked_gemv takes x [..., in] @ W[layer].T for W [L, out, in] of this dtype."""
    m = math.prod(x_shape[:-1])
    return (len(w_shape) == 3 and 0 < m <= MAX_ROWS and jnp.dtype(w_dtype) in (jnp.bfloat16, jnp.float16, jnp.float32)
            and BlockSizes.get_default(m, w_shape[1], w_shape[2]) is not None)


@functools.partial(jax.jit, static_argnames=("block_sizes", "out_dtype", "interpret", "debug"))
def stacked_gemv(x: jax.Array, w: jax.Array, layer: jax.Array, *, block_sizes: BlockSizes | None = None,
                 out_dtype=None, interpret: bool = False, debug: bool = False) -> jax.Array:
    """x [M, in] (M <= 16) @ w[layer].T for w [L, out, in] -> [M, out] in out_dtype (default x.dtype), float32
    accumulation; float32 operands get full float32 products."""
    m, k = x.shape
    _, n, kw = w.shape
    if kw != k or not 0 < m <= MAX_ROWS:
        raise ValueError(f"x {x.shape} @ w[layer].T needs x [M <= {MAX_ROWS}, in] and w [L, out, in]; w is {w.shape}")
    bs = block_sizes or BlockSizes.get_default(m, n, k)
    if bs is None or n % bs.block_n or k % bs.block_k:
        raise ValueError(f"no tiles fit w {w.shape} (block sizes {bs})")
    reduce = m == 1
    rows = 1 if reduce else MAX_ROWS
    xp = jnp.pad(x, ((0, rows - m), (0, 0)))
    dot_dtype = jnp.float32 if jnp.float32 in (x.dtype, w.dtype) else x.dtype
    kernel = functools.partial(_kernel, block_n=bs.block_n, block_k=bs.block_k, steps=k // bs.block_k,
                               reduce=reduce, dot_dtype=dot_dtype)
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, n), out_dtype or x.dtype),
        grid=(n // bs.block_n,),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret, debug=debug, name="stacked_gemv",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), xp, w)
    return y[:m]


def stacked_gemv_reference(x: jax.Array, w: jax.Array, layer: jax.Array, out_dtype=None) -> jax.Array:
    """float32 x @ w[layer].T with exact float32 products."""
    wl = lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False).astype(jnp.float32)
    y = jnp.dot(x.astype(jnp.float32), wl.T, precision=lax.Precision.HIGHEST)
    return y.astype(out_dtype or x.dtype)
