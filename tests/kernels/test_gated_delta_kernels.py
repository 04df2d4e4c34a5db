"""Gated DeltaNet kernels vs the XLA recurrent and chunked forms: padded tokens (beta = g = 0), nonzero state, the
state entering a given chunk (the DeltaNet cache's boundary); the decode token-inputs kernel vs the layer's float64
definition in numpy."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import rel_err

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


def test_chunked_with_prepare_kernel(seed, interpret):
    """The chunked form with its per-chunk part in gated_delta_chunk_prepare (BlockSizes.prepare_in_kernel), key
    heads shared, against the recurrent form, with the boundary state."""
    rng = np.random.default_rng(seed)
    q, k, v, g, beta, state = _inputs(rng, 2, 4, 100, 64, 64, valid=[100, 91])
    block = jnp.asarray([1, 0], jnp.int32)
    bs = gd.BlockSizes(prepare_in_kernel=True)
    out, final, boundary = gd.gated_delta_chunked(q[:, :2], k[:, :2], v, g, beta, state, boundary_block=block,
                                                  head_order="tiled", block_sizes=bs, interpret=interpret)
    q, k = (jnp.tile(x[:, :2], (1, 2, 1, 1)) for x in (q, k))  # value head h reads key head h % 2
    ref_out, ref_state = gd.gated_delta_reference(q, k, v, g, beta, state)
    _, ref_boundary = gd.gated_delta_reference(q[:1, :, :64], k[:1, :, :64], v[:1, :, :64], g[:1, :, :64],
                                               beta[:1, :, :64], state[:1])
    for name, x, r in [("out", out, ref_out), ("state", final, ref_state), ("boundary", boundary[:1], ref_boundary),
                       ("initial boundary", boundary[1:], state[1:])]:
        err = rel_err(x, r)
        assert err < 5e-5, f"chunked with the prepare kernel, {name}: rel err {err:.2e}, seed {seed}"


@pytest.mark.parametrize("dk,dv,T,blocks", [(64, 64, 131, (0, 3)), (64, 128, 17, (1, 0)), (128, 64, 192, (2, 1)),
                                             (64, 64, 75, (1, 1))])
def test_chunked_boundary(seed, interpret, dk, dv, T, blocks):
    """The state entering chunk blocks[b] of sequence b (0: the initial state; the number of chunks: the final
    one), from the kernel and from the XLA chunked form, is the recurrent form's state after 64 * blocks[b] tokens."""
    rng = np.random.default_rng(seed)
    args = _inputs(rng, 2, 2, T, dk, dv, valid=[T, T - 5])
    block = jnp.asarray(blocks, jnp.int32)
    out, state, boundary = gd.gated_delta_chunked(*args, boundary_block=block, interpret=interpret)
    ref_out, ref_state, ref_boundary = chunk_gated_delta_rule(*args, boundary_block=block)
    where = f"{dk=} {dv=} {T=} {blocks=}, seed {seed}"
    for name, x, r in [("out", out, ref_out), ("state", state, ref_state), ("boundary", boundary, ref_boundary)]:
        err = rel_err(x, r)
        assert err < 5e-5, f"chunked {name} vs XLA chunked, {where}: rel err {err:.2e}"
    for b, c in enumerate(blocks):
        prefix = [x[b : b + 1, :, : 64 * c] for x in args[:5]]
        _, truth = gd.gated_delta_reference(*prefix, args[5][b : b + 1])
        for form, x in [("kernel", boundary), ("XLA chunked", ref_boundary)]:
            err = rel_err(x[b : b + 1], truth)
            assert err < 5e-5, f"{form} boundary of sequence {b} vs recurrent over {64 * c} tokens, {where}: {err:.2e}"


def _value_head_key(order: str, k_heads: int, v_heads: int) -> np.ndarray:
    """Which key head each value head reads: h // r in transformers' order, h % k_heads in llama.cpp's GGUF order."""
    h = np.arange(v_heads)
    return h // (v_heads // k_heads) if order == "grouped" else h % k_heads


