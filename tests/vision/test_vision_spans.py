"""image_spans, plan_prefill_chunks and next_chunk_end: exact validation and random property tests (fresh seed each
run)."""
from __future__ import annotations

import numpy as np
import pytest

from luxjax.vision.spans import image_spans, next_chunk_end, plan_prefill_chunks
from vision_helpers import fresh_seed

PAD = 7


def random_prompt(rng: np.random.Generator) -> tuple[list[int], list[tuple[int, int]], list[int]]:
    """Token ids with images (runs of PAD) separated by at least one other token."""
    ids, spans, counts = [], [], []
    for _ in range(int(rng.integers(0, 6))):
        ids += [int(t) for t in rng.integers(10, 100, size=int(rng.integers(1, 40)))]
        count = int(rng.integers(1, 120))
        spans.append((len(ids), len(ids) + count))
        counts.append(count)
        ids += [PAD] * count
    ids += [int(t) for t in rng.integers(10, 100, size=int(rng.integers(0, 30)))]
    return ids, spans, counts


def test_image_spans_random():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    for _ in range(300):
        ids, spans, counts = random_prompt(rng)
        assert image_spans(ids, PAD, counts) == spans, f"seed={seed}"
        assert image_spans(np.array(ids, dtype=np.int32), PAD, counts) == spans, f"seed={seed}"


def test_image_spans_count_mismatch():
    ids = [1, PAD, PAD, PAD, 2, PAD, PAD, 3]
    assert image_spans(ids, PAD, [3, 2]) == [(1, 4), (5, 7)]
    with pytest.raises(ValueError, match=r"image 2: the prompt has 2 image tokens at \[5, 7\) but the image expands"):
        image_spans(ids, PAD, [3, 4])
    with pytest.raises(ValueError, match=r"2 runs of image token 7 \(lengths \[3, 2\]\) but 1 images"):
        image_spans(ids, PAD, [5])
    with pytest.raises(ValueError, match="0 runs"):
        image_spans([1, 2], PAD, [1])
    assert image_spans([1, 2], PAD, []) == []


def check_plan(chunks, num_tokens, spans, chunk_size, keep_images_whole, context):
    assert (chunks[0][0] if chunks else 0) == 0 and (chunks[-1][1] if chunks else 0) == num_tokens, context
    for (_, end), (start, _) in zip(chunks, chunks[1:]):
        assert end == start, context
    spans_by_start = dict(spans)
    for start, end in chunks:
        assert end > start, context
        if end - start > chunk_size:
            assert keep_images_whole and spans_by_start.get(start) == end, f"{context}: oversize {start, end}"
    if keep_images_whole:
        for span_start, span_end in spans:
            assert not any(span_start < end < span_end for _, end in chunks), f"{context}: split {span_start, span_end}"


@pytest.mark.parametrize("keep_images_whole", [True, False])
def test_plan_prefill_chunks_random(keep_images_whole):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    for _ in range(500):
        ids, spans, _ = random_prompt(rng)
        chunk_size = int(rng.integers(1, 150))
        chunks = plan_prefill_chunks(len(ids), spans, chunk_size, keep_images_whole)
        check_plan(chunks, len(ids), spans, chunk_size, keep_images_whole, f"seed={seed} size={chunk_size} {spans}")
        if not keep_images_whole:
            assert all(end - start == chunk_size for start, end in chunks[:-1])


@pytest.mark.parametrize("keep_images_whole", [True, False])
def test_next_chunk_end_with_changing_sizes(keep_images_whole):
    """One chunk at a time, each of its own size (the scheduler's way: small beside decoding streams, large
    alone): the chunks tile the prompt, each obeys its own size and the span rule, and a constant size gives
    plan_prefill_chunks' plan."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    for _ in range(300):
        ids, spans, _ = random_prompt(rng)
        start = 0
        while start < len(ids):
            size = int(rng.integers(1, 150))
            end = next_chunk_end(start, len(ids), spans, size, keep_images_whole)
            context = f"seed={seed} chunk={start, end} size={size} spans={spans}"
            assert start < end <= len(ids), context
            assert end - start <= size or (keep_images_whole and (start, end) in spans), context
            if keep_images_whole:
                assert not any(s < end < e for s, e in spans), context
            start = end
        constant = int(rng.integers(1, 150))
        walked, start = [], 0
        while start < len(ids):
            walked.append((start, next_chunk_end(start, len(ids), spans, constant, keep_images_whole)))
            start = walked[-1][1]
        assert walked == plan_prefill_chunks(len(ids), spans, constant, keep_images_whole), f"seed={seed}"


def test_plan_examples():
    assert plan_prefill_chunks(10, [(2, 6)], 4, True) == [(0, 2), (2, 6), (6, 10)]
    assert plan_prefill_chunks(10, [(2, 6)], 4, False) == [(0, 4), (4, 8), (8, 10)]
    assert plan_prefill_chunks(12, [(1, 9)], 4, True) == [(0, 1), (1, 9), (9, 12)]
    assert plan_prefill_chunks(8, [(0, 2), (3, 5)], 4, True) == [(0, 3), (3, 7), (7, 8)]
    assert plan_prefill_chunks(0, [], 4, True) == []


def test_plan_validates_inputs():
    with pytest.raises(ValueError, match="chunk_size"):
        plan_prefill_chunks(10, [], 0, True)
    for spans in ([(5, 3)], [(0, 4), (3, 6)], [(8, 12)], [(4, 6), (0, 2)]):
        with pytest.raises(ValueError, match="sorted"):
            plan_prefill_chunks(10, spans, 4, True)
