"""Timing shared by the kernel benchmarks."""
from __future__ import annotations

import time

import jax
import numpy as np


def median_ms(fn, *args, repeats: int = 15, warmups: int = 1) -> float:
    """Median wall milliseconds of fn(*args), waiting for the device, after `warmups` calls (the first compiles)."""
    for _ in range(warmups):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))
