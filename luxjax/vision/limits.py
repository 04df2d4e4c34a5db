"""Per-request limits on image inputs (all checked before any pixel is decoded)."""
from __future__ import annotations

from dataclasses import dataclass

MiB = 1024 * 1024


@dataclass(frozen=True)
class ImageLimits:
    """max_pixels is 2**26 = 67,108,864 (64 Mi pixels, e.g. 8192x8192). It sits below PIL's own
    DecompressionBombWarning threshold (~89.5 M pixels), so PIL never warns for an image we accept."""

    max_images: int = 16
    max_image_bytes: int = 16 * MiB
    max_total_bytes: int = 32 * MiB
    max_pixels: int = 2**26
    max_aspect: float = 200.0
