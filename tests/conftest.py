"""Hygiene for the whole test session."""
from __future__ import annotations

import gc
import os
import secrets

import jax
import pytest


@pytest.fixture
def seed() -> int:
    """A fresh seed per test (LUXJAX_TEST_SEED=<n> replays one); tests put it in their failure messages."""
    value = int(os.environ["LUXJAX_TEST_SEED"]) if os.environ.get("LUXJAX_TEST_SEED") else secrets.randbelow(2**31)
    print(f"seed={value} (replay with LUXJAX_TEST_SEED={value})")
    return value


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Drop JAX's compiled programs after each test module. The suite compiles thousands of programs (interpreted
    Pallas kernels above all), and kept alive their memory mappings grew by ~50 a second toward Linux's default
    vm.max_map_count (65,530): full runs on 2026-12-01 crashed in XLA's CPU compiler (segmentation fault) at
    tests/models/test_qwen35_bf16.py, which passes alone. With this, a full run peaked at ~12,000 mappings."""
    yield
    jax.clear_caches()
    gc.collect()
