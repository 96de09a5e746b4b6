"""attnjax/data/decode.py: each format and mode a folder may hold read as torchvision's
``ImageFolder`` reads it (its ``pil_loader``), gray by ITU-R 601-2 luma, 16 bits scaled to 8, every
EXIF orientation turned upright as the EXIF specification says, JPEG's reduced-scale decoding."""

import numpy as np
import pytest
from PIL import Image
from torchvision.datasets.folder import pil_loader

from attnjax.data.decode import decode_image, image_size
from attnjax.data.transforms import resize_shorter

WIDTH, HEIGHT = 7, 5


def _image(mode, seed=0):
    """A random ``WIDTH`` x ``HEIGHT`` image of ``mode``; palettes get a random palette."""
    rng = np.random.default_rng(seed)
    if mode == "I;16":
        values = rng.integers(0, 65536, (HEIGHT, WIDTH), dtype=np.uint16)
        return Image.frombytes(mode, (WIDTH, HEIGHT), values.astype("<u2").tobytes())
    if mode == "P":
        image = Image.frombytes("P", (WIDTH, HEIGHT), rng.integers(0, 8, WIDTH * HEIGHT, np.uint8))
        image.putpalette(rng.integers(0, 256, 8 * 3, dtype=np.uint8).tobytes())
        return image
    return Image.frombytes(mode, (WIDTH, HEIGHT), rng.bytes(WIDTH * HEIGHT * len(mode)))


def _luma(rgb):
    """ITU-R 601-2: L = 0.299 R + 0.587 G + 0.114 B."""
    return np.round(rgb.astype(np.float64) @ [0.299, 0.587, 0.114])[..., None]


# (format, file extension, mode) that PIL writes.
FILES = [
    ("JPEG", "jpg", "L"),
    ("JPEG", "JPEG", "RGB"),
    ("JPEG", "jpeg", "CMYK"),
    ("PNG", "png", "L"),
    ("PNG", "png", "LA"),
    ("PNG", "PNG", "RGB"),
    ("PNG", "png", "RGBA"),
    ("PNG", "png", "P"),
    ("WEBP", "webp", "RGB"),
    ("WEBP", "webp", "RGBA"),
    ("BMP", "bmp", "L"),
    ("BMP", "bmp", "RGB"),
    ("BMP", "bmp", "P"),
    ("TIFF", "tif", "CMYK"),
    ("TIFF", "tiff", "RGB"),
    ("PPM", "ppm", "RGB"),
    ("PPM", "pgm", "L"),
]


@pytest.mark.parametrize("fmt, ext, mode", FILES, ids=[f"{e}-{m}" for _, e, m in FILES])
def test_every_format_and_mode_is_read_as_torchvisions_pil_loader_reads_it(
    tmp_path, fmt, ext, mode
):
    path = tmp_path / f"image.{ext}"
    options = {"lossless": True} if fmt == "WEBP" else {}
    _image(mode).save(path, fmt, **options)
    want = np.asarray(pil_loader(str(path)))  # converted to RGB as ImageFolder converts
    assert want.shape == (HEIGHT, WIDTH, 3)
    got = decode_image(str(path), 3, str(path))
    np.testing.assert_array_equal(got, want)
    gray = decode_image(path.read_bytes(), 1, str(path))  # bytes (shards) as paths
    assert gray.dtype == np.uint8 and gray.shape == (HEIGHT, WIDTH, 1)
    np.testing.assert_allclose(gray, _luma(want), atol=1)
    assert image_size(str(path), str(path)) == (WIDTH, HEIGHT)


def test_a_palette_with_a_transparent_entry_gives_its_colours(tmp_path):
    image = _image("P")
    path = tmp_path / "image.png"
    image.save(path, transparency=3)
    colours = np.asarray(image.getpalette()[: 8 * 3], np.uint8).reshape(8, 3)
    want = colours[np.asarray(image)]  # the palette looked up, alpha left out
    np.testing.assert_array_equal(decode_image(str(path), 3, str(path)), want)
    np.testing.assert_allclose(decode_image(str(path), 1, str(path)), _luma(want), atol=1)


@pytest.mark.parametrize("fmt, ext", [("PNG", "png"), ("TIFF", "tif")])
def test_sixteen_bit_gray_is_scaled_to_eight_bits(tmp_path, fmt, ext):
    image = _image("I;16")
    path = tmp_path / f"image.{ext}"
    image.save(path, fmt)
    values = np.frombuffer(image.tobytes(), "<u2").reshape(HEIGHT, WIDTH)
    want = np.round(values * (255 / 65535)).astype(np.uint8)[..., None]
    np.testing.assert_array_equal(decode_image(str(path), 1, str(path)), want)
    np.testing.assert_array_equal(decode_image(str(path), 3, str(path)), want.repeat(3, -1))


def _upright(pixels, orientation):
    """The EXIF specification's orientations: a left-right mirror (2, 4, 5, 7) then clockwise
    quarter turns."""
    mirror, turns = {1: (0, 0), 2: (1, 0), 3: (0, 2), 4: (1, 2), 5: (1, 3), 6: (0, 1)}.get(
        orientation, {7: (1, 1), 8: (0, 3)}.get(orientation)
    )
    pixels = pixels[:, ::-1] if mirror else pixels
    return np.rot90(pixels, -turns)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied(tmp_path, fmt, orientation):
    image = _image("RGB")
    plain, tagged = tmp_path / "plain", tmp_path / "tagged"
    exif = Image.Exif()
    exif[0x0112] = orientation
    image.save(plain, fmt)
    image.save(tagged, fmt, exif=exif)
    stored = decode_image(str(plain), 3, "plain")  # JPEG: the same pixels, decoded alike
    want = _upright(stored, orientation)
    got = decode_image(str(tagged), 3, "tagged")
    np.testing.assert_array_equal(got, want)
    assert image_size(str(tagged), "tagged") == (want.shape[1], want.shape[0])


def test_jpeg_decodes_at_the_smallest_scale_that_keeps_min_side(tmp_path):
    """A 64 x 48 JPEG: DCT scales 1/2, 1/4, 1/8 keep the sides at least ``min_side``; the reduced
    decoding is close to the full one averaged over the same blocks."""
    y, x = np.mgrid[0:48, 0:64]
    smooth = np.stack([x * 4, y * 5, (x + y) * 2], -1).astype(np.uint8)
    path = tmp_path / "photo.jpg"
    Image.fromarray(smooth).save(path, quality=95)
    full = decode_image(str(path), 3, "photo")
    for min_side, scale in ((48, 1), (24, 2), (20, 2), (12, 4), (6, 8), (1, 8)):
        got = decode_image(str(path), 3, "photo", min_side=min_side)
        assert got.shape == (48 // scale, 64 // scale, 3), (min_side, got.shape)
        blocks = full.reshape(48 // scale, scale, 64 // scale, scale, 3).mean(axis=(1, 3))
        assert np.abs(got - blocks).mean() < 3, min_side


def test_decoding_to_a_shorter_side_equals_resizing_the_decoded_image(tmp_path):
    for mode, channels in (("RGB", 3), ("L", 1), ("RGB", 1)):
        path = tmp_path / f"{mode}.png"
        _image(mode, seed=channels).save(path)
        full = decode_image(str(path), channels, "image")
        for side in (3, 5, 11):
            got = decode_image(str(path), channels, "image", shorter_side=side)
            np.testing.assert_array_equal(got, resize_shorter(full, side))
