"""The unitriangular solve of the chunked delta rule (forward substitution on the CPU) against numpy's general
solver in float64, its gradients against lax's triangular solve, and repeated runs of its gradient inside a scan
(the pattern that stalled XLA:CPU when lax's solve was used there)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from luxjax.ops.delta_rule import unit_lower_solve


def _system(rng, *batch, n=64):
    """A unit lower-triangular system shaped like the UT transform's (entries of k_beta k^T, |.| < 1), with an
    upper triangle and diagonal full of noise that the solve must not read."""
    lower = np.tril(rng.uniform(-0.9, 0.9, (*batch, n, n)) * rng.uniform(0, 1, (*batch, 1, 1)), -1)
    noise = np.triu(rng.standard_normal((*batch, n, n)) * 5)
    return lower + noise, lower + np.eye(n)


def test_values_match_numpy_float64(seed):
    rng = np.random.default_rng(seed)
    given, exact = _system(rng, 2, 3)
    rhs = rng.standard_normal((2, 3, 64, 96))
    got = np.asarray(unit_lower_solve(jnp.asarray(given, jnp.float32), jnp.asarray(rhs, jnp.float32)))
    want = np.linalg.solve(exact, rhs)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-5 * scale, np.abs(got - want).max() / scale


def test_gradients_match_lax_triangular_solve(seed):
    rng = np.random.default_rng(seed)
    _, exact = _system(rng, 2, n=32)
    rhs = jnp.asarray(rng.standard_normal((2, 32, 16)), jnp.float32)
    weights = jnp.asarray(rng.standard_normal((2, 32, 16)), jnp.float32)
    system = jnp.asarray(exact, jnp.float32)

    def loss(solve, a, b):
        return jnp.sum(solve(a, b) * weights)

    lax_solve = jax.tree_util.Partial(jax.lax.linalg.triangular_solve, left_side=True, lower=True,
                                      unit_diagonal=True)
    got = jax.grad(lambda a, b: loss(unit_lower_solve, a, b), argnums=(0, 1))(system, rhs)
    want = jax.grad(lambda a, b: loss(lax_solve, a, b), argnums=(0, 1))(system, rhs)
    for g, w, name in zip(got, want, ("system", "rhs")):
        if name == "system":  # only the strictly lower triangle is an input of the solve
            g, w = jnp.tril(g, -1), jnp.tril(w, -1)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4 * float(jnp.abs(w).max()))


def test_gradient_inside_scan_runs_repeatedly(seed):
    rng = np.random.default_rng(seed)
    _, exact = _system(rng, 3, 2, 4)
    systems = jnp.asarray(exact, jnp.float32)  # [layers=3, 2, 4, 64, 64]
    rhs = jnp.asarray(rng.standard_normal((2, 4, 64, 32)), jnp.float32)

    def loss(systems, x):
        def layer(h, system):
            return jnp.tanh(unit_lower_solve(system, h)), None

        return jnp.sum(jax.lax.scan(layer, x, systems)[0] ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    first = step(systems, rhs)
    for _ in range(4):
        again = step(systems, rhs)
        np.testing.assert_array_equal(np.asarray(again[1]), np.asarray(first[1]))
    assert np.isfinite(np.asarray(first[1])).all() and float(jnp.abs(first[1]).max()) > 0
