"""Decode of a packed GGUF checkpoint through the Pallas decode kernels (interpreted, on any backend) against the
same file through the XLA path, which dequantizes with exact products: the IQ4_XS, Q4_K_M and Q6_K fixtures,
whose projections take the int8 GEMV (x in int8 levels, pallas_kernels/quant_gemv_int8.py), so the model-level
effect of quantizing x is measured on real llama.cpp-written weights, not only on random kernel inputs; and 12
sequences decoded together in bfloat16 (the fused kernel's tensor-core regime, a float32 x's two parts in one
launch) against the XLA path."""
from __future__ import annotations

import contextlib
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest

import luxjax
from luxjax.engine.generate import cache_length, prefill_prompt
from luxjax.ops import backend as ops_backend
from pallas_kernels import quant_gemv_int8

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "qwen35-tiny-a"
STEPS = 4
# Of the largest logit: float32 x takes three int8 levels (~2.4e-7 of each 32 values' largest). Measured on this
# machine's CPU over seeds 3-12 and 55 (session 26): max differences of 4.4e-6 to 1.3e-5 of the largest logit for
# Q4_K_M and 3.1e-6 to 9.3e-6 for IQ4_XS with the int8 GEMV, 1.8e-6 to 6.0e-6 for Q4_K_M with the float reduce
# (the other decode kernels' float32 differences); seed 55's Q4_K_M prompt reached 2.6e-5 (its fourth step
# amplifies every path's differences: the float reduce's too, 1.5x its others). A level of x dropped (two for
# float32 x) measured 4.9e-4 to 2.0e-3, 10-40x this bound; a value misplaced moves them by orders of magnitude more
DECODE_RTOL = 5e-5


def decode_logits(model: luxjax.Model, ids: list[int], follow: list[int], *, pallas_decode: bool, monkeypatch):
    """Logits of the prompt's last position (prefill by the XLA path) and of each decode step feeding `follow`;
    the decode steps traced with the Pallas kernels chosen (interpreted) or not."""
    backend = model.backend
    prompt = backend.prompt_from_ids(ids, None)
    caches = backend.init_cache(1, cache_length(len(ids), len(follow) + 1, backend.max_context))
    logits, caches = prefill_prompt(backend, caches, 0, prompt)
    out = [np.asarray(logits, np.float32).reshape(-1)]
    with kernels_chosen(monkeypatch, pallas_decode):
        for i, token in enumerate(follow):
            logits, caches = backend.decode(caches, np.array([token]), np.array([len(ids) + i]),
                                            np.array([prompt.rope_delta]))
            out.append(np.asarray(logits, np.float32).reshape(-1))
    return np.stack(out)


@contextlib.contextmanager
def kernels_chosen(monkeypatch, pallas: bool):
    """Inside: steps traced afresh with the Pallas kernels chosen (interpreted) or the XLA path. The kernel choice
    is made at trace time, so jit's caches are cleared on entry and on exit (no later test may reuse a step traced
    with the patched choice)."""
    jax.clear_caches()
    try:
        with monkeypatch.context() as patch:
            if pallas:
                patch.setattr(ops_backend, "use_pallas", lambda: True)
                patch.setattr(ops_backend, "interpret", lambda: True)
            yield
    finally:
        jax.clear_caches()


