"""The one switch between Pallas kernels and the XLA path for every op in luxjax.ops.

LUXJAX_KERNELS=xla|pallas|auto (default auto) is read once, at the first call. auto: Pallas on a GPU backend
(CUDA or ROCm) when Pallas' Triton backend imports; xla: never; pallas: always where a kernel supports the shape
(on CPU the kernels then run in interpret mode, which is slow and meant for tests).
"""
from __future__ import annotations

import concurrent.futures
import functools
import logging
import os

import jax

_CHOICES = ("auto", "xla", "pallas")


@functools.cache
def _choice() -> str:
    choice = os.environ.get("LUXJAX_KERNELS", "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"LUXJAX_KERNELS={choice!r}; expected one of {_CHOICES}")
    return choice


@functools.cache
def _pallas_importable() -> bool:
    try:
        from jax.experimental.pallas import triton  # noqa: F401  (importable is the question)
    except ImportError:
        return False
    return True


def use_pallas() -> bool:
    """True when ops should call their Pallas kernel (each op still checks that its shapes are supported)."""
    choice = _choice()
    if choice == "xla" or not _pallas_importable():
        return False
    return choice == "pallas" or jax.default_backend() == "gpu"


@functools.cache
def int8_activations() -> bool:
    """Whether packed decode GEMVs may quantize x to int8 levels (pallas_kernels/quant_gemv_int8.py, where the
    platform has the instructions): LUXJAX_INT8_GEMV=on|off, default on. On, x is kept to 1/32,512 of each 32
    values' largest (16-bit x) or 1/4,161,536 (float32 x); off, x's values are multiplied exactly, and the 27B IQ4_XS
    decode measured 78.8 instead of 82.2 tokens/s at batch 1, 132.0 instead of 177.4 at batch 4 (H200)."""
    choice = os.environ.get("LUXJAX_INT8_GEMV", "on").strip().lower() or "on"
    if choice not in ("on", "off"):
        raise ValueError(f"LUXJAX_INT8_GEMV={choice!r}; expected on or off")
    return choice == "on"


def gpu_platform() -> str:
    """'rocm' or 'cuda' for the default GPU backend (JAX reports platform 'gpu' for both), for kernels whose fast
    form exists on one of them only; the backend's own name elsewhere ('cpu')."""
    if jax.default_backend() != "gpu":
        return jax.default_backend()
    version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
    return "rocm" if "rocm" in version or "hip" in version else "cuda"


def interpret() -> bool:
    """Pallas kernels run compiled on a GPU and interpreted elsewhere."""
    return jax.default_backend() != "gpu"


# Compiler options for the jitted functions whose large GEMMs take one layer of weights stacked over a layer scan
# (prefill, the vision tower). XLA otherwise copies each layer's slice into a buffer of its own before cuBLAS, or
# hands the product to a Triton GEMM fusion, which reads no slice in place either. With cuBLAS GEMMs and XLA's
# dynamic-slice fusion, cuBLAS reads the scan's slice where it lies: on an H200, eight scanned 17408 x 5120 MLP
# layers at 1,012 rows ran at 735 TFLOP/s against 560 for both the copying path and the Pallas in-place GEMM.
# XLA's DotMerger is off too: it joins the products of one input into one GEMM by concatenating their weights,
# which copied each attention layer's q, k and v weights (147 MB at the 27B shapes; 1.3 ms per 1,012-token
# prefill) on every call. Options of the GPU compiler only: other backends ignore them.
LAYER_SCAN_GEMM_OPTIONS = {"xla_gpu_enable_dynamic_slice_fusion": True, "xla_gpu_enable_triton_gemm": False,
                           "xla_gpu_dot_merger_threshold_mb": 0}


def cublas_reads_scanned_slices() -> bool:
    """True where a jit compiled with LAYER_SCAN_GEMM_OPTIONS should let the layer scan slice its weights (cuBLAS
    then reads each slice in place) rather than keep them stacked for the Pallas in-place GEMM: CUDA, where it was
    measured. The slice must be the scan's own (indexed by its loop counter): one indexed by a value the loop reads
    from an array was still copied."""
    return use_pallas() and gpu_platform() == "cuda"


@functools.cache
def cudnn_packed_attention() -> bool:
    """Whether cuDNN's fused attention with packed segments (one call for several images of different sizes) runs
    here and agrees with the XLA path: CUDA only, checked once on a tiny input. On an H200 it took half the Pallas
    vision kernel's time for one 3,900-patch image and a third for four of 975 (the Pallas kernel stays for ROCm
    and for LUXJAX_KERNELS=pallas)."""
    if _choice() != "auto" or not use_pallas() or gpu_platform() != "cuda":
        return False
    # First asked while a jit traces the tower: JAX's trace state is per thread, so a fresh thread runs the check
    # eagerly (jax.ensure_compile_time_eval did not run cuDNN's attention).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        agrees, reason = pool.submit(_check_cudnn_packed_attention).result()
    if not agrees:
        logging.getLogger(__name__).warning("cuDNN packed attention not used (%s); vision attention takes the Pallas "
                                            "kernel", reason)
    return agrees


def _check_cudnn_packed_attention() -> tuple[bool, str]:
    """(whether cuDNN's packed attention runs and agrees with the XLA path, why not)."""
    try:
        import jax.numpy as jnp
        import numpy as np

        from luxjax.ops.attention import cudnn_block_diagonal_attention, image_segments, xla_block_diagonal_attention

        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.standard_normal((80, 2, 72), np.float32), jnp.bfloat16) for _ in range(3))
        ids = jnp.asarray(np.repeat([0, 1, -1], [48, 24, 8]), jnp.int32)
        got = jax.jit(cudnn_block_diagonal_attention, static_argnames="scale")(q, k, v, image_segments(ids), scale=0.1)
        want = xla_block_diagonal_attention(q, k, v, ids, scale=0.1)
        if not np.allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2):
            return False, "its output differs from the XLA path's"
        return True, ""
    except Exception as e:  # an older cuDNN or JAX without sequence packing: the Pallas kernel serves
        return False, f"{type(e).__name__}: {str(e)[:200]}"
