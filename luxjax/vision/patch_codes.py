"""Image patches as uint8 codes and a per-channel table of the float values they stand for.

After the resize, every value a preprocessor feeds a vision tower is a function of one uint8 pixel and its channel
(rescale, normalize), so a patch row is fully described by its pixels' codes and a [channels, 256] table. Sending the
codes instead of the float32 rows moves 1/4 of the bytes to the device (1/8 where a still image is repeated over a
temporal patch by towers built for video) and skips building the float rows on the host; the device expands them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True, eq=False)
class PatchCodes:
    """Rows of patches, each the concatenation over channels c of table[c, codes[row, c]] repeated `repeat` times.

    Reads like the float32 array it stands for where numpy takes it (np.asarray, shape, dtype, len), so code that
    wants the values gets them; a tower's input code sends `codes` and `table` and expands them on the device."""

    codes: np.ndarray  # uint8 [patches, channels, values per channel]
    table: np.ndarray  # float32 [channels, 256]
    repeat: int = 1

    def __post_init__(self):
        if self.codes.dtype != np.uint8 or self.codes.ndim != 3:
            raise ValueError(f"codes must be uint8 [patches, channels, values], got {self.codes.dtype} "
                             f"{self.codes.shape}")
        if self.table.shape != (self.codes.shape[1], 256) or self.repeat < 1:
            raise ValueError(f"table must be [{self.codes.shape[1]}, 256] and repeat >= 1, got {self.table.shape}, "
                             f"{self.repeat}")

    @property
    def shape(self) -> tuple[int, int]:
        patches, channels, values = self.codes.shape
        return patches, channels * self.repeat * values

    dtype = np.dtype(np.float32)
    ndim = 2

    def __len__(self) -> int:
        return self.codes.shape[0]

    def __repr__(self) -> str:  # sizes only: logs never carry image payloads
        patches, channels, values = self.codes.shape
        return f"PatchCodes({patches} patches x {channels} channels x {values} values, repeat {self.repeat})"

    def expand(self) -> np.ndarray:
        """The float32 rows [patches, channels * repeat * values]."""
        return np.asarray(expand(self.codes, self.table, self.repeat, xp=np))

    def __array__(self, dtype=None, copy=None):
        if copy is False:
            raise ValueError("PatchCodes has no float rows to share: they are built on request (copy=False)")
        rows = self.expand()
        return rows if dtype is None else rows.astype(dtype)

    def padded_codes(self, rows: int) -> np.ndarray:
        """codes with zero rows appended up to `rows` (a bucketed patch count); only the appended rows are zeroed
        (the codes are megabytes on an image's way to the tower)."""
        out = np.empty((rows, *self.codes.shape[1:]), np.uint8)
        out[: len(self)] = self.codes
        out[len(self):] = 0
        return out


def expand(codes, table, repeat: int, xp=jnp):
    """codes [P, C, n] -> [P, C * repeat * n] rows of table values (numpy or jax.numpy, by xp)."""
    values = table[xp.arange(codes.shape[1])[None, :, None], codes]  # [P, C, n]
    values = xp.broadcast_to(values[:, :, None, :], (*values.shape[:2], repeat, values.shape[2]))
    return values.reshape(codes.shape[0], -1)


@functools.partial(jax.jit, static_argnames="repeat")
def expand_on_device(codes: jax.Array, table: jax.Array, repeat: int) -> jax.Array:
    """The float32 rows, computed where the codes are (a gather from a 3 KB table)."""
    return expand(codes.astype(jnp.int32), table, repeat)
