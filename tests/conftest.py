"""Hygiene for the whole test session."""
from __future__ import annotations

import gc

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Drop JAX's compiled programs after each test module. The suite compiles thousands of programs (interpreted
    Pallas kernels above all) and kept alive, their code mappings grow by ~50 a second; late in a full run they pass
    Linux's default vm.max_map_count (65,530) and XLA's CPU compiler crashes the process (segmentation fault) on
    the next large compile, as it did in tests/models/test_qwen35_bf16.py on 2026-12-01."""
    yield
    jax.clear_caches()
    gc.collect()
