"""Helpers shared by the kernel tests (a module of its own: `from conftest import` resolves to whichever test
directory's conftest was imported first when pytest collects several directories)."""
from __future__ import annotations

import numpy as np


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), "non-finite output"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
