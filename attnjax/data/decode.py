"""Image files -> pixels: any format PIL reads (JPEG, PNG, WebP, BMP, ...), any size and mode, as a
uint8 ``[H, W, channels]`` array with the file's EXIF orientation applied.

Modes are converted as torchvision's ``pil_loader`` converts them (``Image.convert``: alpha is
dropped, CMYK and palettes become RGB, RGB becomes gray by ITU-R 601-2 luma), except 16-bit gray,
which is scaled to 8 bits (``convert`` would clip it at 255). Every problem is a ``ValueError``
in one line that names the file.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from attnjax.data.transforms import resize_shorter_image

# torchvision's IMG_EXTENSIONS, matched in any case (ImageNet's files end in .JPEG).
IMAGE_EXTENSIONS = (".bmp", ".jpeg", ".jpg", ".pgm", ".png", ".ppm", ".tif", ".tiff", ".webp")

# Modes holding more than 8 bits per pixel; their full range maps onto 0..255.
_WIDE_MODES = {"I;16": 65535, "I;16L": 65535, "I;16B": 65535, "I;16N": 65535, "I": 65535}

# EXIF orientations that turn the picture by 90 degrees (width and height swap).
_TRANSPOSED = (5, 6, 7, 8)

_FORMATS = "JPEG, PNG, WebP, BMP, TIFF, PPM or PGM"


def is_image_file(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def _converted(image: Image.Image, channels: int) -> Image.Image:
    if image.mode in _WIDE_MODES:
        wide = np.asarray(image, np.float64) * (255.0 / _WIDE_MODES[image.mode])
        image = Image.fromarray(np.clip(np.round(wide), 0, 255).astype(np.uint8))
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")  # PIL refuses a palette's byte transparency straight to RGB
    target = "L" if channels == 1 else "RGB"
    return image if image.mode == target else image.convert(target)


def decode_image(
    file, channels: int, where: str, min_side: int = 0, shorter_side: int = 0
) -> np.ndarray:
    """``file`` (bytes or a path) -> uint8 ``[H, W, channels]`` (1: gray, 3: RGB).

    ``min_side > 0`` lets a JPEG decode at the smallest DCT scale (1/2, 1/4, 1/8) that keeps both
    sides at least ``min_side``: a large photo cut down to a small crop decodes several times
    faster. ``shorter_side > 0`` returns it resized as ``attnjax.data.transforms.resize_shorter``
    would resize the array (the same pixels, without the full-size array in between).
    ``where`` names the file in errors.
    """
    if channels not in (1, 3):
        raise ValueError(f"config.data.channels={channels!r}; expected 1 (gray) or 3 (RGB)")
    if not isinstance(file, bytes):
        try:
            with open(file, "rb") as handle:
                file = handle.read()
        except OSError as error:
            reason = " ".join(str(error).split())
            raise ValueError(
                f"{where!r} cannot be read ({reason}); expected a readable file"
            ) from None
    with _image_errors(where), Image.open(io.BytesIO(file)) as image:
        if min_side and image.format == "JPEG":
            image.draft(image.mode, (min_side, min_side))
        ImageOps.exif_transpose(image, in_place=True)  # a copy only where it turns
        converted = _converted(image, channels)
        if shorter_side:
            converted = resize_shorter_image(converted, shorter_side)
        pixels = np.asarray(converted)
    return pixels[..., None] if pixels.ndim == 2 else pixels


def image_size(file, where: str, *, full: bool = False) -> tuple[int, int]:
    """``(width, height)`` of the image ``file`` (a path or bytes) as it will be shown (EXIF
    orientation applied), from its header; ``full`` decodes all of it too, which finds truncated
    files. A ``ValueError`` naming ``where`` if it cannot be read or is not an image."""
    if isinstance(file, bytes):
        return _size(io.BytesIO(file), full, where)
    try:
        handle = open(file, "rb")
    except OSError as error:
        reason = " ".join(str(error).split())
        raise ValueError(f"{where!r} cannot be read ({reason}); expected a readable file") from None
    with handle:
        return _size(handle, full, where)


def _size(handle, full: bool, where: str) -> tuple[int, int]:
    with _image_errors(where), Image.open(handle) as image:
        width, height = image.size
        if full:
            image.load()
        if image.getexif().get(0x0112) in _TRANSPOSED:
            width, height = height, width
    return width, height


@contextlib.contextmanager
def _image_errors(where: str):
    """PIL's errors while reading ``where`` as the one-line ``ValueError`` naming it."""
    try:
        yield
    except UnidentifiedImageError:
        raise ValueError(f"{where!r} is not an image PIL can read; expected {_FORMATS}") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        reason = " ".join(str(error).split())
        raise ValueError(
            f"{where!r} is truncated or damaged ({reason}); expected a whole image"
        ) from None
