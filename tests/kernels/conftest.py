"""Kernel tests run the Pallas kernels interpreted on CPU and compiled (Triton) on a GPU backend, against the
XLA ops. Each test draws a fresh seed, printed in its failure message; LUXJAX_TEST_SEED=<n> replays one."""
from __future__ import annotations

import jax
import pytest


@pytest.fixture
def interpret() -> bool:
    return jax.default_backend() != "gpu"