@pytest.mark.parametrize("order", ["grouped", "tiled"])
@pytest.mark.parametrize("form", ["recurrent", "chunked XLA", "chunked kernel"])
def test_shared_key_heads(seed, interpret, monkeypatch, order, form):
    """q and k with 2 key heads shared by 6 value heads, through the op (and the kernel), against the recurrent
    form on q and k given to every value head by index (the shared heads taken once per key head in the chunked
    forms' k k^T and q k^T)."""
    from luxjax.ops import backend, delta_rule

    rng = np.random.default_rng(seed)
    T = 1 if form == "recurrent" else 100
    q, k, v, g, beta, state = _inputs(rng, 2, 6, T, 64, 32, valid=[T, max(T - 9, 1)])
    key = _value_head_key(order, 2, 6)
    shared_q, shared_k = (jnp.asarray(np.asarray(x)[:, :2]) for x in (q, k))  # the heads the test keeps
    q, k = (jnp.asarray(np.asarray(x)[:, key]) for x in (shared_q, shared_k))  # each value head's key head
    ref_out, ref_state = gd.gated_delta_reference(q, k, v, g, beta, state)
    monkeypatch.setattr(backend, "use_pallas", lambda: form == "chunked kernel")
    monkeypatch.setattr(backend, "interpret", lambda: interpret)
    out, new_state = delta_rule.gated_delta_rule(shared_q, shared_k, v, g, beta, state, chunked=form != "recurrent",
                                                 head_order=order)
    for name, x, r in [("out", out, ref_out), ("state", new_state, ref_state)]:
        err = rel_err(x, r)
        assert err < 5e-5, f"{form}, {order} key heads, {name}: rel err {err:.2e}, seed {seed}"


def test_ops_dispatch_chunked(seed, monkeypatch):
    """gated_delta_rule(chunked=True) with the Pallas branch forced on matches the XLA chunked form."""
    from luxjax.ops import backend, delta_rule

    monkeypatch.setattr(backend, "use_pallas", lambda: True)
    args = _inputs(np.random.default_rng(seed), 1, 2, 70, 64, 64, valid=[65])
    block = jnp.asarray([1], jnp.int32)
    out, state, boundary = delta_rule.gated_delta_rule(*args, chunked=True, boundary_block=block)
    ref_out, ref_state, ref_boundary = chunk_gated_delta_rule(*args, boundary_block=block)
    err = max(rel_err(out, ref_out), rel_err(state, ref_state), rel_err(boundary, ref_boundary))
    assert err < 5e-5, f"dispatch chunked: rel err {err:.2e}, seed {seed}"


def test_compensated_cumsum_is_correctly_rounded(seed):
    """The decays' running sums of the chunked form: within half a float32 unit of the exact (float64) sums of the
    float32 inputs, where a plain float32 running sum drifts by several units."""
    from luxjax.ops.delta_rule import compensated_cumsum

    rng = np.random.default_rng(seed)
    g = (-np.log1p(np.exp(rng.standard_normal((3, 5, 4, 64)))) * np.exp(rng.standard_normal((1, 5, 1, 1)))
         ).astype(np.float32)
    exact = np.cumsum(g.astype(np.float64), axis=-1)
    got = np.asarray(jax.jit(compensated_cumsum)(jnp.asarray(g)), np.float64)
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(got - exact) <= 0.5 * ulp), f"seed {seed}: {np.max(np.abs(got - exact) / ulp):.2f} ulp"


@pytest.mark.parametrize("order", ["grouped", "tiled"])
@pytest.mark.parametrize("dk,dv,T", [(64, 32, 100), (32, 64, 64), (128, 128, 17)])
def test_chunk_prepare_matches_chunk_inputs(seed, interpret, order, dk, dv, T):
    """The per-chunk kernel returns what the XLA chunk_inputs returns, for 2 key heads shared by 6 value heads."""
    from luxjax.ops.delta_rule import chunk_inputs

    rng = np.random.default_rng(seed)
    q, k, v, g, beta, _ = _inputs(rng, 2, 6, T, dk, dv, valid=[T, max(T - 9, 1)])
    q, k = q[:, :2], k[:, :2]
    got = gd.gated_delta_chunk_prepare(q, k, v, g, beta, head_order=order, interpret=interpret)
    ref = chunk_inputs(q, k, v, g, beta, 64, order)
    names = ("new_values", "k_cumdecay", "q_decayed", "k_decayed", "intra", "chunk_decay")
    for name, x, r in zip(names, got, ref, strict=True):
        assert x.shape == r.shape, f"{name}: shape {x.shape} vs {r.shape}"
        err = rel_err(x, r)
        assert err < 1e-5, f"prepare {name}, {order}, {dk=} {dv=} {T=}: rel err {err:.2e}, seed {seed}"


