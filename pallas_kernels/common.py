"""Pieces every attention kernel uses."""
from __future__ import annotations

import jax
import jax.numpy as jnp

NEG = -1e30  # finite "minus infinity": masked scores never make NaN through inf - inf


def dot(a, b, dims, precision=None):
    """dot_general on tiles with float32 accumulation; float32 tiles get full float32 products unless `precision`
    (a Precision or DotAlgorithmPreset) says otherwise."""
    if precision is None:
        precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=precision, preferred_element_type=jnp.float32)
