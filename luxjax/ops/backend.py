"""The one switch between Pallas kernels and the XLA path for every op in luxjax.ops.

LUXJAX_KERNELS=xla|pallas|auto (default auto) is read once, at the first call. auto: Pallas on a GPU backend
(CUDA or ROCm) when Pallas' Triton backend imports; xla: never; pallas: always where a kernel supports the shape
(on CPU the kernels then run in interpret mode, which is slow and meant for tests).
"""
from __future__ import annotations

import functools
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