def _ut_solution_float64(k, v, g, beta, chunk=64):
    """new_values and k_cumdecay of chunk_inputs by float64 numpy: cumulative decays, the UT system and a linear
    solve (no inverse, no block doubling), from the float32 inputs."""
    k, v, g, beta = (np.asarray(x, np.float64) for x in (k, v, g, beta))
    B, H, T, _ = v.shape
    n = T // chunk
    k, v = (x.reshape(B, H, n, chunk, -1) for x in (k, v))
    g, beta = (x.reshape(B, H, n, chunk) for x in (g, beta))
    cum = np.cumsum(g, axis=-1)
    decay = np.exp(np.tril(cum[..., :, None] - cum[..., None, :]))
    system = np.eye(chunk) + np.tril(beta[..., :, None] * (k @ np.swapaxes(k, -1, -2)) * decay, -1)
    rhs = np.concatenate([v * beta[..., None], k * (beta * np.exp(cum))[..., None]], axis=-1)
    solved = np.linalg.solve(system, rhs)
    return solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]


def test_chunk_prepare_ill_conditioned_inverse(seed, interpret):
    """Keys nearly parallel, beta near 1 and almost no decay: the UT system's inverse has entries far from 1, the
    case where a power series would blow up. The kernel's solution is within a small multiple of the XLA block
    recursion's error from a float64 solve."""
    from luxjax.ops.delta_rule import chunk_inputs

    rng = np.random.default_rng(seed)
    B, H, T, dk, dv = 1, 2, 128, 64, 64
    base = rng.standard_normal((B, H, 1, dk))
    k = base + 0.05 * rng.standard_normal((B, H, T, dk))
    k = jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), jnp.float32)
    q = k * dk**-0.5
    v = jnp.asarray(rng.standard_normal((B, H, T, dv)), jnp.float32)
    g = jnp.asarray(-1e-3 * rng.random((B, H, T)), jnp.float32)
    beta = jnp.asarray(0.95 + 0.05 * rng.random((B, H, T)), jnp.float32)
    truth = _ut_solution_float64(k, v, g, beta)
    got = gd.gated_delta_chunk_prepare(q, k, v, g, beta, interpret=interpret)[:2]
    xla = chunk_inputs(q, k, v, g, beta)[:2]
    for name, x, r, t in zip(("new_values", "k_cumdecay"), got, xla, truth):
        err, xla_err = rel_err(x, t), rel_err(r, t)
        assert err < max(4 * xla_err, 1e-5), f"{name}: kernel {err:.2e} vs XLA {xla_err:.2e} from float64, seed {seed}"


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_tf32x3_only_where_triton_takes_it(monkeypatch, platform):
    """Compiled float32 dots are TF32x3 on CUDA only (Triton's AMD backend takes "ieee" float32 dots alone); an
    "ieee" request and interpreted kernels always get full float32 products."""
    monkeypatch.setattr(gd.backend, "gpu_platform", lambda: platform)
    highest = jax.lax.Precision.HIGHEST
    expected = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3 if platform == "cuda" else highest
    assert gd._precision(gd.BlockSizes(), interpret=False) == expected
    assert gd._precision(gd.BlockSizes(dot_precision="ieee"), interpret=False) == highest
    assert gd._precision(gd.BlockSizes(), interpret=True) == highest


