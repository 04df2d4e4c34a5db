"""Content hash of a decoded image, the key of image/prefix caches."""
from __future__ import annotations

import hashlib

from PIL import Image


def image_hash(image: Image.Image) -> str:
    """sha256 hex over mode, size and raw pixel bytes: equal pixels give equal hashes whatever the file format."""
    digest = hashlib.sha256()
    digest.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
