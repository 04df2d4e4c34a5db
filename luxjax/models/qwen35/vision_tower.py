"""Qwen3.5 vision tower: patch embedding, bilinearly resampled learned positions, 2D RoPE, ViT blocks with
attention confined to each image, and the 2x2 patch merger. The per-patch index math (position taps, rotary ids,
image runs) comes from the images' grid: `grid_layout` computes it inside the tower's jit (`VisionTower.encode`),
and `vision_layout` gives it as host arrays to callers that build batches there; the tower itself is a pure
function of padded arrays."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from luxjax.layers.basic import LayerNorm, Linear
from luxjax.layers.rope import apply_rotary, inverse_frequencies
from luxjax.models.qwen35.config import VisionConfig
from luxjax.ops.attention import ImageSegments, block_diagonal_attention, grid_segments, image_segments

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

    def encode(self, pixels, grid):
        """The tower on patches [N, patch_dim] of the images whose grid_thw is `grid` int32 [M, 3] (zero rows pad M
        to a bucket), laid out here: the host sends the grid, not four per-patch arrays."""
        taps, weights, rope_ids, ids, sizes = grid_layout(grid, self.cfg, pixels.shape[0])
        return self(pixels, taps, weights, rope_ids, grid_segments(ids, sizes))

    def __call__(self, pixels, pos_taps, pos_weights, rope_ids, segments):
        """pixels [N, patch_dim]; pos_taps/pos_weights [N, 4]; rope_ids int32 [N, 2]; segments: ImageSegments, or
        the image id of each patch [N] (-1 = pad). Returns merged features [N / merge^2, out_hidden] (rows of
        padding patches are garbage)."""
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
        if not isinstance(segments, ImageSegments):
            segments = image_segments(segments)  # once, not per layer

        def body(h, state):
            return nnx.merge(graphdef, state)(h, cos, sin, segments), None

        x, _ = jax.lax.scan(body, x, stacked)
        unit = self.cfg.spatial_merge_size**2
        x = self.merger_norm(x).reshape(-1, unit * self.cfg.hidden_size)
        return self.merger_fc2(jax.nn.gelu(self.merger_fc1(x), approximate=False))


def frame_grid(grid_thw: np.ndarray, rows: int | None = None) -> np.ndarray:
    """grid_thw [M, 3] as one (1, h, w) row per frame, int32, zero rows appended up to `rows`: the reference
    attends within each frame of a clip, and grid_layout gives each grid row its own attention segment."""
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    frames = np.repeat(np.concatenate([np.ones_like(grid[:, :1]), grid[:, 1:]], 1), grid[:, 0], axis=0)
    out = np.zeros((max(rows or 0, len(frames)), 3), np.int32)
    out[: len(frames)] = frames
    return out


def grid_layout(grid: jax.Array, cfg: VisionConfig, padded_patches: int):
    """The tower's per-patch layout from the grid [M, 3] (t, h, w per image; zero rows pad M), traceable (it runs
    inside the tower's jit), the patches of the images back to back in merge-block order, then padding up to
    `padded_patches`: position taps [N, 4] and weights, rotary (row, col) ids [N, 2], the grid row of each patch [N]
    (-1 = pad: its attention segment, so a clip sent as one row attends across its frames; see frame_grid), and the
    patch count of each row [M]. Integer index arithmetic, and the taps' float32 steps in the reference's order
    (identical on the CPU; a GPU's division may round the source coordinate a few units in the last place apart)."""
    m, side = cfg.spatial_merge_size, cfg.grid_side
    grid = grid.astype(jnp.int32)
    sizes = grid[:, 0] * grid[:, 1] * grid[:, 2]
    ends = jnp.cumsum(sizes)
    patch = jnp.arange(padded_patches, dtype=jnp.int32)
    # images ending at or before the patch: its image (zero-size images are skipped; past the last, pad)
    image = jnp.searchsorted(ends, patch, side="right", method="compare_all").astype(jnp.int32)
    real = image < grid.shape[0]
    image = jnp.minimum(image, grid.shape[0] - 1)
    h, w = grid[image, 1], grid[image, 2]
    frame = (patch - (ends - sizes)[image]) % jnp.maximum(h * w, 1)  # index within the image's frame
    block, inner = frame // (m * m), frame % (m * m)
    blocks_per_row = jnp.maximum(w // m, 1)
    row = (block // blocks_per_row) * m + inner // m
    col = (block % blocks_per_row) * m + inner % m
    taps, weights = _position_taps(row, col, h, w, side)
    keep = real[:, None]
    return (jnp.where(keep, taps, 0).astype(jnp.int32), jnp.where(keep, weights, 0).astype(jnp.float32),
            jnp.where(keep, jnp.stack([row, col], -1), 0).astype(jnp.int32), jnp.where(real, image, -1), sizes)


def vision_layout(grid_thw: np.ndarray, cfg: VisionConfig, padded_patches: int):
    """grid_layout's taps, weights, rotary ids and segment ids as numpy arrays, computed on the CPU, for callers
    that build batches on the host (a segment per frame, as frame_grid splits clips)."""
    with jax.default_device(jax.devices("cpu")[0]):
        arrays = _layout_on_host(frame_grid(grid_thw), cfg, padded_patches)
    return tuple(np.asarray(a) for a in arrays[:4])


_layout_on_host = jax.jit(grid_layout, static_argnames=("cfg", "padded_patches"))


def _position_taps(row, col, height, width, side: int):
    """The four bilinear taps into the side x side position table [N, 4] and their weights."""
    h_taps, h_w = _axis_taps(row, height, side)
    w_taps, w_w = _axis_taps(col, width, side)
    taps = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    return taps, (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)


def _axis_taps(index, size, side: int):
    """Bilinear taps with align_corners=True on one axis, float32 as the reference computes them."""
    src = index.astype(jnp.float32) * jnp.float32(side - 1) / jnp.maximum(size - 1, 1).astype(jnp.float32)
    floor = jnp.floor(src)
    taps = jnp.clip(floor.astype(jnp.int32)[:, None] + jnp.arange(2), 0, side - 1)
    weights = jnp.clip(1 - jnp.abs(src[:, None] - floor[:, None] - jnp.arange(2, dtype=jnp.float32)), 0, None)
    return taps, weights
