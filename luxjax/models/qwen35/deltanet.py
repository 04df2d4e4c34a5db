"""Gated DeltaNet layer of the Qwen3.5 decoder: causal depthwise conv with state, beta/decay gates,
L2-normalised q/k, the gated delta rule (fp32 state), gated RMSNorm output.

The layer works on float32 activations in both compute modes. In bfloat16 mode its projections take their float32
inputs through ops.linear.split_linear (two bf16 products) rather than rounding them to bf16: measured on the
fixture against float32, rounding this layer's activations to bf16 was most of bf16 mode's error (with
split_linear: logit RMS error 0.343 -> 0.213, top-1 agreement 91.6% -> 94.1%; transformers' own bf16: 0.367,
92.3%), while rounding the weights alone costs nothing measurable."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from luxjax.layers.basic import GatedRMSNorm, Linear
from luxjax.models.qwen35.config import TextConfig
from luxjax.ops.delta_rule import gated_delta_rule
from luxjax.ops.linear import split_linear


class DeltaNetCache(NamedTuple):
    conv: jax.Array  # [B, kernel-1, conv_dim] float32: the last inputs of the causal conv
    state: jax.Array  # [B, v_heads, k_dim, v_dim] float32


def l2_normalize(x, eps: float = 1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: TextConfig, w):
        self.k_heads = cfg.linear_num_key_heads
        self.v_heads = cfg.linear_num_value_heads
        self.k_dim = cfg.linear_key_head_dim
        self.v_dim = cfg.linear_value_head_dim
        self.tiled_heads = cfg.linear_value_head_order == "tiled"
        self.in_proj_qkv = Linear(w("in_proj_qkv.weight"))
        self.in_proj_z = Linear(w("in_proj_z.weight"))
        self.in_proj_b = Linear(w("in_proj_b.weight"))
        self.in_proj_a = Linear(w("in_proj_a.weight"))
        conv = w("conv1d.weight")  # [conv_dim, 1, kernel] as stored
        self.conv_weight = nnx.Param(conv.reshape(conv.shape[0], conv.shape[-1]))
        self.dt_bias = nnx.Param(w("dt_bias"))
        self.A_log = nnx.Param(w("A_log"))
        self.norm = GatedRMSNorm(w("norm.weight"), cfg.rms_norm_eps)
        self.out_proj = Linear(w("out_proj.weight"))

    def _conv(self, qkv, cache_conv, valid_len):
        """Causal depthwise conv over [previous inputs; this chunk] with float32 accumulation (the reference conv
        rounds once, not per tap), then SiLU. Returns the new conv state: the last kernel-1 inputs up to each
        sequence's last valid token."""
        w = self.conv_weight.get_value().astype(jnp.float32)
        kernel = w.shape[-1]
        T = qkv.shape[1]
        xs = jnp.concatenate([cache_conv.astype(qkv.dtype), qkv], axis=1)  # [B, K-1+T, C]
        xf = xs.astype(jnp.float32)
        out = sum(xf[:, j : j + T, :] * w[:, j] for j in range(kernel)).astype(qkv.dtype)
        new_conv = jax.vmap(lambda x, n: jax.lax.dynamic_slice_in_dim(x, n, kernel - 1, axis=0))(xs, valid_len)
        return jax.nn.silu(out.astype(jnp.float32)).astype(qkv.dtype), new_conv

    def _expand_key_heads(self, x):
        """[B, T, k_heads, d] -> [B, T, v_heads, d] in the order the value heads are stored."""
        r = self.v_heads // self.k_heads
        if r == 1:
            return x
        return jnp.tile(x, (1, 1, r, 1)) if self.tiled_heads else jnp.repeat(x, r, axis=2)

    def __call__(self, x, cache: DeltaNetCache, valid, *, chunked: bool, dtype) -> tuple[jax.Array, DeltaNetCache]:
        """x [B, T, hidden] float32; valid [B, T] bool (a prefix of each row): padded tokens leave the state
        unchanged. `dtype`: the compute mode (bfloat16: projections through split_linear). Returns float32."""
        B, T, _ = x.shape
        x = x.astype(jnp.float32)
        if dtype == jnp.float32:
            project = lambda layer, v: layer(v)  # noqa: E731
        else:
            project = lambda layer, v: split_linear(v, layer.weight.get_value())  # noqa: E731
        valid_len = jnp.sum(valid, axis=1).astype(jnp.int32)
        qkv = project(self.in_proj_qkv, x)
        z = project(self.in_proj_z, x).reshape(B, T, self.v_heads, self.v_dim)
        b = project(self.in_proj_b, x)
        a = project(self.in_proj_a, x)
        qkv, new_conv = self._conv(qkv, cache.conv, valid_len)
        key_dim = self.k_heads * self.k_dim
        q = qkv[..., :key_dim].reshape(B, T, self.k_heads, self.k_dim)
        k = qkv[..., key_dim : 2 * key_dim].reshape(B, T, self.k_heads, self.k_dim)
        v = qkv[..., 2 * key_dim :].reshape(B, T, self.v_heads, self.v_dim)

        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        a_log = self.A_log.get_value().astype(jnp.float32)
        g = -jnp.exp(a_log) * jax.nn.softplus(a.astype(jnp.float32) + self.dt_bias.get_value().astype(jnp.float32))
        beta = jnp.where(valid[..., None], beta, 0.0)
        g = jnp.where(valid[..., None], g, 0.0)

        q = l2_normalize(self._expand_key_heads(q).astype(jnp.float32)) * (self.k_dim**-0.5)
        k = l2_normalize(self._expand_key_heads(k).astype(jnp.float32))
        k = jnp.where(valid[..., None, None], k, 0.0)
        v = jnp.where(valid[..., None, None], v.astype(jnp.float32), 0.0)

        to_heads = lambda t: jnp.swapaxes(t, 1, 2)  # noqa: E731  [B, T, H, ...] -> [B, H, T, ...]
        out, state = gated_delta_rule(
            to_heads(q), to_heads(k), to_heads(v), to_heads(g), to_heads(beta), cache.state, chunked=chunked
        )
        out = to_heads(out).astype(x.dtype)  # [B, T, v_heads, v_dim]
        out = self.norm(out, z).reshape(B, T, self.v_heads * self.v_dim)
        return project(self.out_proj, out), DeltaNetCache(new_conv.astype(cache.conv.dtype), state)


def empty_deltanet_cache(cfg: TextConfig, batch: int) -> DeltaNetCache:
    return DeltaNetCache(
        conv=jnp.zeros((batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), jnp.float32),
        state=jnp.zeros((batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                        jnp.float32),
    )
