"""The unitriangular inverse of the chunked delta rule (block doubling in matmuls) against numpy's float64 inverse,
on random systems and on systems built as chunk_inputs builds them; chunk_inputs' solved values against float64;
the diagonal and strictly-upper part of the input must not be read; its gradient against the float64 analytic one;
repeated runs of its gradient inside a scan (the pattern that stalled XLA:CPU with lax's triangular solve)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from luxjax.ops.delta_rule import chunk_inputs, unit_lower_inverse

SIZES = (1, 2, 3, 16, 48, 64)
# Error bounds, as max |x - float64 x| / max |float64 x|. Systems built like the delta rule's (condition numbers below
# 40): at most 2.0e-7 measured (1,200 seeds), 1.7e-7 for chunk_inputs' solved values and 4.3e-7 for the gradient
# (200 seeds). The random systems are far worse conditioned (up to 3e4): at most 1.3e-6 measured at n = 64 (forward
# substitution and lax's triangular solve: 8.1e-7 on the same systems). Each bound leaves a margin of 5x or more.
BOUND = 1e-6
RANDOM_BOUND = 1e-5
GRADIENT_BOUND = 3e-6


def _noisy(rng, lower):
    """`lower` (strictly lower) with a diagonal and upper triangle full of noise that the inverse must not read."""
    n = lower.shape[-1]
    return lower + np.triu(rng.standard_normal(lower.shape) * 5), lower + np.eye(n)


def _random_lower(rng, *batch, n):
    """Strictly lower entries like the UT transform's (k_beta k^T: |.| < 1), each matrix scaled by a random factor."""
    return np.tril(rng.uniform(-0.9, 0.9, (*batch, n, n)) * rng.uniform(0, 1, (*batch, 1, 1)), -1)


def _delta_rule_lower(rng, *batch, n, dk, slow_decay, shared_direction):
    """strictly_lower((beta k) k^T * exp(cum g_i - cum g_j)) in float64 as chunk_inputs builds it: k rows of unit
    length, beta in (0, 1), g < 0. slow_decay: g near 0 (the coupling spans the chunk); shared_direction: keys near
    one common direction (nearly collinear, the worse-conditioned case)."""
    k = rng.standard_normal((*batch, n, dk))
    if shared_direction:
        k = rng.standard_normal((*batch, 1, dk)) + 0.3 * k
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = 1 / (1 + np.exp(-rng.standard_normal((*batch, n))))
    g = -np.logaddexp(0, rng.standard_normal((*batch, n))) * (0.01 if slow_decay else 0.5)
    cum = np.cumsum(g, axis=-1)
    decay = np.exp(np.tril(cum[..., :, None] - cum[..., None, :]))  # the upper triangle is dropped below
    return np.tril((k * beta[..., None]) @ np.swapaxes(k, -1, -2) * decay, -1)


def _check(given, exact, bound, seed, what):
    got = np.asarray(unit_lower_inverse(jnp.asarray(given, jnp.float32)), np.float64)
    want = np.linalg.inv(exact)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= bound, f"{what}: error {err:.2e} relative to the float64 inverse, seed {seed}"


@pytest.mark.parametrize("n", SIZES)
def test_random_systems_match_numpy_float64(seed, n):
    rng = np.random.default_rng(seed)
    given, exact = _noisy(rng, _random_lower(rng, 2, 3, n=n))
    _check(given, exact, RANDOM_BOUND, seed, f"random system {n=}")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dk,slow_decay,shared_direction", [(128, False, False), (128, True, True), (16, True, False)])
def test_delta_rule_systems_match_numpy_float64(seed, n, dk, slow_decay, shared_direction):
    rng = np.random.default_rng(seed)
    given, exact = _noisy(rng, _delta_rule_lower(rng, 2, 3, n=n, dk=dk, slow_decay=slow_decay,
                                                 shared_direction=shared_direction))
    _check(given, exact, BOUND, seed, f"delta-rule system {n=} {dk=} {slow_decay=} {shared_direction=}")


