"""Qwen3.5 vision tower: patch embedding, bilinearly resampled learned positions, 2D RoPE, ViT blocks with
attention confined to each image, and the 2x2 patch merger. Host-side index math (position taps, rotary ids,
segments) lives in `vision_layout`; the tower itself is a pure function of padded arrays."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from luxjax.layers.basic import LayerNorm, Linear
from luxjax.layers.rope import apply_rotary, inverse_frequencies
from luxjax.models.qwen35.config import VisionConfig
from luxjax.ops.attention import block_diagonal_attention, image_segments

PREFIX = "model.visual."


class VisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, w: Callable[[str], object]):
        self.heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.approximate_gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        self.norm1 = LayerNorm(w("norm1.weight"), w("norm1.bias"), cfg.layer_norm_eps)
        self.norm2 = LayerNorm(w("norm2.weight"), w("norm2.bias"), cfg.layer_norm_eps)
        self.qkv = Linear(w("attn.qkv.weight"), w("attn.qkv.bias"))
        self.proj = Linear(w("attn.proj.weight"), w("attn.proj.bias"))
        self.fc1 = Linear(w("mlp.linear_fc1.weight"), w("mlp.linear_fc1.bias"))
        self.fc2 = Linear(w("mlp.linear_fc2.weight"), w("mlp.linear_fc2.bias"))

    def __call__(self, x, cos, sin, segments):
        N = x.shape[0]
        q, k, v = jnp.moveaxis(self.qkv(self.norm1(x)).reshape(N, 3, self.heads, self.head_dim), 1, 0)
        q = apply_rotary(q.astype(jnp.float32), cos, sin).astype(x.dtype)
        k = apply_rotary(k.astype(jnp.float32), cos, sin).astype(x.dtype)
        attn = block_diagonal_attention(q, k, v, segments, scale=self.head_dim**-0.5)
        x = x + self.proj(attn.reshape(N, -1))
        return x + self.fc2(jax.nn.gelu(self.fc1(self.norm2(x)), approximate=self.approximate_gelu))


class VisionTower(nnx.Module):
    def __init__(self, cfg: VisionConfig, weights: Callable[[str], object], dtype):
        self.cfg = cfg
        patch_w = jnp.asarray(weights(PREFIX + "patch_embed.proj.weight"))
        self.patch_embed = Linear(patch_w.reshape(cfg.hidden_size, -1).astype(dtype),
                                  jnp.asarray(weights(PREFIX + "patch_embed.proj.bias")).astype(dtype))
        self.pos_embed = nnx.Param(jnp.asarray(weights(PREFIX + "pos_embed.weight")).astype(dtype))
        blocks = [VisionBlock(cfg, lambda n, i=i: weights(f"{PREFIX}blocks.{i}.{n}")) for i in range(cfg.depth)]
        graphdef, *_ = nnx.split(blocks[0])
        self.blocks = nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.split(b)[1] for b in blocks]))
        del blocks
        self.merger_norm = LayerNorm(weights(PREFIX + "merger.norm.weight"), weights(PREFIX + "merger.norm.bias"),
                                     cfg.layer_norm_eps)
        self.merger_fc1 = Linear(weights(PREFIX + "merger.linear_fc1.weight"), weights(PREFIX + "merger.linear_fc1.bias"))
        self.merger_fc2 = Linear(weights(PREFIX + "merger.linear_fc2.weight"), weights(PREFIX + "merger.linear_fc2.bias"))

    def __call__(self, pixels, pos_taps, pos_weights, rope_ids, segments):
        """pixels [N, patch_dim]; pos_taps/pos_weights [N, 4]; rope_ids int32 [N, 2]; segments [N] (-1 = pad).
        Returns merged features [N / merge^2, out_hidden] (rows of padding patches are garbage)."""
        dtype = self.pos_embed.get_value().dtype
        x = self.patch_embed(pixels.astype(dtype))
        table = self.pos_embed.get_value()
        pos = jnp.sum(table[pos_taps].astype(jnp.float32) * pos_weights[..., None], axis=1)
        x = x + pos.astype(x.dtype)
        inv_freq = inverse_frequencies(self.cfg.head_dim // 2, self.cfg.rope_theta)
        freqs = rope_ids[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [N, 2, head_dim/4]
        emb = jnp.concatenate([freqs[:, 0], freqs[:, 1]], axis=-1)
        emb = jnp.concatenate([emb, emb], axis=-1)
        cos, sin = jnp.cos(emb), jnp.sin(emb)
        graphdef, stacked = nnx.split(self.blocks)
        segments = image_segments(segments)  # once, not per layer

        def body(h, state):
            return nnx.merge(graphdef, state)(h, cos, sin, segments), None

        x, _ = jax.lax.scan(body, x, stacked)
        unit = self.cfg.spatial_merge_size**2
        x = self.merger_norm(x).reshape(-1, unit * self.cfg.hidden_size)
        return self.merger_fc2(jax.nn.gelu(self.merger_fc1(x), approximate=False))


def _axis_taps(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps with align_corners=True on one axis, float32 as the reference computes them."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, 1).astype(np.float32)
    floor = np.floor(src)
    taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32)), 0, None)
    return taps, weights.astype(np.float32)


def vision_layout(grid_thw: np.ndarray, cfg: VisionConfig, padded_patches: int):
    """Per-patch host arrays for a batch of images in merge-block order, padded to `padded_patches`:
    position-table taps and weights, rotary (row, col) ids, and the image index of each patch (-1 = pad)."""
    m, side = cfg.spatial_merge_size, cfg.grid_side
    rows, cols, heights, widths, segments = [], [], [], [], []
    for i, (t, h, w) in enumerate(np.asarray(grid_thw, dtype=np.int64)):
        r, c = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        r = r.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).ravel()
        c = c.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).ravel()
        rows.append(np.tile(r, t))
        cols.append(np.tile(c, t))
        heights.append(np.full(t * h * w, h))
        widths.append(np.full(t * h * w, w))
        segments.append(np.full(t * h * w, i))
    row, col = np.concatenate(rows), np.concatenate(cols)
    h_taps, h_w = _axis_taps(row, np.concatenate(heights), side)
    w_taps, w_w = _axis_taps(col, np.concatenate(widths), side)
    taps = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    n = len(row)
    pad = padded_patches - n

    def padded(a, value=0):
        return np.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=value)

    return (
        padded(taps).astype(np.int32),
        padded(weights).astype(np.float32),
        padded(np.stack([row, col], -1)).astype(np.int32),
        padded(np.concatenate(segments), -1).astype(np.int32),
    )
