"""Causal prefill attention of a chunk of T queries over a KV cache (prefix + this chunk), flash style.

The q heads that share a kv head are folded into the query rows: row r of kv head g is token r // rep, q head
g * rep + r % rep. One program per (batch, kv head, block of rows) walks key blocks up to the causal limit of its
last row only; each K/V tile serves all q heads of its kv head.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import NEG, dot, on_rocm


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_m: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2

    @classmethod
    def get_default(cls, head_dim: int, dtype=jnp.bfloat16) -> "BlockSizes":
        """Tuned for 16-bit inputs; float32 ones take tiles of half the rows and keys, the same bytes of shared
        memory (the 16-bit tiles at float32 asked an H100 for 295,424 bytes at head dim 256, over its 232,448)."""
        wide = jnp.dtype(dtype).itemsize > 2
        if on_rocm():  # within ROCM_SHARED_BYTES: 64 KiB at head dim 256, 40 KiB at 128 (gfx942, cross_compile.py)
            if head_dim > 128:
                return cls(64, 16, 4, 2) if wide else cls(128, 32, 8, 2)
            return cls(32, 32, 4, 2) if wide else cls(64, 64, 4, 2)
        if head_dim > 128:  # H200 sweep, 27B shapes, T=1024 after 3072 cached: 483 us vs 857 us for (64, 32)
            return cls(64, 32, 4, 2) if wide else cls(block_m=128, block_k=64, num_warps=8, num_stages=2)
        return cls(32, 32, 4, 3) if wide else cls(block_m=64, block_k=64, num_warps=4, num_stages=3)


def _prefill_kernel(
    q_ref,  # [B, Hkv, R, D]   R = T * rep query rows
    k_ref,  # [B, S, Hkv, D]
    v_ref,  # [B, S, Hkv, D]
    start_ref,  # [B] int32: cache position of the chunk's first token
    o_ref,  # [B, Hkv, R, D]
    *,
    scale: float,
    rep: int,
    block_m: int,
    block_k: int,
):
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    R, head_dim = q_ref.shape[2], q_ref.shape[3]
    S = k_ref.shape[1]
    rows = i * block_m + jnp.arange(block_m)
    row_ok = rows < R
    q = plgpu.load(q_ref.at[b, h, pl.ds(i * block_m, block_m), :], mask=row_ok[:, None], other=0.0)
    start = start_ref[b]
    pos = start + rows // rep  # [block_m] cache position of each row's token
    last = jnp.minimum(start + (jnp.minimum((i + 1) * block_m, R) - 1) // rep, S - 1)

    def body(kb, carry):
        acc, m, l = carry
        idx = kb * block_k + jnp.arange(block_k)
        in_cache = idx < S
        k = plgpu.load(k_ref.at[b, pl.ds(kb * block_k, block_k), h, :], mask=in_cache[:, None], other=0.0)
        v = plgpu.load(v_ref.at[b, pl.ds(kb * block_k, block_k), h, :], mask=in_cache[:, None], other=0.0)
        visible = (idx[None, :] <= pos[:, None]) & in_cache[None, :]
        s = jnp.where(visible, dot(q, k, ((1,), (1,))) * scale, NEG)  # [block_m, block_k]
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        acc = acc * corr[:, None] + dot(p.astype(v.dtype), v, ((1,), (0,)))
        return acc, m_new, l * corr + p.sum(axis=1)

    init = (jnp.zeros((block_m, head_dim), jnp.float32), jnp.full((block_m,), NEG, jnp.float32),
            jnp.zeros((block_m,), jnp.float32))
    acc, _, l = jax.lax.fori_loop(0, last // block_k + 1, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    plgpu.store(o_ref.at[b, h, pl.ds(i * block_m, block_m), :], out.astype(o_ref.dtype), mask=row_ok[:, None])


@functools.partial(jax.jit, static_argnames=("scale", "block_sizes", "interpret", "debug"))
def prefill_attention(q, k_cache, v_cache, start, *, scale: float, block_sizes: BlockSizes | None = None,
                      interpret: bool = False, debug: bool = False):
    """q [B, T, Hq, D] at positions start[b] .. start[b]+T-1; k_cache, v_cache [B, S, Hkv, D] already holding
    the chunk. Query t sees cache rows 0 .. start[b]+t. Returns [B, T, Hq, D] in q.dtype."""
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    if Hq % Hkv:
        raise ValueError(f"{Hq=} q heads must be a multiple of {Hkv=} kv heads")
    if D < 16 or D & (D - 1):
        raise ValueError(f"head dim {D=} must be a power of two >= 16 (Triton block shapes)")
    bs = block_sizes or BlockSizes.get_default(D, q.dtype)
    rep = Hq // Hkv
    R = T * rep
    qr = q.reshape(B, T, Hkv, rep, D).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, R, D)
    kernel = functools.partial(_prefill_kernel, scale=scale, rep=rep, block_m=bs.block_m, block_k=bs.block_k)
    out = pl.pallas_call(
        kernel,
        grid=(B, Hkv, pl.cdiv(R, bs.block_m)),
        out_shape=jax.ShapeDtypeStruct((B, Hkv, R, D), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        debug=debug,
        name="prefill_attention",
    )(qr, k_cache, v_cache, start.astype(jnp.int32))
    return out.reshape(B, Hkv, T, rep, D).transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, D)


def prefill_attention_reference(q, k_cache, v_cache, start, *, scale: float):
    from luxjax.ops.attention import xla_cached_attention

    return xla_cached_attention(q, k_cache, v_cache, start, scale=scale)
