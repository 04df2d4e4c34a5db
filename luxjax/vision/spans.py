"""Where each image's placeholder tokens sit in a prompt, and prefill chunking that respects them."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def image_spans(token_ids: Sequence[int] | np.ndarray, image_token_id: int, num_tokens_per_image: Sequence[int]
                ) -> list[tuple[int, int]]:
    """[start, end) of each image's run of `image_token_id`, in order.

    Every image must be one contiguous run of exactly its token count (a chat template always separates two
    images with other tokens); anything else is a ValueError that gives the numbers.
    """
    ids = np.asarray(token_ids)
    is_image = np.concatenate(([False], ids == image_token_id, [False]))
    edges = np.flatnonzero(is_image[1:] != is_image[:-1])
    runs = [(int(s), int(e)) for s, e in zip(edges[::2], edges[1::2])]
    expected = [int(n) for n in num_tokens_per_image]
    if len(runs) != len(expected):
        raise ValueError(
            f"the prompt has {len(runs)} runs of image token {image_token_id} (lengths {[e - s for s, e in runs]}) "
            f"but {len(expected)} images were given (tokens {expected})"
        )
    for k, ((start, end), count) in enumerate(zip(runs, expected)):
        if end - start != count:
            raise ValueError(
                f"image {k + 1}: the prompt has {end - start} image tokens at [{start}, {end}) but the image "
                f"expands to {count}"
            )
    return runs


def plan_prefill_chunks(num_tokens: int, spans: Sequence[tuple[int, int]], chunk_size: int, keep_images_whole: bool
                        ) -> list[tuple[int, int]]:
    """Contiguous [start, end) chunks covering [0, num_tokens), each at most chunk_size tokens.

    With keep_images_whole, no chunk boundary falls strictly inside an image span: a chunk that would cut an image
    ends where the image starts. The one exception to the size limit: an image longer than chunk_size gets a chunk
    of its own, exactly its span.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if keep_images_whole:
        _check_spans(spans, num_tokens)
    chunks = []
    start, next_span = 0, 0
    while start < num_tokens:
        end = min(start + chunk_size, num_tokens)
        if keep_images_whole:
            while next_span < len(spans) and spans[next_span][1] <= end:  # spans this chunk holds whole
                next_span += 1
            if next_span < len(spans):
                span_start, span_end = spans[next_span]
                if span_start < end < span_end:
                    end = span_start if span_start > start else span_end
        chunks.append((start, end))
        start = end
    return chunks


def _check_spans(spans: Sequence[tuple[int, int]], num_tokens: int) -> None:
    previous_end = 0
    for start, end in spans:
        if not previous_end <= start < end <= num_tokens:
            raise ValueError(f"image spans must be sorted, non-empty, disjoint and within [0, {num_tokens}): {spans}")
        previous_end = end