@pytest.mark.parametrize("order", ["grouped", "tiled"])
@pytest.mark.parametrize("dk,dv", [(64, 32), (128, 128)])
def test_decode_step_on_stacked_states(seed, interpret, order, dk, dv):
    """The in-place decode step on states stacked over layers (value-major, as the DeltaNet cache keeps them)
    against the recurrent reference on that layer: out and the new state; the boundary moves to the new state for
    the picked sequence only; the other layers, and the idle sequence's (beta = g = 0) state, stay as they were."""
    from luxjax.ops.delta_rule import expand_key_heads

    rng = np.random.default_rng(seed)
    L, B, Hk, H = 3, 2, 2, 6
    q, k, v, g, beta, _ = _inputs(rng, B, Hk, 1, dk, dv, valid=[1, 1])
    _, _, v, g, beta, _ = _inputs(rng, B, H, 1, dk, dv, valid=[1, 0])  # sequence 1 idle: beta = g = 0
    states = jnp.asarray(rng.standard_normal((L, B, H, dv, dk)), jnp.float32) * 0.5
    boundaries = jnp.asarray(rng.standard_normal((L, B, H, dv, dk)), jnp.float32)
    layer, pick = int(rng.integers(0, L)), jnp.asarray([True, False])
    tokens = jnp.concatenate([x[:, :, 0].reshape(B, -1) for x in (q, k, v, g, beta)], axis=-1)  # as cached
    out, new_states, new_boundaries = gd.gated_delta_decode_step(
        tokens, states, boundaries, jnp.int32(layer), pick, k_heads=Hk, head_order=order, interpret=interpret)
    qe, ke = (expand_key_heads(x, H, order) for x in (q, k))
    ref_out, ref_state = gd.gated_delta_reference(qe, ke, v, g, beta, jnp.swapaxes(states[layer], -1, -2))
    ref_state = jnp.swapaxes(ref_state, -1, -2)
    where = f"{order} dk={dk} dv={dv} layer {layer}, seed {seed}"
    for name, x, r in [("out", out, ref_out[:, :, 0]), ("state", new_states[layer], ref_state)]:
        err = rel_err(x, r)
        assert err < 1e-5, f"{where}: {name} rel err {err:.2e}"
    np.testing.assert_array_equal(np.asarray(new_states[layer, 1]), np.asarray(states[layer, 1]),
                                  err_msg=f"{where}: the idle sequence's state changed")
    np.testing.assert_array_equal(np.asarray(new_boundaries[layer, 0]), np.asarray(new_states[layer, 0]),
                                  err_msg=f"{where}: the picked sequence's boundary is not its new state")
    np.testing.assert_array_equal(np.asarray(new_boundaries[layer, 1]), np.asarray(boundaries[layer, 1]),
                                  err_msg=f"{where}: the unpicked sequence's boundary changed")
    others = np.asarray([i for i in range(L) if i != layer])
    for name, new, old in [("state", new_states, states), ("boundary", new_boundaries, boundaries)]:
        np.testing.assert_array_equal(np.asarray(new[others]), np.asarray(old[others]),
                                      err_msg=f"{where}: another layer's {name} changed")



def _decode_inputs_oracle(qkv, b, a, conv_w, a_log, dt_bias, window, active, k_heads: int, d: int, eps=1e-6):
    """float64 numpy, from the Gated DeltaNet definition: the causal conv over [window; token], SiLU, q and k
    L2-normalised per head (q scaled by d^-0.5), beta = sigmoid(b), g = -exp(a_log) * softplus(a + dt_bias); idle
    sequences get k = v = g = beta = 0. Returns the packed rows [q, k, v, g, beta] [B, width]."""
    f = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
    taps = np.concatenate([f(window), f(qkv)[:, None]], axis=1)  # [B, taps, C]
    conv = np.einsum("btc,ct->bc", taps, f(conv_w))
    x = conv / (1 + np.exp(-conv))
    B = x.shape[0]

    def unit(y):
        heads = y.reshape(B, -1, d)
        return (heads / np.sqrt((heads**2).sum(-1, keepdims=True) + eps)).reshape(B, -1)

    q, k, v = np.split(x, [k_heads * d, 2 * k_heads * d], axis=1)
    beta = 1 / (1 + np.exp(-f(b)))
    g = -np.exp(f(a_log)) * np.logaddexp(f(a) + f(dt_bias), 0.0)
    on = np.asarray(active, bool)[:, None]
    return np.concatenate([unit(q) * d**-0.5, np.where(on, unit(k), 0), np.where(on, v, 0), np.where(on, g, 0),
                           np.where(on, beta, 0)], axis=1)


