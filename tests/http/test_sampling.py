"""The device sampler against independent numpy implementations of the OpenAI / transformers definitions, and the
stop-string holdback against a character-at-a-time reference."""
from __future__ import annotations

import numpy as np
import pytest

from luxjax.engine.requests import SamplingParams
from luxjax.engine.sampling import RowParams, StopStringFilter, apply_penalties, filter_logits, sample_tokens

V = 64


def rows(params: list[SamplingParams], seeds=None, steps=None) -> RowParams:
    seeds = seeds or [0] * len(params)
    steps = steps or [0] * len(params)
    return RowParams.build(list(zip(params, seeds, steps)))


def sample(logits, params, counts=None, **kw):
    counts = np.zeros(logits.shape, np.int32) if counts is None else counts
    return [np.asarray(x) for x in sample_tokens(logits, counts, rows(params, **kw))]


def softmax(x):
    e = np.exp(x - x[np.isfinite(x)].max())
    e[~np.isfinite(x)] = 0
    return e / e.sum()


def reference_keep(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """transformers' TopK -> TopP -> MinP warpers, written from their definitions, in float64."""
    x = logits.astype(np.float64).copy()
    if top_k > 0:
        x[x < np.sort(x)[-top_k]] = -np.inf
    if top_p < 1:
        order = np.argsort(x)  # ascending
        cumulative = np.cumsum(softmax(x)[order])
        remove = cumulative <= 1 - top_p
        remove[-1] = False  # the most likely token stays
        x[order[remove]] = -np.inf
    if min_p > 0:
        p = softmax(x)
        x[p < min_p * p.max()] = -np.inf
    return np.isfinite(x)


def test_top_k_one_is_greedy():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(8, V)).astype(np.float32) * 3
    greedy, *_ = sample(logits, [SamplingParams()] * 8)
    drawn, *_ = sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 8, seeds=list(range(8)))
    assert (greedy == logits.argmax(-1)).all()
    assert (drawn == greedy).all()


def test_greedy_row_does_not_depend_on_its_neighbours():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(4, V)).astype(np.float32)
    alone, *_ = sample(logits[:1].repeat(4, 0), [SamplingParams()] * 4)
    mixed, *_ = sample(logits, [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.5),
                                SamplingParams(temperature=0.7, top_k=3), SamplingParams(min_p=0.2)])
    assert mixed[0] == alone[0] == logits[0].argmax()


def test_a_tempered_row_draws_alike_whether_or_not_a_neighbour_narrows():
    """The vocabulary's sort runs only for batches where some sampled row narrows (top-k, top-p, min-p); a row
    that does not narrow must draw the same token either way, and a greedy row beside a sampled one the argmax."""
    entropy = np.random.SeedSequence().entropy
    rng = np.random.default_rng(entropy)
    logits = (rng.normal(size=(2, V)) * rng.uniform(0.5, 3)).astype(np.float32)
    seeds = [int(s) for s in rng.integers(0, 2**31, size=2)]
    plain = SamplingParams(temperature=float(rng.uniform(0.3, 2.0)))
    narrowing = SamplingParams(temperature=1.0, top_p=float(rng.uniform(0.1, 0.9)), top_k=int(rng.integers(1, 10)))
    for step in range(16):
        alone, *_ = sample(logits, [plain, SamplingParams()], seeds=seeds, steps=[step, 0])
        beside, *_ = sample(logits, [plain, narrowing], seeds=seeds, steps=[step, 0])
        assert alone[0] == beside[0], (entropy, step)
        assert alone[1] == logits[1].argmax(), entropy


def test_seeded_sampling_is_deterministic_and_seed_dependent():
    rng = np.random.default_rng(3)
    logits = np.repeat(rng.normal(size=(1, V)).astype(np.float32), 8, 0)
    params = [SamplingParams(temperature=1.0)] * 8
    first, *_ = sample(logits, params, seeds=[7] * 8, steps=list(range(8)))
    again, *_ = sample(logits, params, seeds=[7] * 8, steps=list(range(8)))
    other, *_ = sample(logits, params, seeds=[8] * 8, steps=list(range(8)))
    assert (first == again).all()
    assert (first != other).any() and len(set(first.tolist())) > 1


