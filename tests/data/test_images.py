"""attnjax/images.py: grids and PNGs checked pixel by pixel, figures checked by their colours."""

import matplotlib
import numpy as np
import pytest
from PIL import Image

from attnjax.data import images

WHITE = 255


def _read(path) -> np.ndarray:
    return np.asarray(Image.open(path))


def test_image_grid_places_each_image_inside_a_white_border():
    pictures = np.stack([np.full((2, 3, 3), value) for value in (0.0, 0.5, 1.0)])
    pictures[1, 0, 0] = (1.5, -1.0, 0.25)  # out of range: clipped
    grid = images.image_grid(pictures, nrow=2)
    assert grid.dtype == np.uint8 and grid.shape == (2 * 3 + 1, 2 * 4 + 1, 3)
    expected = np.full((7, 9, 3), WHITE, np.uint8)
    expected[1:3, 1:4] = 0
    expected[1:3, 5:8] = 128  # round(0.5 * 255)
    expected[1, 5] = (255, 0, 64)
    expected[4:6, 1:4] = 255
    np.testing.assert_array_equal(grid, expected)  # the empty last cell stays white


def test_save_png_scales_by_nearest_neighbour(tmp_path):
    picture = np.arange(12, dtype=np.uint8).reshape(3, 4) * 20
    path = images.save_png(picture, tmp_path / "gray.png", scale=3)
    np.testing.assert_array_equal(_read(path), picture.repeat(3, 0).repeat(3, 1))
    rgb = np.random.default_rng(0).integers(0, 256, (2, 2, 3), dtype=np.uint8)
    np.testing.assert_array_equal(_read(images.save_png(rgb, tmp_path / "rgb.png")), rgb)


def test_save_image_grid_writes_the_grid_of_single_channel_images(tmp_path):
    pictures = np.random.default_rng(1).uniform(0, 1, (5, 4, 4, 1)).astype(np.float32)
    path = images.save_image_grid(pictures, tmp_path / "grid.png", nrow=3, scale=2)
    written = _read(path)
    assert written.ndim == 2, "one channel is written as a grayscale PNG"
    np.testing.assert_array_equal(
        written, images.image_grid(pictures, 3)[..., 0].repeat(2, 0).repeat(2, 1)
    )
    # Image 4 (row 1, column 1) starts at pixel (1 + 5, 1 + 5) of the unscaled grid.
    np.testing.assert_array_equal(written[12:20:2, 12:20:2], np.round(pictures[4, ..., 0] * 255))


