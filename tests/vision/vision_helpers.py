"""Helpers shared by the image pipeline tests: fixture paths, encoders, synthetic images, seeds."""
from __future__ import annotations

import base64
import io
import json
import secrets
from pathlib import Path

import numpy as np
from PIL import Image

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
IMAGES = FIXTURES / "images"
TINY_CONFIG_PATH = FIXTURES / "qwen35-tiny-a" / "hf" / "preprocessor_config.json"


def tiny_config() -> dict:
    return json.loads(TINY_CONFIG_PATH.read_text())


def encode(image: Image.Image, fmt: str, **save_args) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save_args)
    return buffer.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(data: bytes, mime: str) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data, mime)}}


def photo_like(rng: np.random.Generator, width: int, height: int, channels: int = 3) -> np.ndarray:
    """Smooth gradients plus noise: compresses like a photo, exercises every uint8 value."""
    x, y = np.arange(width, dtype=np.float32), np.arange(height, dtype=np.float32)
    image = np.empty((height, width, channels), dtype=np.uint8)
    for c in range(channels):
        sx, sy, phase = rng.uniform(0.002, 0.05), rng.uniform(0.002, 0.05), rng.uniform(0, 6.28)
        smooth = 127 + 115 * np.outer(np.cos(y * sy), np.sin(x * sx + phase))
        noise = rng.integers(-30, 31, size=(height, width), dtype=np.int16)
        image[..., c] = np.clip(smooth + noise, 0, 255)
    return image


def fresh_seed() -> int:
    return secrets.randbits(32)