@pytest.mark.parametrize("quant", ["IQ4_XS", "Q4_K_M", "Q6_K"])
def test_packed_decode_through_the_int8_gemv_matches_xla(quant, monkeypatch, seed):
    rng = np.random.default_rng(seed)
    path = FIXTURES / f"tiny-qwen35-a-{quant}.gguf"
    model = luxjax.load(path, dtype="float32", progress=False)
    vocab = model.backend.vocab_size
    ids = rng.integers(0, min(vocab, 5000), int(rng.integers(5, 20))).tolist()
    follow = rng.integers(0, min(vocab, 5000), STEPS).tolist()
    calls = []
    for name in ("int8_quant_matmul", "int8_quant_matmul_many"):
        real = getattr(quant_gemv_int8, name)
        monkeypatch.setattr(quant_gemv_int8, name, lambda *a, real=real, **k: calls.append(a[1]) or real(*a, **k))
    want = decode_logits(model, ids, follow, pallas_decode=False, monkeypatch=monkeypatch)
    assert not calls, "the XLA path must not take the int8 GEMV"
    got = decode_logits(model, ids, follow, pallas_decode=True, monkeypatch=monkeypatch)
    taken = {w.ggml_type.name for ws in calls for w in (ws if isinstance(ws, tuple) else (ws,))}
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    head = "output.weight" if "output.weight" in types else "token_embd.weight"  # else tied to the embeddings
    packed = {kind for name, kind in types.items() if (name.startswith("blk.") or name == head)
              and kind in {f.name for f in quant_gemv_int8.FORMATS}}
    assert packed and taken == packed, \
        f"the decode steps took the int8 GEMV for {taken}, not for every packed format of {packed}"
    np.testing.assert_array_equal(got[0], want[0], err_msg="the prefills are the same path")
    diff, scale = np.abs(got[1:] - want[1:]).max(), np.abs(want[1:]).max()
    print(f"{quant} seed {seed}: int8-GEMV decode vs XLA, max |logit diff| {diff:.2e} of logits up to {scale:.1f}")
    assert diff <= DECODE_RTOL * scale, f"{quant} seed {seed}: decode logits differ by {diff:.2e}"
    top2 = np.sort(want[1:], axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * DECODE_RTOL * scale  # the greedy token is decided, not a near-tie
    assert (got[1:].argmax(-1) == want[1:].argmax(-1))[clear].all(), f"{quant} seed {seed}: greedy tokens differ"


# Sequences decoded together: 12 (12 rows of x at the skinny dot's 16, the DeltaNet's two float32 parts in one launch
# at its 32) and 24 (24 rows at its 32, where they went to the dequantize kernel and a GEMM before session 28)
SEQUENCES = (12, 24)
# Of the largest logit, both paths in bfloat16: each layer's activations are rounded to bf16 where the two paths add
# in different orders, so they part by bf16 roundings, not by float32 ones. Measured on this machine's CPU (session
# 27, seeds 3-7, 55 and two random): 6.5e-3 to 1.13e-2 for both files; with session 28's skinny tiles (K split
# further) 6.2e-3 to 1.36e-2 at 12 and 24 sequences (seeds 3-7, 55 and four random). Mutations of the two parts' sum
# (IQ4_XS, seed 7): the low part dropped 3.2e-2, the low parts' rows crossed between sequences 0.14, the high part
# twice or its rows crossed 1.4; at 24 sequences the kernel path's low part of q and k dropped 2.3e-2.
# The largest difference alone proved a poor judge: seed 838803248 (Q4_K_M, 24 sequences, session 35) parts by 2.2e-2
# in one of 48 rows, both paths there 6.2 (28%) from the float32 XLA logits, while the kernel path's low part dropped
# everywhere gave 2.0e-2 at seed 3. The RMS difference over all logits, of the logits' RMS, separates them (session
# 35): 5.5e-3 to 7.3e-3 unmutated (seeds 3, 5, 7, 55, 838803248, both files, 12 and 24 sequences), 1.5e-2 to 2.4e-2
# with the low part dropped (seeds 3 and 838803248 at 12 and 24); the largest difference keeps a looser bound for
# a fault in a few rows.
BATCH_BF16_RMS_RTOL = 1.1e-2
BATCH_BF16_RTOL = 5e-2


@pytest.mark.parametrize("sequences", SEQUENCES)
@pytest.mark.parametrize("quant", ["IQ4_XS", "Q4_K_M"])
def test_packed_decode_of_several_sequences_in_bfloat16_matches_xla(quant, sequences, monkeypatch, seed):
    """12 or 24 sequences decoded together in bfloat16 through the Pallas kernels (interpreted): the projections take
    the fused kernel's skinny dot (at 12, the DeltaNet's float32 inputs their two bf16 parts in one launch:
    ops.linear._parts_one_launch; at 24 no weight the skinny dot tiles is decoded to a bf16 matrix: only the
    fixtures' 4-row DeltaNet b and a are), against the same steps by the XLA path, each sequence's own prompt
    prefilled into its own slot."""
    from pallas_kernels import quant_dequantize, quant_matmul

    rng = np.random.default_rng(seed)
    model = luxjax.load(FIXTURES / f"tiny-qwen35-a-{quant}.gguf", dtype="bfloat16", progress=False)
    backend = model.backend
    vocab = min(backend.vocab_size, 5000)
    prompts = [rng.integers(0, vocab, int(rng.integers(3, 12))).tolist() for _ in range(sequences)]
    follow = rng.integers(0, vocab, (2, sequences))
    caches = backend.init_cache(sequences, cache_length(max(map(len, prompts)), len(follow) + 1, backend.max_context))
    deltas = []
    for slot, ids in enumerate(prompts):
        prompt = backend.prompt_from_ids(ids, None)
        _, caches = prefill_prompt(backend, caches, slot, prompt)
        deltas.append(prompt.rope_delta)
    launches = []
    real = quant_matmul.quant_matmul_many
    monkeypatch.setattr(quant_matmul, "quant_matmul_many", lambda x, *a, **k: launches.append(x.shape[0]) or real(
        x, *a, **k))

    def steps(pallas: bool) -> np.ndarray:
        out, state = [], jax.tree.map(lambda a: a.copy(), caches)  # decode donates its caches
        with kernels_chosen(monkeypatch, pallas):
            for i, tokens in enumerate(follow):
                cached = np.array([len(ids) + i for ids in prompts], np.int32)
                logits, state = backend.decode(state, tokens.astype(np.int32), cached, np.array(deltas, np.int32))
                out.append(np.asarray(logits, np.float32))
        return np.stack(out)

    want = steps(pallas=False)
    assert not launches, "the XLA path must not take the fused kernel"
    decoded = []
    real_decode = quant_dequantize.dequantize_in_kernel_order
    monkeypatch.setattr(quant_dequantize, "dequantize_in_kernel_order", lambda *a, **k: decoded.append(a[0]) or
                        real_decode(*a, **k))
    got = steps(pallas=True)
    if sequences <= quant_matmul.GEMV_MAX_ROWS:
        assert 2 * sequences in launches, f"no launch took both parts of the DeltaNet's x: launches of {launches} rows"
    else:
        tileable = [w.shape for w in decoded if quant_matmul.stacked_supported((sequences, w.shape[1]), w)]
        assert sequences in launches and not tileable, f"launches of {launches} rows; decoded, tileable: {tileable}"
    diff, scale = np.abs(got - want).max(), np.abs(want).max()
    rms = float(np.sqrt(np.mean(np.square(got - want, dtype=np.float64)) / np.mean(np.square(want, dtype=np.float64))))
    where = f"{quant} seed {seed}: {sequences} sequences, bf16 decode vs XLA"
    print(f"{where}: max |logit diff| {diff:.2e} of {scale:.1f}, RMS difference {rms:.2e} of the logits' RMS")
    assert rms <= BATCH_BF16_RMS_RTOL, f"{where}: RMS difference {rms:.2e} of the logits' RMS"
    assert diff <= BATCH_BF16_RTOL * scale, f"{where}: logits differ by {diff:.2e} of {scale:.1f}"
