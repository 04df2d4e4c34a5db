"""Block-diagonal (per image) bidirectional attention for the vision tower, flash style.

Equal segment ids must form contiguous runs (one run per image, -1 for padding). For each block of queries the
wrapper computes the key range spanned by the runs it touches, so a program reads only the keys of its own
images. Head dims that are not a power of two (72 for Qwen3.5's tower) are zero-padded for Triton.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import NEG, dot


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def get_default(cls, head_dim: int) -> "BlockSizes":
        if head_dim > 128:
            return cls(block_q=64, block_k=32, num_warps=8, num_stages=2)
        return cls(block_q=128, block_k=64, num_warps=8, num_stages=3)


def _vision_kernel(
    q_ref,  # [N, H, D]
    k_ref,  # [N, H, D]
    v_ref,  # [N, H, D]
    seg_ref,  # [N] int32, -1 = padding
    lo_ref,  # [num_q_blocks] int32: first key any query of the block can see
    hi_ref,  # [num_q_blocks] int32: one past the last such key
    o_ref,  # [N, H, D]
    *,
    scale: float,
    block_q: int,
    block_k: int,
):
    i, h = pl.program_id(0), pl.program_id(1)
    N, _, head_dim = q_ref.shape
    rows = i * block_q + jnp.arange(block_q)
    row_ok = rows < N
    q = plgpu.load(q_ref.at[pl.ds(i * block_q, block_q), h, :], mask=row_ok[:, None], other=0.0)
    seg_q = plgpu.load(seg_ref.at[pl.ds(i * block_q, block_q)], mask=row_ok, other=-1)
    first_block = lo_ref[i] // block_k

    def body(kb, carry):
        acc, m, l = carry
        idx = kb * block_k + jnp.arange(block_k)
        in_range = idx < N
        k = plgpu.load(k_ref.at[pl.ds(kb * block_k, block_k), h, :], mask=in_range[:, None], other=0.0)
        v = plgpu.load(v_ref.at[pl.ds(kb * block_k, block_k), h, :], mask=in_range[:, None], other=0.0)
        seg_k = plgpu.load(seg_ref.at[pl.ds(kb * block_k, block_k)], mask=in_range, other=-2)
        same = (seg_q[:, None] == seg_k[None, :]) & (seg_q[:, None] >= 0)
        s = jnp.where(same, dot(q, k, ((1,), (1,))) * scale, NEG)  # [block_q, block_k]
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(same, jnp.exp(s - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        acc = acc * corr[:, None] + dot(p.astype(v.dtype), v, ((1,), (0,)))
        return acc, m_new, l * corr + p.sum(axis=1)

    init = (jnp.zeros((block_q, head_dim), jnp.float32), jnp.full((block_q,), NEG, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    acc, _, l = jax.lax.fori_loop(first_block, pl.cdiv(hi_ref[i], block_k), body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]  # padding rows: l = 0, acc = 0 -> 0
    plgpu.store(o_ref.at[pl.ds(i * block_q, block_q), h, :], out.astype(o_ref.dtype), mask=row_ok[:, None])


def _key_ranges(segment_ids, block_q: int):
    """[lo, hi) key range per query block: from the start of its first query's run to the end of its last's."""
    N = segment_ids.shape[0]
    pos = jnp.arange(N, dtype=jnp.int32)
    changes = segment_ids[1:] != segment_ids[:-1]
    run_start = jax.lax.cummax(jnp.where(jnp.concatenate([jnp.array([True]), changes]), pos, 0))
    run_end = jax.lax.cummin(jnp.where(jnp.concatenate([changes, jnp.array([True])]), pos + 1, N), reverse=True)
    first = jnp.arange(0, N, block_q, dtype=jnp.int32)
    last = jnp.minimum(first + block_q, N) - 1
    return run_start[first], run_end[last]


@functools.partial(jax.jit, static_argnames=("scale", "block_sizes", "interpret", "debug"))
def vision_attention(q, k, v, segment_ids, *, scale: float, block_sizes: BlockSizes | None = None,
                     interpret: bool = False, debug: bool = False):
    """q, k, v [N, H, D]; segment_ids [N] (contiguous runs, -1 = padding) -> [N, H, D] in q.dtype; padding
    rows are zero."""
    N, H, D = q.shape
    if segment_ids.shape != (N,):
        raise ValueError(f"segment_ids shape {segment_ids.shape} must be ({N},)")
    Dp = max(16, pl.next_power_of_2(D))
    if Dp != D:
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, Dp - D))) for x in (q, k, v))
    bs = block_sizes or BlockSizes.get_default(Dp)
    segment_ids = segment_ids.astype(jnp.int32)
    lo, hi = _key_ranges(segment_ids, bs.block_q)
    kernel = functools.partial(_vision_kernel, scale=scale, block_q=bs.block_q, block_k=bs.block_k)
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(N, bs.block_q), H),
        out_shape=jax.ShapeDtypeStruct((N, H, Dp), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        debug=debug,
        name="vision_attention",
    )(q, k, v, segment_ids, lo, hi)
    return out[..., :D]


def vision_attention_reference(q, k, v, segment_ids, *, scale: float):
    from luxjax.ops.attention import xla_block_diagonal_attention

    return xla_block_diagonal_attention(q, k, v, segment_ids, scale=scale)