@pytest.mark.parametrize("trial", range(40))
def test_filters_keep_exactly_the_reference_tokens(trial):
    rng = np.random.default_rng(100 + trial)
    logits = (rng.normal(size=V) * rng.uniform(0.5, 4)).astype(np.float32)
    top_k = int(rng.choice([0, 1, 5, 20, V]))
    top_p = float(rng.choice([1.0, rng.uniform(0.05, 0.99)]))
    min_p = float(rng.choice([0.0, rng.uniform(0.01, 0.5)]))
    masses = np.cumsum(np.sort(softmax(logits.astype(np.float64)))[::-1])
    if np.min(np.abs(masses - top_p)) < 1e-4:
        top_p = 1.0  # too close to a boundary for float32 to decide like float64
    got = np.isfinite(np.asarray(filter_logits(logits[None], np.array([top_k]), np.array([top_p], np.float32),
                                               np.array([min_p], np.float32))))[0]
    assert (got == reference_keep(logits, top_k, top_p, min_p)).all(), (top_k, top_p, min_p)


def test_sampled_tokens_stay_inside_the_filtered_set():
    rng = np.random.default_rng(4)
    logits = np.repeat((rng.normal(size=(1, V)) * 2).astype(np.float32), 16, 0)
    allowed = reference_keep(logits[0], 0, 0.6, 0.0)
    drawn, *_ = sample(logits, [SamplingParams(temperature=2.0, top_p=0.6)] * 16, seeds=list(range(16)))
    assert allowed[drawn].all()


def test_penalties_follow_the_openai_definition():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(2, V)).astype(np.float32)
    counts = rng.integers(0, 3, size=(2, V)).astype(np.int32)
    presence, frequency = np.array([0.5, -1.0], np.float32), np.array([0.25, 1.5], np.float32)
    got = np.asarray(apply_penalties(logits, counts, presence, frequency))
    expected = logits - counts * frequency[:, None] - (counts > 0) * presence[:, None]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(apply_penalties(logits, counts, np.zeros(2, np.float32),
                                                             np.zeros(2, np.float32))), logits)
    boosted = logits.copy()
    boosted[0, 5] = logits[0].max() + 1
    counts = np.zeros((2, V), np.int32)
    counts[0, 5] = 4
    token, *_ = sample(boosted, [SamplingParams(frequency_penalty=2.0), SamplingParams()], counts=counts)
    assert token[0] != 5 and token[0] == (boosted[0] - counts[0] * 2.0).argmax()


def test_logprobs_are_the_model_distribution():
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(2, V)).astype(np.float32)
    token, chosen, top_ids, top_values = [np.asarray(x) for x in sample_tokens(
        logits, np.zeros((2, V), np.int32), rows([SamplingParams(logprobs=True)] * 2), top_logprobs=5)]
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(chosen, log_probs[np.arange(2), token], atol=1e-5)
    np.testing.assert_array_equal(top_ids, np.argsort(-log_probs, -1)[:, :5])
    np.testing.assert_allclose(top_values, np.sort(log_probs, -1)[:, ::-1][:, :5], atol=1e-5)


def reference_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            return text[: end - max(len(s) for s in hits)], True
    return text, False


@pytest.mark.parametrize("trial", range(300))
def test_stop_holdback_never_leaks(trial):
    rng = np.random.default_rng(1000 + trial)
    alphabet = list("abc") + ["é", "\n"]
    text = "".join(rng.choice(alphabet, size=int(rng.integers(0, 30))))
    stops = ["".join(rng.choice(alphabet, size=int(rng.integers(1, 5)))) for _ in range(int(rng.integers(1, 4)))]
    expected, stopped = reference_cut(text, stops)
    f = StopStringFilter(stops)
    emitted, position = "", 0
    while position < len(text) and not f.stopped:
        step = int(rng.integers(1, 5))
        emitted += f.push(text[position : position + step])
        position += step
        assert expected.startswith(emitted)  # nothing that is (or is after) a stop string ever got out
    emitted += f.flush()
    assert emitted == expected
    assert f.stopped == stopped
