"""Gated full attention layer of the Qwen3.5 decoder (q/gate split, zero-centred q/k norms, partial M-RoPE, GQA)."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from luxjax.layers.basic import Linear, ZeroCenteredRMSNorm
from luxjax.layers.rope import apply_rotary
from luxjax.models.qwen35.config import TextConfig
from luxjax.ops.attention import cached_attention, gated_decode_attention, gated_decode_fused, write_kv
from luxjax.ops.linear import linear_many


class KVCache(NamedTuple):
    k: jax.Array  # [B, S, kv_heads, head_dim]
    v: jax.Array  # [B, S, kv_heads, head_dim]


class GatedAttention(nnx.Module):
    def __init__(self, cfg: TextConfig, w):
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = (lambda name: w(f"{name}.bias")) if cfg.attention_bias else (lambda name: None)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            Linear(w(f"{name}.weight"), bias(name)) for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
        self.q_norm = ZeroCenteredRMSNorm(w("q_norm.weight"), cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(w("k_norm.weight"), cfg.rms_norm_eps)

    def __call__(self, x, cos, sin, cache: KVCache, start, valid) -> tuple[jax.Array, KVCache]:
        """x [B, T, hidden]; cos/sin [B, T, rotary_dim]; start [B] = tokens already cached per sequence;
        valid [B, T]: tokens whose keys/values are written (padding and idle slots leave the cache alone)."""
        B, T, _ = x.shape
        projections = (self.q_proj, self.k_proj, self.v_proj)
        products = linear_many(x, [p.weight.get_value() for p in projections])
        q_gate, k, v = (p.add_bias(y) for p, y in zip(projections, products))
        if T == 1 and gated_decode_fused(cache.k, cache.v, self.heads, self.head_dim, cos.shape[-1]):
            return self._decode_fused(q_gate, k, v, cos, sin, cache, start, valid)
        q_gate = q_gate.reshape(B, T, self.heads, 2 * self.head_dim)
        q, gate = q_gate[..., : self.head_dim], q_gate[..., self.head_dim :]
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(B, T, self.kv_heads, self.head_dim))
        v = v.reshape(B, T, self.kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        cache = KVCache(write_kv(cache.k, k, start, valid), write_kv(cache.v, v, start, valid))
        out = cached_attention(q, cache.k, cache.v, start, scale=self.head_dim**-0.5)
        out = out.reshape(B, T, self.heads * self.head_dim) * jax.nn.sigmoid(gate.reshape(B, T, -1))
        return self.o_proj(out), cache

    def _decode_fused(self, q_gate, k, v, cos, sin, cache: KVCache, start, valid) -> tuple[jax.Array, KVCache]:
        """One token per sequence, the caches LayerSlices of their stacks: the norms, rotary, cache writes, attention
        and gate above in three kernel launches (luxjax.ops.attention.gated_decode_attention)."""
        B = q_gate.shape[0]
        out, k_cache, v_cache = gated_decode_attention(
            q_gate.reshape(B, self.heads, 2 * self.head_dim), k.reshape(B, self.kv_heads, self.head_dim),
            v.reshape(B, self.kv_heads, self.head_dim), self.q_norm.weight.get_value(),
            self.k_norm.weight.get_value(), cos[:, 0], sin[:, 0], cache.k, cache.v, start, valid[:, 0],
            scale=self.head_dim**-0.5, eps=self.q_norm.eps)
        return self.o_proj(out.reshape(B, 1, self.heads * self.head_dim)), KVCache(k_cache, v_cache)


def empty_kv_cache(cfg: TextConfig, batch: int, max_len: int, dtype) -> KVCache:
    shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
