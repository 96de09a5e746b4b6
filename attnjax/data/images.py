"""Pictures of models and runs: image grids, PNG files, attention-map figures and metric curves.

Images are channels-last ``[n, height, width, channels]`` floats in [0, 1] (1 or 3 channels);
a written picture is a uint8 array ``[height, width, channels]``. Nothing here runs a model:
callers decode or sample first and pass the pixels. matplotlib and PIL are imported by the
functions that need them, so importing this module costs neither.
"""

from __future__ import annotations

import io
import math
import os
from typing import Sequence

import numpy as np
from absl import logging

from attnjax import storage


def _check_images(images, where: str) -> np.ndarray:
    images = np.asarray(images, np.float32)
    if images.ndim != 4 or images.shape[-1] not in (1, 3):
        raise ValueError(
            f"{where}: images must be [n, height, width, channels] with 1 or 3 channels, "
            f"got shape {images.shape}"
        )
    return images


def _write_png(image, path, **options) -> None:
    """Saves the PIL ``image`` as a PNG at ``path``, a local file or an object in a bucket."""
    if not storage.is_remote(path):
        image.save(path, **options)
        return
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", **options)
    storage.write_atomic(path, buffer.getvalue())


def image_grid(images, nrow: int) -> np.ndarray:
    """``[n, H, W, C]`` floats in [0, 1] -> one uint8 image
    ``[rows * (H+1) + 1, nrow * (W+1) + 1, C]``.

    Images fill rows of ``nrow`` left to right, ``rows = ceil(n / nrow)``; a one-pixel white
    border separates them and the cells after the last image stay white. Values outside [0, 1]
    are clipped.
    """
    images = np.clip(_check_images(images, "image_grid"), 0.0, 1.0)
    if isinstance(nrow, bool) or not isinstance(nrow, (int, np.integer)) or nrow < 1:
        raise ValueError(f"image_grid: nrow (images per row) must be a positive int, got {nrow!r}")
    n, height, width, channels = images.shape
    rows = -(-n // nrow)
    grid = np.ones((rows * (height + 1) + 1, nrow * (width + 1) + 1, channels), np.float32)
    for i, image in enumerate(images):
        top, left = (1 + (height + 1) * (i // nrow), 1 + (width + 1) * (i % nrow))
        grid[top : top + height, left : left + width] = image
    return np.round(grid * 255.0).astype(np.uint8)


def save_png(image, path, scale: int = 1) -> str:
    """Writes a uint8 picture ``[H, W]`` or ``[H, W, 1 or 3]`` as a PNG, each pixel ``scale`` x
    ``scale`` (nearest neighbour, so small images stay sharp); returns the path."""
    from PIL import Image

    image = np.asarray(image)
    if (
        image.dtype != np.uint8
        or image.ndim not in (2, 3)
        or (image.ndim == 3 and image.shape[-1] not in (1, 3))
    ):
        raise ValueError(
            f"save_png: image must be uint8 [height, width] or [height, width, 1 or 3], got "
            f"{image.dtype} of shape {image.shape} (for {path})"
        )
    if isinstance(scale, bool) or not isinstance(scale, (int, np.integer)) or scale < 1:
        raise ValueError(f"save_png: scale must be a positive int, got {scale!r} (for {path})")
    image = image.repeat(scale, axis=0).repeat(scale, axis=1)
    _write_png(
        Image.fromarray(image[..., 0] if image.ndim == 3 and image.shape[-1] == 1 else image), path
    )
    return str(path)


def save_image_grid(images, path, nrow: int, scale: int = 1) -> str:
    """Writes ``image_grid(images, nrow)`` as a PNG, each pixel ``scale`` x ``scale``; returns its
    path."""
    return save_png(image_grid(images, nrow), path, scale)


def save_labelled_grid(
    images,
    labels: Sequence[str],
    path,
    *,
    nrow: int = 8,
    title: str = "",
    alarms: Sequence[bool] | None = None,
    cell: int = 64,
) -> str:
    """Writes ``images`` ``[n, H, W, C]`` (floats in [0, 1]) as a PNG grid of ``nrow`` per row,
    each enlarged (nearest neighbour) to about ``cell`` pixels and with its label above it, red
    where ``alarms[i]``; ``title`` on a line above the grid. Returns ``path``.

    Drawn with PIL alone: a matplotlib figure of one axes per image took 2 s for 32 images, as
    long as an evaluation of the digits ViT.
    """
    from PIL import Image, ImageDraw, ImageFont

    images = np.clip(_check_images(images, "save_labelled_grid"), 0.0, 1.0)
    n, height, width, _ = images.shape
    if len(labels) != n or (alarms is not None and len(alarms) != n):
        raise ValueError(
            f"save_labelled_grid: {n} images need {n} labels and alarms, got {len(labels)} "
            f"and {None if alarms is None else len(alarms)} (for {path})"
        )
    scale = max(1, round(cell / max(height, width)))
    font = ImageFont.load_default(size=11)
    line = 14  # pixels of one text line at that size
    pad = 4
    cols = max(1, min(nrow, n))
    rows = max(1, -(-n // cols))
    cell_w = max(width * scale, 40) + pad
    cell_h = height * scale + line + pad
    top = line + pad if title else 0
    canvas = Image.new("RGB", (cols * cell_w + pad, top + rows * cell_h + pad), "white")
    draw = ImageDraw.Draw(canvas)
    if title:
        draw.text((pad, pad // 2), title, fill="black", font=font)
    pixels = np.round(images * 255.0).astype(np.uint8).repeat(scale, 1).repeat(scale, 2)
    if pixels.shape[-1] == 1:
        pixels = pixels.repeat(3, -1)
    for i in range(n):
        x = pad + (i % cols) * cell_w
        y = top + pad + (i // cols) * cell_h
        colour = "red" if alarms is not None and alarms[i] else "black"
        draw.text((x, y), str(labels[i]), fill=colour, font=font)
        canvas.paste(Image.fromarray(pixels[i]), (x, y + line))
    _write_png(canvas, path)
    return str(path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    return plt


def plot_attention_maps(images, heatmaps, path, *, titles: Sequence[str] | None = None, alpha=0.6):
    """Draw each image above the image overlaid with its heat map; save a PNG at ``path``.

    Args:
      images: ``[n, H, W, C]`` (C = 1 or 3) with values in [0, 1] (other ranges are min-max scaled).
      heatmaps: ``[n, gh, gw]`` (e.g. from ``vit.attention_rollout``), each drawn with the
        ``inferno`` colour map from its minimum (black) to its maximum (pale yellow), upsampled
        bilinearly to the image size.
      path: output PNG file.
      titles: optional one title per image.
      alpha: opacity of the heat map over the image.

    Returns:
      ``path``.
    """
    images = _check_images(images, "plot_attention_maps")
    heatmaps = np.asarray(heatmaps, dtype=np.float32)
    if heatmaps.ndim != 3 or len(images) != len(heatmaps):
        raise ValueError(
            "plot_attention_maps: expected images [n, H, W, C] and heatmaps [n, gh, gw], got "
            f"shapes {images.shape} and {heatmaps.shape}"
        )
    plt = _pyplot()
    n = len(images)
    fig, axes = plt.subplots(2, n, figsize=(2 * n, 4.2), squeeze=False)
    extent = (0, images.shape[2], images.shape[1], 0)
    for i in range(n):
        image = images[i]
        if image.min() < 0.0 or image.max() > 1.0:
            image = (image - image.min()) / max(float(image.max() - image.min()), 1e-12)
        image = image[..., 0] if image.shape[-1] == 1 else image
        cmap = "gray" if image.ndim == 2 else None
        axes[0, i].imshow(image, cmap=cmap, vmin=0.0, vmax=1.0, extent=extent)
        axes[1, i].imshow(image, cmap=cmap, vmin=0.0, vmax=1.0, extent=extent)
        axes[1, i].imshow(
            heatmaps[i], cmap="inferno", alpha=alpha, extent=extent, interpolation="bilinear"
        )
        if titles is not None:
            axes[0, i].set_title(str(titles[i]), fontsize=9)
        for ax in axes[:, i]:
            ax.axis("off")
    fig.tight_layout()
    if storage.is_remote(path):
        buffer = io.BytesIO()
        fig.savefig(buffer, dpi=100, format="png")
        storage.write_atomic(path, buffer.getvalue())
    else:
        fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# matplotlib's default line colours, in its order: a panel's splits take them from the first.
LINE_COLOURS = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
)
PANEL = (450, 320)  # pixels of one metric's panel: 4.5 x 3.2 inches at 100 dpi
# The plot area inside a panel: left, top, right and bottom margins (tick labels, title, "step").
_MARGINS = (64, 30, 14, 46)
_SUPERSAMPLE = 2  # drawn at twice the size, then averaged down: smooth lines without antialiasing
_MARKER_RADIUS = 2.5 * _SUPERSAMPLE


def _ticks(low: float, high: float, integer: bool = False, count: int = 5):
    """Round tick values (1, 2, 2.5 or 5 times a power of ten apart, whole numbers where
    ``integer``) covering [low, high], the spacing nearest to ``count`` of them ->
    (values, spacing)."""
    raw = (high - low) / count
    power = 10.0 ** math.floor(math.log10(raw))
    factors = (1, 2, 5, 10) if integer else (1, 2, 2.5, 5, 10)
    spacing = min((f * power for f in factors), key=lambda d: abs(math.log(d / raw)))
    if integer:
        spacing = max(1.0, round(spacing))
    first, last = math.ceil(low / spacing - 1e-9), math.floor(high / spacing + 1e-9)
    return [0.0 if k == 0 else k * spacing for k in range(first, last + 1)], spacing


def _tick_label(value: float, spacing: float, largest: float) -> str:
    """Fixed point with the decimals the spacing needs (1200, 0.0025); powers of ten outside
    [1e-4, 1e6) (2.5e-05)."""
    half_digit = 1 if round(spacing / 10 ** math.floor(math.log10(spacing)), 6) == 2.5 else 0
    if 1e-4 <= largest < 1e6:
        decimals = max(0, -math.floor(math.log10(spacing)) + half_digit)
        return f"{value:.{decimals}f}"
    digits = math.floor(math.log10(largest)) - math.floor(math.log10(spacing)) + half_digit
    return f"{value:.{max(digits, 0)}e}" if value else "0"


def _limits(values, integer: bool = False) -> tuple[float, float]:
    """matplotlib's data limits: the range plus 5% each side; a single value gets a range
    around it."""
    low, high = min(values), max(values)
    if high == low:
        pad = 1.0 if integer or low == 0 else abs(low) * 0.05
        return low - pad, high + pad
    pad = 0.05 * (high - low)
    return low - pad, high + pad


def _segments(points: dict[int, float]) -> list[list[tuple[int, float]]]:
    """``{step: value}`` -> the runs of finite values in step order: a NaN or infinite value
    breaks the line, as in matplotlib."""
    segments: list[list[tuple[int, float]]] = [[]]
    for step in sorted(points):
        if math.isfinite(points[step]):
            segments[-1].append((step, points[step]))
        elif segments[-1]:
            segments.append([])
    return [segment for segment in segments if segment]


def _axis_labels(low: float, high: float, integer: bool = False, count: int = 5):
    """``_ticks`` with their labels -> [(value, label)]."""
    values, spacing = _ticks(low, high, integer, count)
    largest = max(abs(low), abs(high))
    return [(value, _tick_label(value, spacing, largest)) for value in values]


def _step_labels(draw, font, low: float, high: float, length: float, gap: float):
    """Step ticks whose labels, centred under them, stay ``gap`` apart on an axis ``length``
    pixels long: fewer ticks where the labels are long (a run resumed at a large step)."""
    for count in (5, 4, 3, 2):
        labels = _axis_labels(low, high, integer=True, count=count)
        if len(labels) < 2:
            return labels
        apart = (labels[1][0] - labels[0][0]) / (high - low) * length
        if max(draw.textlength(label, font=font) for _, label in labels) + gap <= apart:
            return labels
    return labels


def _marker(draw, x: float, y: float, colour) -> None:
    r = _MARKER_RADIUS
    draw.ellipse([x - r, y - r, x + r, y + r], fill=colour)


def _draw_axes(draw, font, origin, box, steps, to_x, to_y, y_labels):
    """Grid, ticks, tick labels and frame of the plot area ``box`` (left, top, right, bottom),
    whose x axis shows ``steps`` (low, high); ``to_x``, ``to_y``: data -> pixels."""
    s = _SUPERSAMPLE
    left, top, right, bottom = box
    grid, frame = (230, 230, 230), (60, 60, 60)
    for x, label in _step_labels(draw, font, *steps, right - left, 8 * s):
        at = to_x(x)
        draw.line([(at, top), (at, bottom)], fill=grid, width=s)
        draw.line([(at, bottom), (at, bottom + 4 * s)], fill=frame, width=s)
        # A label at the panel's edge moves inward, off the next panel and inside the picture.
        half = draw.textlength(label, font=font) / 2
        at = min(max(at, origin[0] + half + 2 * s), origin[0] + PANEL[0] * s - half - 2 * s)
        draw.text((at, bottom + 6 * s), label, fill="black", font=font, anchor="ma")
    for y, label in y_labels:
        at = to_y(y)
        draw.line([(left, at), (right, at)], fill=grid, width=s)
        draw.line([(left - 4 * s, at), (left, at)], fill=frame, width=s)
        draw.text((left - 6 * s, at), label, fill="black", font=font, anchor="rm")
    draw.rectangle([left, top, right, bottom], outline=frame, width=s)


def _draw_legend(draw, font, box, drawn, splits):
    """A line (and marker for eval) per split, then its name, in the corner of ``box`` that
    covers the fewest of the ``drawn`` points."""
    s = _SUPERSAMPLE
    left, top, right, bottom = box
    row, sample = 18 * s, 22 * s
    width = sample + 10 * s + max(draw.textlength(split, font=font) for split in splits)
    height = 6 * s + row * len(splits)
    corners = [
        (x, y)
        for y in (top + 6 * s, bottom - 6 * s - height)
        for x in (right - 6 * s - width, left + 6 * s)
    ]
    x0, y0 = min(
        corners,
        key=lambda c: sum(
            c[0] <= x <= c[0] + width and c[1] <= y <= c[1] + height for x, y in drawn
        ),
    )
    draw.rectangle(
        [x0, y0, x0 + width, y0 + height], fill="white", outline=(200, 200, 200), width=s
    )
    for i, (split, colour) in enumerate(zip(splits, LINE_COLOURS * len(splits))):
        y = y0 + 3 * s + row * i + row / 2
        x = x0 + 4 * s
        draw.line([(x, y), (x + sample, y)], fill=colour, width=2 * s)
        if split == "eval":
            _marker(draw, x + sample / 2, y, colour)
        draw.text((x + sample + 6 * s, y), split, fill="black", font=font, anchor="lm")


def _draw_panel(draw, fonts, origin, name: str, lines: dict[str, list[list[tuple[int, float]]]]):
    """One metric's panel at ``origin`` (supersampled pixels): axes, title, the ``lines``
    (split -> runs of finite (step, value) points) and their legend."""
    s = _SUPERSAMPLE
    small, large = fonts
    points = [p for segments in lines.values() for segment in segments for p in segment]
    if points:
        limits = (*_limits([x for x, _ in points], integer=True), *_limits([y for _, y in points]))
    else:
        limits = (0.0, 1.0, 0.0, 1.0)
    x_low, x_high, y_low, y_high = limits
    y_labels = _axis_labels(y_low, y_high)
    # Values that need many digits push the plot area right rather than off the panel.
    widest = max(draw.textlength(label, font=small) for _, label in y_labels)
    left = origin[0] + max(_MARGINS[0] * s, widest + 10 * s)
    top = origin[1] + _MARGINS[1] * s
    right = origin[0] + (PANEL[0] - _MARGINS[2]) * s
    bottom = origin[1] + (PANEL[1] - _MARGINS[3]) * s
    draw.text(((left + right) / 2, origin[1] + 16 * s), name, fill="black", font=large, anchor="mm")
    draw.text(((left + right) / 2, bottom + 34 * s), "step", fill="black", font=small, anchor="mm")
    to_x = lambda x: left + (x - x_low) / (x_high - x_low) * (right - left)  # noqa: E731
    to_y = lambda y: bottom - (y - y_low) / (y_high - y_low) * (bottom - top)  # noqa: E731
    box = (left, top, right, bottom)
    _draw_axes(draw, small, origin, box, (x_low, x_high), to_x, to_y, y_labels)
    for (split, segments), colour in zip(lines.items(), LINE_COLOURS * len(lines)):
        for segment in segments:
            xy = [(to_x(x), to_y(y)) for x, y in segment]
            if len(xy) > 1:
                draw.line(xy, fill=colour, width=2 * s, joint="curve")
            if split == "eval" or len(xy) == 1:  # a point alone would not show as a line
                for x, y in xy:
                    _marker(draw, x, y, colour)
    drawn = [(to_x(x), to_y(y)) for x, y in points]
    _draw_legend(draw, small, box, drawn, list(lines))


def plot_curves(records: list[dict], path) -> str | None:
    """One panel per metric against ``step``; returns ``path``, or None when nothing is plottable.

    Args:
      records: metric events such as ``{"step": 100, "train/loss": 0.5, "eval/loss": 0.6}``.
        Keys ``"<split>/<name>"`` are plotted: one panel per ``name`` (sorted, 3 to a row), one
        line per ``split`` in it (sorted, eval with markers). A step repeated in one series keeps
        its last value; a NaN or infinite value breaks its line (a point left alone gets
        a marker). Other keys are ignored.
      path: output PNG file.

    Drawn with PIL alone: every ``train.py`` run writes it at its end, where importing matplotlib
    and drawing a figure took longer than many short runs' training.
    """
    from PIL import Image, ImageDraw, ImageFont

    series: dict[str, dict[str, dict[int, float]]] = {}
    for record in records:
        if "step" not in record:
            raise ValueError(f"plot_curves: every record needs a 'step', got keys {sorted(record)}")
        for key, value in record.items():
            if "/" in key:
                split, name = key.split("/", 1)
                series.setdefault(name, {}).setdefault(split, {})[int(record["step"])] = float(
                    value
                )
    if not series:
        return None
    names = sorted(series)
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    s = _SUPERSAMPLE
    canvas = Image.new("RGB", (cols * PANEL[0] * s, rows * PANEL[1] * s), "white")
    draw = ImageDraw.Draw(canvas)
    fonts = (ImageFont.load_default(size=13 * s), ImageFont.load_default(size=16 * s))
    for i, name in enumerate(names):
        lines = {split: _segments(points) for split, points in sorted(series[name].items())}
        origin = ((i % cols) * PANEL[0] * s, (i // cols) * PANEL[1] * s)
        _draw_panel(draw, fonts, origin, name, lines)
    # The fastest compression: written at the end of every run, where time matters more than bytes.
    _write_png(canvas.reduce(s), path, compress_level=1)
    logging.info("wrote %s", os.fspath(path))
    return path
