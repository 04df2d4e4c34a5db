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
    _check_chunking(num_tokens, spans, chunk_size, keep_images_whole)  # even for an empty prompt
    chunks, start = [], 0
    while start < num_tokens:
        end = next_chunk_end(start, num_tokens, spans, chunk_size, keep_images_whole)
        chunks.append((start, end))
        start = end
    return chunks


def next_chunk_end(start: int, num_tokens: int, spans: Sequence[tuple[int, int]], chunk_size: int,
                   keep_images_whole: bool) -> int:
    """The end of the prefill chunk that begins at `start` (a chunk boundary of plan_prefill_chunks' rules): the
    scheduler asks one chunk at a time, its size depending on whether other streams are decoding."""
    _check_chunking(num_tokens, spans, chunk_size, keep_images_whole)
    end = min(start + chunk_size, num_tokens)
    if keep_images_whole:
        straddled = next(((s, e) for s, e in spans if e > end), None)  # the first span not held whole
        if straddled is not None and straddled[0] < end < straddled[1]:
            end = straddled[0] if straddled[0] > start else straddled[1]
    return end


def _check_chunking(num_tokens: int, spans: Sequence[tuple[int, int]], chunk_size: int, keep_images_whole: bool
                    ) -> None:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if keep_images_whole:
        _check_spans(spans, num_tokens)


def _check_spans(spans: Sequence[tuple[int, int]], num_tokens: int) -> None:
    previous_end = 0
    for start, end in spans:
        if not previous_end <= start < end <= num_tokens:
            raise ValueError(f"image spans must be sorted, non-empty, disjoint and within [0, {num_tokens}): {spans}")
        previous_end = end