def test_bad_pictures_raise_value_errors(tmp_path):
    with pytest.raises(
        ValueError, match=r"images must be \[n, height, width, channels\] .*got shape \(4, 4, 3\)"
    ):
        images.image_grid(np.zeros((4, 4, 3)), nrow=2)
    with pytest.raises(ValueError, match="nrow .* must be a positive int, got 0"):
        images.image_grid(np.zeros((1, 4, 4, 3)), nrow=0)
    with pytest.raises(ValueError, match="must be uint8 .*got float64"):
        images.save_png(np.zeros((4, 4)), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(ValueError, match="heatmaps \\[n, gh, gw\\]"):
        images.plot_attention_maps(np.zeros((2, 4, 4, 3)), np.zeros((3, 2, 2)), tmp_path / "m.png")
    with pytest.raises(ValueError, match="needs a 'step'"):
        images.plot_curves([{"train/loss": 1.0}], tmp_path / "c.png")


def _count_near(picture, colour, tolerance=3):
    distance = np.abs(picture[..., :3].astype(int) - np.asarray(colour)).max(axis=-1)
    return int((distance <= tolerance).sum())


def test_attention_maps_show_the_image_and_the_heat_map_over_it(tmp_path):
    red = np.zeros((1, 16, 16, 3), np.float32)
    red[..., 0] = 1.0
    heat = np.zeros((1, 4, 4), np.float32)
    heat[:, :, :2] = 1.0  # hot left half, cold right half
    path = images.plot_attention_maps(red, heat, tmp_path / "maps.png", alpha=0.6)
    picture = _read(path)
    inferno = matplotlib.colormaps["inferno"]
    blend = lambda value: np.round(
        255 * (0.6 * np.asarray(inferno(value)[:3]) + 0.4 * np.array([1, 0, 0]))
    )  # noqa: E731
    # The plain panel is pure red; in the overlay, the hot side shows inferno's top colour over
    # red and the cold side its bottom colour over red, each over most of a half panel (the
    # bilinear blend between them takes the rest).
    plain, hot, cold = (_count_near(picture, c) for c in ((255, 0, 0), blend(1.0), blend(0.0)))
    assert plain > 10_000 and abs(hot - cold) <= 0.05 * hot and 0.3 * plain < hot < 0.5 * plain, (
        plain,
        hot,
        cold,
    )
    top, bottom = picture[: len(picture) // 2], picture[len(picture) // 2 :]
    assert _count_near(top, (255, 0, 0)) == plain and _count_near(bottom, blend(1.0)) == hot


def test_plot_curves_draws_one_panel_per_metric_and_one_line_per_split(tmp_path):
    records = [{"step": s, "train/loss": 2.0 / (s + 1), "train/lr": 1e-3} for s in range(0, 50, 5)]
    records += [{"step": s, "eval/loss": 2.5 / (s + 1)} for s in (10, 30, 49)]
    path = images.plot_curves(records, tmp_path / "curves.png")
    picture = _read(path)
    height, width = picture.shape[:2]
    assert (width, height) == (900, 320), "two panels of 4.5 x 3.2 inches at 100 dpi"
    blue, orange = (31, 119, 180), (255, 127, 14)  # matplotlib's first two line colours
    loss, lr = picture[:, : width // 2], picture[:, width // 2 :]
    # "loss" has eval (first colour) and train (second); "lr" has train alone, in the first colour.
    assert _count_near(loss, blue, 10) > 50 and _count_near(loss, orange, 10) > 50
    assert _count_near(lr, blue, 10) > 50 and _count_near(lr, orange, 10) == 0
    assert images.plot_curves([{"step": 1, "epoch": 3}], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_plot_curves_breaks_lines_at_non_finite_values_and_marks_lone_points(tmp_path):
    def drawn(values, eval_points):
        records = [{"step": s, "train/loss": v} for s, v in values.items()]
        records += [{"step": s, **points} for s, points in eval_points.items()]
        return _read(images.plot_curves(records, tmp_path / "curves.png"))

    blue, orange = (31, 119, 180), (255, 127, 14)
    # Steps 0-3, train's value at step 1 NaN and at 3 infinite: a marker at 0 and a line from 2
    # to 3; without step 1's entry at all, one line from 0 to 3. The value axis is the same.
    broken = drawn({0: 1.0, 1: np.nan, 2: 3.0, 3: 4.0, 4: np.inf}, {4: {"eval/loss": 2.0}})
    whole = drawn({0: 1.0, 2: 3.0, 3: 4.0}, {4: {"eval/loss": 2.0}})
    lost = _count_near(whole[:, :450], orange, 10) - _count_near(broken[:, :450], orange, 10)
    assert lost > 200, lost  # the line from 0 to 2, less the marker at 0
    # The eval point alone is a marker: its colour beyond the legend's line and marker, which an
    # eval series with nothing finite draws alone in its own panel.
    picture = drawn({0: 1.0, 2: 3.0}, {2: {"eval/loss": 2.0, "eval/never": np.nan}})
    legend_only = _count_near(picture[:, 450:], blue, 10)
    assert legend_only > 20 and 10 < _count_near(picture[:, :450], blue, 10) - legend_only < 60


def test_curve_ticks_are_round_and_labelled_with_the_digits_they_need():
    assert images._ticks(-50.0, 1050.0, integer=True) == ([0, 200, 400, 600, 800, 1000], 200)
    values, spacing = images._ticks(-0.001, 0.021)
    assert spacing == 0.005 and np.allclose(values, [0, 0.005, 0.01, 0.015, 0.02])
    assert [images._tick_label(v, spacing, 0.021) for v in values] == [
        "0.000",
        "0.005",
        "0.010",
        "0.015",
        "0.020",
    ]
    assert images._tick_label(2.5e-5, 5e-6, 2.6e-5) == "2.5e-05"
    assert images._tick_label(0.0, 5e-6, 2.6e-5) == "0"
    assert images._tick_label(1200.0, 200.0, 1250.0) == "1200"


def test_plot_curves_fills_rows_of_three_and_leaves_the_cells_after_the_last_panel_white(
    tmp_path,
):
    records = [{"step": s, **{f"train/m{i}": float(s * i) for i in range(4)}} for s in range(5)]
    picture = _read(images.plot_curves(records, tmp_path / "curves.png"))
    assert picture.shape[:2] == (2 * 320, 3 * 450)
    blue = (31, 119, 180)
    for i in range(4):
        top, left = 320 * (i // 3), 450 * (i % 3)
        assert _count_near(picture[top : top + 320, left : left + 450], blue, 10) > 50, i
    assert (picture[320:, 450:] == WHITE).all()


def test_plot_curves_keeps_step_labels_apart_and_inside_the_picture(tmp_path):
    # A run resumed at step 1,000,000: long labels, which must neither overlap nor be cut off.
    records = [{"step": 10**6 + s, "train/loss": 1.0 / (s + 1)} for s in range(0, 1001, 50)]
    picture = _read(images.plot_curves(records, tmp_path / "curves.png"))
    band = picture[280:298]  # below the tick marks, above "step"
    dark = np.flatnonzero((band[..., :3].max(-1) < 128).any(0))
    # Columns holding text, split where more than 6 blank columns part them: one group a label.
    groups = np.split(dark, np.flatnonzero(np.diff(dark) > 6) + 1)
    widths = [int(g[-1] - g[0]) + 1 for g in groups]
    assert len(groups) >= 2 and max(widths) < 90, widths
    assert (band[:, -2:] == WHITE).all()


def test_curve_limits_pad_the_range_and_open_up_a_single_value():
    assert np.allclose(images._limits([1.0, 3.0]), (0.9, 3.1))
    assert np.allclose(images._limits([2.0, 2.0]), (1.9, 2.1))
    assert images._limits([0.0]) == (-1.0, 1.0)
    assert images._limits([7], integer=True) == (6, 8)


def _find(canvas, block):
    """The (row, column) of each place where ``block`` appears in ``canvas``."""
    rows, cols = np.nonzero(np.all(canvas == block[0, 0], axis=-1))
    h, w = block.shape[:2]
    return [
        (r, c) for r, c in zip(rows, cols) if np.array_equal(canvas[r : r + h, c : c + w], block)
    ]


def test_labelled_grid_shows_every_image_enlarged_under_its_label_red_where_alarmed(tmp_path):
    rng = np.random.default_rng(2)
    pictures = rng.integers(0, 256, (11, 8, 8, 1)).astype(np.float32) / 255.0
    alarms = [i % 3 == 0 for i in range(11)]
    path = images.save_labelled_grid(
        pictures,
        [f"{i}/{i % 4}" for i in range(11)],
        tmp_path / "g.png",
        nrow=4,
        title="predicted/true",
        alarms=alarms,
        cell=64,
    )
    canvas = _read(path)
    assert canvas.ndim == 3 and canvas.shape[-1] == 3
    for picture, alarm in zip(pictures, alarms):
        block = np.round(picture * 255).astype(np.uint8).repeat(8, 0).repeat(8, 1).repeat(3, -1)
        ((top, left),) = _find(canvas, block)  # each image once, 8x: 64 pixels
        label = canvas[top - 14 : top, left : left + 64].astype(int)
        red = (label[..., 0] > 180) & (label[..., 1] < 90) & (label[..., 2] < 90)
        dark = label.max(-1) < 100
        assert red.any() == alarm and (red | dark).any()  # every label drawn, red when alarmed
    assert (canvas[:14].max(-1) < 100).any()  # the title


def test_labelled_grid_refuses_labels_that_do_not_match_the_images(tmp_path):
    with pytest.raises(ValueError, match=r"3 images need 3 labels and alarms, got 2 and None"):
        images.save_labelled_grid(np.zeros((3, 4, 4, 3)), ["a", "b"], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
