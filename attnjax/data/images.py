"""Pictures of models and runs: image grids, PNG files, attention-map figures and metric curves.

Images are channels-last ``[n, height, width, channels]`` floats in [0, 1] (1 or 3 channels);
a written picture is a uint8 array ``[height, width, channels]``. Nothing here runs a model:
callers decode or sample first and pass the pixels. matplotlib and PIL are imported by the
functions that need them, so importing this module costs neither.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import numpy as np
from absl import logging


def _check_images(images, where: str) -> np.ndarray:
    images = np.asarray(images, np.float32)
    if images.ndim != 4 or images.shape[-1] not in (1, 3):
        raise ValueError(
            f"{where}: images must be [n, height, width, channels] with 1 or 3 channels, "
            f"got shape {images.shape}"
        )
    return images


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
    Image.fromarray(image[..., 0] if image.ndim == 3 and image.shape[-1] == 1 else image).save(path)
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
    canvas.save(path)
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
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_curves(records: list[dict], path) -> str | None:
    """One panel per metric against ``step``; returns ``path``, or None when nothing is plottable.

    Args:
      records: metric events such as ``{"step": 100, "train/loss": 0.5, "eval/loss": 0.6}``.
        Keys ``"<split>/<name>"`` are plotted: one panel per ``name`` (sorted), one line per
        ``split`` in it (sorted, eval with markers). A step repeated in one series keeps its
        last value. Other keys are ignored.
      path: output PNG file.
    """
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
    plt = _pyplot()
    names = sorted(series)
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    width, height = 4.5 * cols, 3.2 * rows
    fig, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False)
    # Margins in inches fit the titles and tick labels; tight_layout measured every text first
    # and took as long as drawing the figure.
    fig.subplots_adjust(
        left=0.7 / width,
        right=1 - 0.2 / width,
        bottom=0.5 / height,
        top=1 - 0.35 / height,
        wspace=0.3,
        hspace=0.55,
    )
    for ax, name in zip(axes.flat, names):
        for split, points in sorted(series[name].items()):
            steps = sorted(points)
            ax.plot(
                steps,
                [points[s] for s in steps],
                marker="o" if split == "eval" else None,
                markersize=3,
                label=split,
            )
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.legend()
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    logging.info("wrote %s", os.fspath(path))
    return path
