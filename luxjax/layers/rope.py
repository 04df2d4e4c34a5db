"""Rotary embeddings: rotate_half pairing (j, j + d/2), applied to the leading `rotary_dim` dims only."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., heads, head_dim]; cos/sin [..., rotary_dim] broadcast over heads (inserted at axis -2)."""
    rd = cos.shape[-1]
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    rotated = x_rot * cos + rotate_half(x_rot) * sin
    return jnp.concatenate([rotated, x_pass], axis=-1) if x_pass.shape[-1] else rotated


def inverse_frequencies(dim: int, theta: float) -> np.ndarray:
    """theta^(-2k/dim) for k < dim/2, in float32 as the reference computes it."""
    return (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(np.float32)


def interleaved_mrope_axes(rotary_dim: int, mrope_section) -> np.ndarray:
    """Which position axis (0=T, 1=H, 2=W) drives each frequency: H at j%3==1 (j < 3*sec_h),
    W at j%3==2 (j < 3*sec_w), T elsewhere (llama.cpp's IMROPE)."""
    axes = np.zeros(rotary_dim // 2, dtype=np.int32)
    for axis, offset in ((1, 1), (2, 2)):
        axes[offset : 3 * mrope_section[axis] : 3] = axis
    return axes


def mrope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, axes: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """positions int32 [3, ...] -> cos, sin float32 [..., rotary_dim]."""
    freqs = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [3, ..., rd/2]
    axes = jnp.asarray(axes)
    picked = jnp.where(axes == 0, freqs[0], jnp.where(axes == 1, freqs[1], freqs[2]))
    emb = jnp.concatenate([picked, picked], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)
