"""Gated DeltaNet kernels vs the XLA recurrent and chunked forms: padded tokens (beta = g = 0), nonzero state."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err

from luxjax.ops.delta_rule import chunk_gated_delta_rule
from pallas_kernels import gated_delta as gd


def _inputs(rng, B, H, T, dk, dv, valid):
    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    def unit(x):
        return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

    q = unit(normal(B, H, T, dk)) * dk**-0.5
    k = unit(normal(B, H, T, dk))
    v = normal(B, H, T, dv)
    g = -jax.nn.softplus(normal(B, H, T)) * 0.5
    beta = jax.nn.sigmoid(normal(B, H, T))
    mask = jnp.arange(T)[None, None, :] < jnp.asarray(valid)[:, None, None]  # padded tail per sequence
    g, beta = jnp.where(mask, g, 0.0), jnp.where(mask, beta, 0.0)
    k, v = jnp.where(mask[..., None], k, 0.0), jnp.where(mask[..., None], v, 0.0)
    state = normal(B, H, dk, dv) * 0.5
    return q, k, v, g, beta, state


@pytest.mark.parametrize("dk,dv,T", [(64, 64, 1), (64, 64, 7), (128, 128, 3)])
def test_recurrent(seed, interpret, dk, dv, T):
    rng = np.random.default_rng(seed)
    args = _inputs(rng, 2, 3, T, dk, dv, valid=[T, max(T - 2, 0)])
    out, state = gd.gated_delta_recurrent(*args, interpret=interpret)
    ref_out, ref_state = gd.gated_delta_reference(*args)
    for name, x, r in [("out", out, ref_out), ("state", state, ref_state)]:
        err = rel_err(x, r)
        assert err < 2e-5, f"recurrent {name} {dk=} {dv=} {T=}: rel err {err:.2e}, seed {seed}"


@pytest.mark.parametrize("dk,dv,T", [(64, 64, 131), (128, 128, 64), (64, 128, 17)])
def test_chunked(seed, interpret, dk, dv, T):
    rng = np.random.default_rng(seed)
    args = _inputs(rng, 2, 2, T, dk, dv, valid=[T, T - 10 if T > 10 else T])
    out, state = gd.gated_delta_chunked(*args, interpret=interpret)
    for form, (ref_out, ref_state) in [("recurrent", gd.gated_delta_reference(*args)),
                                       ("chunked", chunk_gated_delta_rule(*args))]:
        for name, x, r in [("out", out, ref_out), ("state", state, ref_state)]:
            err = rel_err(x, r)
            assert err < 5e-5, f"chunked {name} vs XLA {form} {dk=} {dv=} {T=}: rel err {err:.2e}, seed {seed}"


def test_ops_dispatch_chunked(seed, monkeypatch):
    """gated_delta_rule(chunked=True) with the Pallas branch forced on matches the XLA chunked form."""
    from luxjax.ops import backend, delta_rule

    monkeypatch.setattr(backend, "use_pallas", lambda: True)
    args = _inputs(np.random.default_rng(seed), 1, 2, 70, 64, 64, valid=[65])
    out, state = delta_rule.gated_delta_rule(*args, chunked=True)
    ref_out, ref_state = chunk_gated_delta_rule(*args)
    err = max(rel_err(out, ref_out), rel_err(state, ref_state))
    assert err < 5e-5, f"dispatch chunked: rel err {err:.2e}, seed {seed}"
