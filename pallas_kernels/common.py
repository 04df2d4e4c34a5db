"""Pieces the kernels share: the attention kernels' dot and masking value; what the platform's shared memory holds."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from luxjax.ops import backend

NEG = -1e30  # finite "minus infinity": masked scores never make NaN through inf - inf

# LDS a workgroup may use on AMD's MI200/MI300 (gfx90a, gfx942): a kernel asking more fails at launch. NVIDIA's
# H100/H200 give a block 227 KiB, where the kernels' tiles and pipeline stages were tuned; on ROCm they take
# smaller ones (benchmarks/cross_compile.py compiles every kernel of a model for gfx942 and reports its LDS).
ROCM_SHARED_BYTES = 64 * 1024


def on_rocm() -> bool:
    """Whether the kernels are compiled for an AMD GPU (the default GPU backend is ROCm)."""
    return backend.gpu_platform() == "rocm"


def dot(a, b, dims, precision=None):
    """dot_general on tiles with float32 accumulation; float32 tiles get full float32 products unless `precision`
    (a Precision or DotAlgorithmPreset) says otherwise."""
    if precision is None:
        precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=precision, preferred_element_type=jnp.float32)