@pytest.mark.parametrize("k_heads,heads,d,taps", [(2, 6, 16, 4), (1, 3, 32, 3)])
def test_decode_inputs_kernel(seed, interpret, k_heads, heads, d, taps):
    """gated_delta_decode_inputs against the float64 definition: the packed token row; for the active sequences the
    conv window shifted by the token and the pending row written at its row (63 included), in the given layer of
    the stacks only; the idle sequence's window and rows untouched; parameters read at their own stack layer."""
    from luxjax.ops.delta_rule import token_offsets

    rng = np.random.default_rng(seed)
    B, L, Lp, block = 3, 3, 3, 64
    C = (2 * k_heads + heads) * d
    width = token_offsets(k_heads, d, heads, d)["width"]
    normal = lambda *shape, s=1.0: jnp.asarray(rng.standard_normal(shape) * s, jnp.float32)  # noqa: E731
    qkv, b, a = normal(B, C), normal(B, heads, s=2.0), normal(B, heads, s=2.0)
    conv_w = normal(Lp, C, taps, s=0.5).astype(jnp.bfloat16)
    a_log, dt_bias = normal(Lp, heads), normal(Lp, heads).astype(jnp.bfloat16)
    conv, pending = normal(L, B, taps - 1, C), normal(L, B, block, width)
    layer, param_layer = int(rng.integers(0, L - 1)), Lp - 1  # apart from each other and from 0
    active, row = jnp.asarray([True, False, True]), jnp.asarray([block - 1, 5, int(rng.integers(0, block - 1))])
    tokens, new_conv, new_pending = gd.gated_delta_decode_inputs(
        qkv, b, a, conv_w, a_log, dt_bias, jnp.int32(param_layer), conv, pending, jnp.int32(layer), active, row,
        k_heads=k_heads, interpret=interpret)
    want = _decode_inputs_oracle(qkv, b, a, conv_w[param_layer], a_log[param_layer], dt_bias[param_layer],
                                 conv[layer], active, k_heads, d)
    where = f"{k_heads=} {heads=} {d=} {taps=} layer {layer} params {param_layer}, seed {seed}"
    np.testing.assert_allclose(np.asarray(tokens), want, rtol=2e-5, atol=2e-6, err_msg=f"{where}: tokens")
    new_conv, new_pending, conv, pending = (np.asarray(x) for x in (new_conv, new_pending, conv, pending))
    window = np.concatenate([conv[layer], np.asarray(qkv)[:, None]], axis=1)[:, 1:]
    for s in range(B):
        if active[s]:
            np.testing.assert_array_equal(new_conv[layer, s], window[s], err_msg=f"{where}: sequence {s}'s window")
            np.testing.assert_array_equal(new_pending[layer, s, int(row[s])], np.asarray(tokens)[s],
                                          err_msg=f"{where}: sequence {s}'s pending row")
            others = np.arange(block) != int(row[s])
            np.testing.assert_array_equal(new_pending[layer, s, others], pending[layer, s, others],
                                          err_msg=f"{where}: sequence {s}'s other pending rows")
        else:
            np.testing.assert_array_equal(new_conv[layer, s], conv[layer, s], err_msg=f"{where}: idle window")
            np.testing.assert_array_equal(new_pending[layer, s], pending[layer, s], err_msg=f"{where}: idle rows")
    others = np.asarray([i for i in range(L) if i != layer])
    np.testing.assert_array_equal(new_conv[others], conv[others], err_msg=f"{where}: another layer's window")
    np.testing.assert_array_equal(new_pending[others], pending[others], err_msg=f"{where}: another layer's rows")