def test_diagonal_and_upper_part_are_not_read(seed):
    """Noise, inf and nan above and on the diagonal change nothing; the result is unit lower-triangular."""
    rng = np.random.default_rng(seed)
    lower = jnp.asarray(_random_lower(rng, 2, 3, n=48), jnp.float32)
    clean = np.asarray(unit_lower_inverse(lower))
    upper = np.triu(rng.standard_normal((2, 3, 48, 48)) * 100)
    upper[0, 0, 5, 5], upper[0, 1, 3, 40], upper[1, 2, 47, 47] = np.inf, np.nan, -np.inf
    noisy = np.asarray(unit_lower_inverse(lower + jnp.asarray(upper, jnp.float32)))
    np.testing.assert_array_equal(noisy, clean)
    np.testing.assert_array_equal(np.triu(clean, 1), 0.0)
    np.testing.assert_array_equal(np.diagonal(clean, axis1=-2, axis2=-1), 1.0)


def test_chunk_inputs_solves_against_numpy_float64(seed):
    """chunk_inputs' new_values and k_cumdecay (the inverse applied to v_beta and decayed k_beta) against float64,
    over two chunks with a padded tail."""
    rng = np.random.default_rng(seed)
    B, H, T, dk, dv, C = 1, 2, 100, 32, 16, 64
    k = rng.standard_normal((B, H, T, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q = k[:, :, ::-1] * dk**-0.5
    v = rng.standard_normal((B, H, T, dv))
    g = -np.logaddexp(0, rng.standard_normal((B, H, T))) * 0.1
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, H, T))))
    new_values, k_cumdecay = (np.asarray(x) for x in chunk_inputs(
        *(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)), chunk=C)[:2])

    pad = (-T) % C
    k, v, g, beta = (np.pad(x, [(0, 0)] * 2 + [(0, pad)] + [(0, 0)] * (x.ndim - 3)) for x in (k, v, g, beta))
    k, v = (x.reshape(B, H, -1, C, x.shape[-1]) for x in (k, v))
    g, beta = (x.reshape(B, H, -1, C) for x in (g, beta))
    cum = np.cumsum(g, axis=-1)
    decay = np.exp(np.tril(cum[..., :, None] - cum[..., None, :]))
    system = np.tril((k * beta[..., None]) @ np.swapaxes(k, -1, -2) * decay, -1)
    inverse = np.linalg.inv(system + np.eye(C))
    errors = {name: np.abs(got - want).max() / np.abs(want).max() for name, got, want in [
        ("new_values", new_values, inverse @ (v * beta[..., None])),
        ("k_cumdecay", k_cumdecay, inverse @ (k * (beta * np.exp(cum))[..., None]))]}
    err = max(errors.values())
    assert err <= BOUND, f"chunk_inputs: error {err:.2e} relative to float64 ({errors}), seed {seed}"


@pytest.mark.parametrize("n", [3, 64])
def test_gradient_matches_float64(seed, n):
    """d/dA sum(W * inv(A)) = -inv(A)^T W inv(A)^T, restricted to the strictly lower part (the only input read)."""
    rng = np.random.default_rng(seed)
    lower = _delta_rule_lower(rng, 2, n=n, dk=128, slow_decay=True, shared_direction=True)
    weights = rng.standard_normal((2, n, n))
    got = jax.grad(lambda a: jnp.sum(unit_lower_inverse(a) * jnp.asarray(weights, jnp.float32)))(
        jnp.asarray(lower, jnp.float32))
    inverse_t = np.swapaxes(np.linalg.inv(lower + np.eye(n)), -1, -2)
    want = np.tril(-inverse_t @ weights @ inverse_t, -1)
    err = np.abs(np.asarray(got) - want).max() / np.abs(want).max()
    assert err <= GRADIENT_BOUND, f"gradient {n=}: error {err:.2e} relative to float64, seed {seed}"
    np.testing.assert_array_equal(np.triu(np.asarray(got)), 0.0)


def test_gradient_inside_scan_runs_repeatedly(seed):
    rng = np.random.default_rng(seed)
    systems = jnp.asarray(_random_lower(rng, 3, 2, 4, n=64), jnp.float32)  # [layers=3, 2, 4, 64, 64]
    rhs = jnp.asarray(rng.standard_normal((2, 4, 64, 32)), jnp.float32)

    def loss(systems, x):
        def layer(h, system):
            return jnp.tanh(jnp.matmul(unit_lower_inverse(system), h, precision=jax.lax.Precision.HIGHEST)), None

        return jnp.sum(jax.lax.scan(layer, x, systems)[0] ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    first = step(systems, rhs)
    for _ in range(4):
        again = step(systems, rhs)
        np.testing.assert_array_equal(np.asarray(again[1]), np.asarray(first[1]))
    assert np.isfinite(np.asarray(first[1])).all() and float(jnp.abs(first[1]).max()) > 0
