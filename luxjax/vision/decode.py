"""Encoded image bytes -> an RGB PIL image, refusing bombs, odd shapes and corrupt files before they cost memory.

Conversion to RGB replicates transformers' `image_transforms.convert_to_rgb` for PIL images (what its
Qwen2VLImageProcessorPil applies): any image with an alpha band or a `transparency` entry is composited onto
white; everything else goes through PIL's `convert("RGB")`.

EXIF orientation is honoured for encoded images, as transformers' `load_image` does for URL/base64 inputs
(`ImageOps.exif_transpose`). PIL images handed in directly (notebook parts) are used as they are, as transformers'
image processors do with PIL inputs. Animated images give their first frame.
"""
from __future__ import annotations

import io

from PIL import Image, ImageOps

from luxjax.errors import ImageInputError
from luxjax.vision.data_url import EncodedImage
from luxjax.vision.limits import ImageLimits

EXIF_ORIENTATION_TAG = 0x0112


def decode_image(encoded: EncodedImage, label: str, limits: ImageLimits) -> Image.Image:
    """Decode, orient and convert to RGB; the pixel-count and aspect checks run on the header alone."""
    try:
        image = Image.open(io.BytesIO(encoded.data), formats=[encoded.format])
    except Image.DecompressionBombError:
        raise _too_many_pixels(label, None, limits) from None
    except MemoryError:
        raise
    except Exception:
        raise ImageInputError(
            f"{label}: the {encoded.format} data cannot be read (corrupt or not an image)", code="invalid_image"
        ) from None
    check_dimensions(image.width, image.height, label, limits)
    _load_fully(image, label)
    return _convert_or_refuse(_apply_exif_orientation(image), label)


def prepare_pil_image(image: Image.Image, label: str, limits: ImageLimits) -> Image.Image:
    """An image given as a PIL object (notebook use): same limits and RGB conversion, no EXIF handling."""
    check_dimensions(image.width, image.height, label, limits)
    _load_fully(image, label)
    return _convert_or_refuse(image, label)


def check_dimensions(width: int, height: int, label: str, limits: ImageLimits) -> None:
    if width < 1 or height < 1:
        raise ImageInputError(f"{label}: the image is empty ({width}x{height})", code="invalid_image")
    if width * height > limits.max_pixels:
        raise _too_many_pixels(label, (width, height), limits)
    aspect = max(width, height) / min(width, height)
    if aspect > limits.max_aspect:
        raise ImageInputError(
            f"{label}: the image is {width}x{height}, an aspect ratio of {aspect:.1f}, over the limit of "
            f"{limits.max_aspect:g}",
            code="invalid_image_shape",
        )


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb for PIL images, bit for bit (it skips the copy for plain RGB)."""
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def _convert_or_refuse(image: Image.Image, label: str) -> Image.Image:
    try:
        return to_rgb(image)
    except ValueError:
        raise ImageInputError(
            f"{label}: pixel mode {image.mode} cannot be converted to RGB", code="unsupported_image"
        ) from None


def _load_fully(image: Image.Image, label: str) -> None:
    """Force the full decode so that truncated or corrupt data is refused here (LOAD_TRUNCATED_IMAGES stays off)."""
    try:
        image.load()
    except MemoryError:
        raise
    except Exception:
        raise ImageInputError(
            f"{label}: the image data is truncated or corrupt and cannot be decoded", code="invalid_image"
        ) from None


def _apply_exif_orientation(image: Image.Image) -> Image.Image:
    try:
        orientation = image.getexif().get(EXIF_ORIENTATION_TAG, 1)
    except Exception:  # an unreadable EXIF block does not make the pixels unusable
        return image
    if orientation in (2, 3, 4, 5, 6, 7, 8):
        return ImageOps.exif_transpose(image)
    return image


def _too_many_pixels(label: str, size: tuple[int, int] | None, limits: ImageLimits) -> ImageInputError:
    declared = f"{size[0]}x{size[1]} = {size[0] * size[1]} pixels" if size else "more pixels than PIL allows"
    return ImageInputError(
        f"{label}: the image declares {declared}, over the limit of {limits.max_pixels} pixels",
        code="image_too_large",
    )
