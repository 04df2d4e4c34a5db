"""Causal attention of a chunk of queries over a per-sequence KV cache, XLA path.

q [B, T, Hq, D] (already rotated); k_cache, v_cache [B, S, Hkv, D] already holding this chunk's keys at
positions start[b] .. start[b]+T-1. Query t of sequence b sees cache slots 0 .. start[b]+t. GQA: query head h
uses kv head h // (Hq // Hkv). Softmax in float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def cached_attention(q, k_cache, v_cache, start, *, scale: float):
    B, T, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    rep = Hq // Hkv
    qg = q.reshape(B, T, Hkv, rep, D)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    scores = jnp.einsum(
        "btgrd,bsgd->bgrts", qg, k_cache, preferred_element_type=jnp.float32, precision=precision
    ) * scale
    query_pos = start[:, None] + jnp.arange(T)[None, :]  # [B, T]
    visible = jnp.arange(S)[None, None, :] <= query_pos[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    out = jnp.einsum("bgrts,bsgd->btgrd", probs, v_cache, preferred_element_type=jnp.float32, precision=precision)
    return out.reshape(B, T, Hq, D).astype(q.dtype)


def write_kv(cache, new, start):
    """cache [B, S, H, D] <- new [B, T, H, D] at rows start[b] .. start[b]+T-1 of each sequence. Rows past the
    end of the cache (padding of a bucketed chunk) are dropped, never shifted onto valid rows."""

    def one(c, n, s):
        return c.at[s + jnp.arange(n.shape[0])].set(n.astype(c.dtype), mode="drop")

    return jax.vmap(one)(cache, new, start)


def block_diagonal_attention(q, k, v, segment_ids, *, scale: float):
    """Bidirectional attention confined to equal segment ids (one id per image; -1 = padding).
    q, k, v [N, H, D] -> [N, H, D]."""
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    scores = jnp.einsum("nhd,mhd->hnm", q, k, preferred_element_type=jnp.float32, precision=precision) * scale
    same = (segment_ids[:, None] == segment_ids[None, :]) & (segment_ids[:, None] >= 0)
    scores = jnp.where(same[None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(same[None], probs, 0.0).astype(v.dtype)  # padding rows: all -inf -> nan; zero them
    out = jnp.einsum("hnm,mhd->nhd", probs, v, preferred_element_type=jnp.float32, precision=precision)
    return out.astype(q.dtype)
