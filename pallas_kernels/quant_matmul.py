"""Fused dequantize-matmul y = x @ W.T for ggml-packed W (Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS), Pallas on Triton.

One kernel, three regimes chosen by the rows M of x:
- M == 1 (decode GEMV): each program owns BN output rows and streams their packed blocks once along K,
  multiply-adding decoded float32 values into a float32 register tile, reduced once at the end;
- 2 <= M <= 16 (skinny GEMM): the same stream, x padded to 16 rows, one tensor-core `pl.dot` per piece;
- M >= 17 (prefill GEMM): a [BM, BN] output tile per program; W decoded to x's dtype (bf16) in registers.
Weights never leave their packed planes; the wrapper only reshapes them (free) and permutes x into the order
the decoders emit values (quant_decode.py). float32 x uses exact float32 products (precision HIGHEST).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from luxjax.checkpoint.quants import QuantizedTensor, dequantize
from pallas_kernels.quant_decode import KERNEL_FORMATS

GEMV_MAX_ROWS = 16  # x rows up to this use the streaming kernel, more the tiled GEMM


@dataclass(frozen=True)
class BlockSizes:
    block_m: int  # x rows per program (1: GEMV reduce; 16: skinny dot; more: GEMM)
    block_n: int  # output rows (W rows) per program
    blocks_k: int  # ggml blocks per K step (lowered to a power of two dividing blocks per row)
    num_warps: int
    num_stages: int

    @classmethod
    def get_default(cls, ggml_type, m: int) -> BlockSizes:
        """Fastest of a small sweep on an H200 (17408 x 5120, Q8_0 and Q4_K; benchmarks/bench_quant_matmul.py)."""
        block = KERNEL_FORMATS[ggml_type].block
        if m == 1:
            return cls(1, 8, 512 // block, 4, 3)
        if m <= GEMV_MAX_ROWS:
            return cls(16, 64, 512 // block, 4, 3)
        return cls(64, 128, max(1, 64 // block), 4, 3)


def _blocks_per_step(blocks: int, wanted: int) -> int:
    kb = 1
    while kb * 2 <= wanted and blocks % (kb * 2) == 0:
        kb *= 2
    return kb


def _kernel(*refs, names, pieces, piece, kb, steps, reduce, dot_dtype, precision):
    *plane_refs, x_ref, o_ref = refs  # planes [BN, blocks, *plane], x [BM, blocks, *x block], o [BM, BN]
    planes = dict(zip(names, plane_refs))
    block_n = o_ref.shape[1]

    def step(k, acc):
        sl = pl.ds(pl.multiple_of(k * kb, kb), kb)
        for w, xi in pieces(planes, sl):  # w [BN, KB, *piece] f32
            if reduce:
                x = x_ref[0, sl, *xi].astype(jnp.float32)  # [KB, *piece]
                acc = acc + w * x[None]
            else:
                x = x_ref[:, sl, *xi]  # [BM, KB, *piece]
                x = x.reshape(x.shape[0], -1).astype(dot_dtype)
                acc = acc + lax.dot_general(x, w.reshape(block_n, -1).astype(dot_dtype), (((1,), (1,)), ((), ())),
                                            precision=precision, preferred_element_type=jnp.float32)
        return acc

    if reduce:
        acc = lax.fori_loop(0, steps, step, jnp.zeros((block_n, kb, *piece), jnp.float32))
        while acc.ndim > 1:
            acc = acc.sum(axis=-1)
        o_ref[...] = acc[None, :].astype(o_ref.dtype)
    else:
        acc = lax.fori_loop(0, steps, step, jnp.zeros(o_ref.shape, jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)


def _pad_to(a: jax.Array, axis: int, multiple: int) -> jax.Array:
    pad = -a.shape[axis] % multiple
    if not pad:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, pad)
    return jnp.pad(a, widths)


@functools.partial(jax.jit, static_argnames=("block_sizes", "out_dtype", "interpret", "debug"))
def quant_matmul(x: jax.Array, w: QuantizedTensor, *, block_sizes: BlockSizes | None = None, out_dtype=None,
                 interpret: bool = False, debug: bool = False) -> jax.Array:
    """x [M, in] @ W.T for W [out, in] packed -> [M, out] in out_dtype (default x.dtype), written straight from
    the float32 accumulator."""
    fmt = KERNEL_FORMATS.get(w.ggml_type)
    if fmt is None:
        raise NotImplementedError(f"no fused kernel for {w.ggml_type.name} (have {[t.name for t in KERNEL_FORMATS]})")
    if w.ndim != 2 or x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {x.shape} @ W.T needs x [M, in] and W [out, in] with equal in; W is {w.shape}")
    m, (n, k) = x.shape[0], w.shape
    bs = block_sizes or BlockSizes.get_default(w.ggml_type, m)
    reduce = bs.block_m == 1
    if reduce and m != 1:
        raise ValueError(f"block_m=1 (GEMV reduce) needs one row of x, got {m=}")
    blocks = k // fmt.block
    kb = _blocks_per_step(blocks, bs.blocks_k)
    planes = {name: _pad_to(w.planes[name].reshape(n, blocks, *shape), 0, bs.block_n)
              for name, shape in fmt.planes.items()}
    xp = x.reshape(m, blocks, *fmt.x_split)
    xp = xp.transpose(0, 1, *(2 + a for a in fmt.x_perm))
    xp = _pad_to(xp, 0, bs.block_m)
    mp, np_ = xp.shape[0], planes[next(iter(planes))].shape[0]

    def plane_spec(a):
        return pl.BlockSpec((bs.block_n, *a.shape[1:]), lambda i, j, nd=a.ndim: (j,) + (0,) * (nd - 1))

    dot_dtype = jnp.float32 if x.dtype == jnp.float32 else x.dtype
    kernel = functools.partial(
        _kernel, names=tuple(planes), pieces=fmt.pieces, piece=fmt.piece, kb=kb, steps=blocks // kb, reduce=reduce,
        dot_dtype=dot_dtype, precision=lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None)
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype or x.dtype),
        grid=(mp // bs.block_m, np_ // bs.block_n),
        in_specs=[*(plane_spec(a) for a in planes.values()),
                  pl.BlockSpec((bs.block_m, *xp.shape[1:]), lambda i, j: (i,) + (0,) * (xp.ndim - 1))],
        out_specs=pl.BlockSpec((bs.block_m, bs.block_n), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret, debug=debug, name=f"quant_matmul_{w.ggml_type.name.lower()}",
    )(*planes.values(), xp)
    return y[:m, :n]


def quant_matmul_reference(x: jax.Array, w: QuantizedTensor, out_dtype=None) -> jax.Array:
    """Dequantize to float32, exact float32 matmul, result in out_dtype (default x.dtype)."""
    y = jnp.dot(x.astype(jnp.float32), dequantize(w, jnp.float32).T, precision=lax.Precision.HIGHEST)
    return y.astype(out_dtype or x.dtype)
