"""M-RoPE position ids for a prompt with image spans (transformers' get_rope_index, for images)."""
from __future__ import annotations

import numpy as np


def mrope_positions(num_tokens: int, spans, llm_grids) -> tuple[np.ndarray, int]:
    """spans: [(start, end)] of each image's pad rows; llm_grids: [(rows, cols)] merged-token grid per image.

    Text tokens get p, p+1, ... on all three axes. An image whose first row is at p gets T = p, H = p + row,
    W = p + col; the next text token gets p + max(rows, cols). Returns (positions int32 [3, T], rope_delta),
    rope_delta = max position + 1 - T, which decode adds to the cache length on every axis."""
    pos = np.zeros((3, num_tokens), dtype=np.int64)
    cursor, next_pos = 0, 0
    for (start, end), (rows, cols) in zip(spans, llm_grids):
        if end - start != rows * cols:
            raise ValueError(f"image span {start}:{end} holds {end - start} rows, grid {rows}x{cols} needs {rows * cols}")
        text = start - cursor
        pos[:, cursor:start] = next_pos + np.arange(text)
        next_pos += text
        r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        pos[0, start:end] = next_pos
        pos[1, start:end] = next_pos + r.ravel()
        pos[2, start:end] = next_pos + c.ravel()
        next_pos += max(rows, cols)
        cursor = end
    pos[:, cursor:] = next_pos + np.arange(num_tokens - cursor)
    rope_delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return pos.astype(np.int32), rope_delta
