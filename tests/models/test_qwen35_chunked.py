"""Chunked prefill and the recurrent (decode) form give the one-pass prefill's results (float32, fixture model).

The prompt holds two random images; the second one's rows straddle token 64, so chunks of 64 and of 7 cut an image,
and chunks of 1 feed it row by row.

Two classes of chunk size, because the DeltaNet layers themselves work in blocks of 64 tokens:
- chunks that are multiples of 64 (and the whole prompt) keep the DeltaNet's blocks and so the same float32
  algorithm; only the matmul shapes of the last, shorter chunk differ (its bucket). Measured: exactly 0 when the last
  chunk is bucketed like the one-pass tail, else up to 2e-5 on logits and 1e-5 on caches. Held to 1e-4.
- other chunks (1, 7) and the recurrent decode form reorder the float32 arithmetic of every DeltaNet layer. Their
  logits differ from the one-pass ones by about as much as either differs from the float64 truth (measured on this
  fixture: 1e-4..5e-4; transformers' own float32 run is 2e-4..6e-4 from its float64 run), so a bound of 1e-5 / 1e-4
  cannot hold there. They are held to the parity bound (1e-3) against the one-pass logits, or, where the one pass
  itself landed farther from float64 (seen: one pass 1.5e-3, chunks of 1 and 7 2.3e-4 from float64, 1.4e-3 apart),
  to 1e-3 against the float64 logits; and to 5e-4 on caches and on the next decode step.
Each test prints both runs' distances to transformers' float64 logits (chunked and one-pass are equally accurate:
measured 3e-4..1e-3 for both, the ratio between them wandering from 0.5 to 2 with the prompt)."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from qwen35_model_helpers import (EOS, FIXTURE_HF, IM_START, IMAGE_PAD, NORMAL_TOKENS, VISION_END, VISION_START,
                                  Case, float64_logits, image_processor, image_tokens, max_abs,
                                  random_image, worst_row)

ALIGNED_TOL = 1e-4  # chunks that keep the DeltaNet's 64-token blocks (logits, caches, next step)
REORDERED_TOL = 1e-3  # logits of chunkings that reorder float32 arithmetic (the transformers parity bound)
REORDERED_STATE_TOL = 5e-4  # their caches and next-token logits
PROMPT_SEED_OFFSET = 104729  # the prompt's seed from the session seed


def two_image_prompt(seed: int) -> Case:
    """[header][text][image 1][text][image 2 across token 64][text][assistant header], random sizes and tokens."""
    rng = np.random.default_rng(seed)
    processor = image_processor(FIXTURE_HF)
    sizes = []
    while len(sizes) < 2:
        w, h = int(rng.integers(60, 260)), int(rng.integers(60, 260))
        if 9 <= image_tokens(w, h, 4096, 131072) <= 24 and (w, h) not in sizes:
            sizes.append((w, h))
    images = [random_image(rng, w, h) for w, h in sizes]
    out = processor(images=images, return_tensors="np")
    grid = np.asarray(out["image_grid_thw"], np.int64)
    n1, n2 = (int(t * h * w // 4) for t, h, w in grid)
    word = lambda k: rng.integers(0, NORMAL_TOKENS, size=k).tolist()  # noqa: E731
    ids = [IM_START] + word(2) + word(int(rng.integers(3, 9)))
    ids += [VISION_START] + [IMAGE_PAD] * n1 + [VISION_END]
    second = 64 - int(rng.integers(1, n2))  # first row of image 2: rows second .. second+n2-1 include 63 and 64
    ids += word(second - 1 - len(ids))
    ids += [VISION_START] + [IMAGE_PAD] * n2 + [VISION_END]
    assert ids.index(IMAGE_PAD, ids.index(VISION_END)) == second
    ids += word(int(rng.integers(3, 12))) + [EOS] + word(1) + [IM_START] + word(2)
    return Case(f"two images {n1}+{n2} rows, image 2 at [{second}, {second + n2})", ids, images,
                np.asarray(out["pixel_values"], np.float32), grid)


def snapshot(caches):
    return jax.tree.map(lambda x: np.array(x, copy=True), caches)


def compare_caches(chunked, one_pass, num_tokens: int, where: str, tol: float) -> float:
    """Every cache array: KV rows of the prompt (rows past it hold padding garbage that attention never reads;
    KV arrays are [..., S, kv_heads, head_dim]), DeltaNet conv inputs and recurrent states. Returns the max
    difference."""
    leaves, structure = jax.tree_util.tree_flatten_with_path(chunked)
    others, other_structure = jax.tree_util.tree_flatten_with_path(one_pass)
    assert structure == other_structure, where
    worst = 0.0
    for (path, x), (_, y) in zip(leaves, others):
        name = jax.tree_util.keystr(path)
        if name.endswith((".k", ".v")):
            x, y = x[..., :num_tokens, :, :], y[..., :num_tokens, :, :]
        diff = max_abs(x, y)
        assert diff <= tol, f"{where}: cache {name} differs by {diff:.3g}"
        worst = max(worst, diff)
    names = [jax.tree_util.keystr(path) for path, _ in leaves]
    assert any(n.endswith(".k") for n in names) and any(n.endswith(".state") for n in names), names
    return worst


def run_prefill(backend, prompt, chunk):
    from luxjax.engine.generate import cache_length, prefill_prompt

    caches = backend.init_cache(1, cache_length(prompt.num_tokens, 12, backend.max_context))
    logits, caches = prefill_prompt(backend, caches, 0, prompt, chunk=chunk, all_logits=True)
    state = snapshot(caches)
    token = int(np.argmax(logits[-1]))
    after, _ = backend.decode(caches, np.array([token]), np.array([prompt.num_tokens]), np.array([prompt.rope_delta]))
    return np.asarray(logits, np.float32), state, token, np.asarray(after, np.float32)[0]


def float64_distances(logits, one_pass, truth) -> str:
    return f"float64 distance {max_abs(logits, truth):.3g} (one pass {max_abs(one_pass, truth):.3g})"


@pytest.fixture(scope="module")
def prompt_and_one_pass(fixture_model_f32, session_seed):
    seed = (session_seed + PROMPT_SEED_OFFSET) % (2**31)
    case = two_image_prompt(seed)
    backend = fixture_model_f32.backend
    prompt = backend.prompt_from_ids(case.input_ids, case.image_inputs())
    assert len(prompt.image_spans) == 2 and prompt.image_spans[1][0] < 64 < prompt.image_spans[1][1], prompt.image_spans
    return seed, case, prompt, run_prefill(backend, prompt, prompt.num_tokens), float64_logits(FIXTURE_HF, case)


def test_one_pass_matches_transformers(fixture_model_f32, prompt_and_one_pass):
    """The baseline the chunked runs are held to is itself right: within 2e-3 of transformers' float32 logits, or
    failing that of its float64 logits. (On random prompts this checkpoint has float32-sensitive positions: measured,
    perturbing transformers' own embeddings by 2e-7 relative moves its logits there by up to 1.2e-3, and luxjax has
    landed 1.7e-3 from float64 where transformers landed 3e-4. The strict 1e-3 parity is checked on the committed
    prompts and on random checkpoints in test_qwen35_parity.py.)"""
    from qwen35_model_helpers import check_logits, load_reference, reference

    seed, case, prompt, (logits, *_rest), truth = prompt_and_one_pass
    ref = reference(load_reference(FIXTURE_HF), case, generate=False, image_features=False)
    where = f"seed {seed}, {case.label}, {prompt.num_tokens} tokens"
    measured = check_logits(logits, ref.logits, 2e-3, where, FIXTURE_HF, case)
    print(f"{where}: one pass vs transformers: {measured}; float64 distance: luxjax {max_abs(logits, truth):.3g}, "
          f"transformers float32 {max_abs(ref.logits, truth):.3g}")


@pytest.mark.parametrize("chunk", [1, 7, 64, 128])
def test_chunked_prefill_matches_one_pass(fixture_model_f32, prompt_and_one_pass, chunk):
    from luxjax.vision.spans import plan_prefill_chunks

    seed, case, prompt, (logits, caches, token, after), truth = prompt_and_one_pass
    backend = fixture_model_f32.backend
    replay = (seed - PROMPT_SEED_OFFSET) % 2**31
    where = f"seed {seed} (LUXJAX_TEST_SEED={replay}), {case.label}, {prompt.num_tokens} tokens, chunk {chunk}"
    cuts = plan_prefill_chunks(prompt.num_tokens, prompt.image_spans, chunk, backend.keep_images_whole)
    if chunk < prompt.num_tokens:
        assert any(s < b < e for b, _ in cuts for s, e in prompt.image_spans), f"{where}: no chunk boundary cuts an image"
    aligned = chunk % 64 == 0
    tol, state_tol = (ALIGNED_TOL, ALIGNED_TOL) if aligned else (REORDERED_TOL, REORDERED_STATE_TOL)
    c_logits, c_caches, c_token, c_after = run_prefill(backend, prompt, chunk)
    diff = max_abs(c_logits, logits)
    # A reordering may land nearer the float64 truth than the one pass did (this fixture has float32-sensitive
    # positions, see test_one_pass_matches_transformers): then it is held to the same bound against the truth.
    truer = max_abs(c_logits, truth) <= min(tol, max_abs(logits, truth))
    assert diff <= tol or truer, (f"{where}: logits differ by {diff:.3g} at position "
                                  f"{worst_row(c_logits, logits)}; " + float64_distances(c_logits, logits, truth))
    cache_diff = compare_caches(c_caches, caches, prompt.num_tokens, where, state_tol)
    assert c_token == token, where
    next_diff = max_abs(c_after, after)
    assert next_diff <= state_tol, f"{where}: decode after chunked prefill differs by {next_diff:.3g}"
    print(f"{where}: logits {diff:.3g}, caches {cache_diff:.3g}, next-token logits after decode {next_diff:.3g}; "
          + float64_distances(c_logits, logits, truth))


def test_recurrent_decode_matches_prefill(fixture_model_f32):
    """A text prompt fed one token at a time through backend.decode (recurrent DeltaNet form, one KV row per step)
    gives the one-pass prefill's logits at every position."""
    from luxjax.engine.generate import cache_length, prefill_prompt

    data = np.load(FIXTURE_HF.parent / "ref_text.npz")
    ids = data["input_ids"].tolist()
    backend = fixture_model_f32.backend
    prompt = backend.prompt_from_ids(ids, None)
    size = cache_length(len(ids), 12, backend.max_context)
    one_pass, _ = prefill_prompt(backend, backend.init_cache(1, size), 0, prompt, all_logits=True)
    caches = backend.init_cache(1, size)
    steps = []
    for i, token in enumerate(ids):
        out, caches = backend.decode(caches, np.array([token]), np.array([i]), np.array([0]))
        steps.append(np.asarray(out, np.float32)[0])
    steps = np.stack(steps)
    diff = max_abs(steps, one_pass)
    ref_diff = max_abs(steps, data["logits"])
    where = f"recurrent decode of {len(ids)} tokens"
    assert diff <= REORDERED_TOL, f"{where} vs one-pass prefill: {diff:.3g} at position {worst_row(steps, one_pass)}"
    assert ref_diff <= 1e-3, f"{where} vs transformers: {ref_diff:.3g}"
    print(f"{where}: vs one-pass prefill {diff:.3g}, vs transformers {ref_diff:.3g}; "
          + float64_distances(steps, one_pass, float64_logits(FIXTURE_HF, Case("text", ids, []))))
