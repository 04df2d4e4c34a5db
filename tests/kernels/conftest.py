"""Kernel tests run the Pallas kernels interpreted on CPU and compiled (Triton) on a GPU backend, against the
XLA ops. Each test draws a fresh seed, printed in its failure message; LUXJAX_TEST_SEED=<n> replays one."""
from __future__ import annotations

import os
import secrets

import jax
import pytest


@pytest.fixture
def seed() -> int:
    return int(os.environ["LUXJAX_TEST_SEED"]) if os.environ.get("LUXJAX_TEST_SEED") else secrets.randbelow(2**31)


@pytest.fixture
def interpret() -> bool:
    return jax.default_backend() != "gpu"
