"""demo.py's stage bookkeeping: a finished stage is reused, not retrained."""

import os

import pytest
from helpers import load_config, tiny_vit

import demo
from attnjax.ops import autotune
from attnjax.train import checkpoint


def test_a_finished_stage_is_reused_not_retrained(tmp_path):
    config = tiny_vit(
        load_config("vit_digits"),
        num_train_steps=3,
        log_every=3,
        eval_every=3,
        checkpoint_every=3,
        eval_batch_size=360,
    )
    workdir = str(tmp_path / "vit")
    assert checkpoint.latest_step(workdir) is None

    first = demo.run_stage("vit", config, workdir, previous={})
    assert not first["reused"] and checkpoint.latest_step(workdir) == 3
    assert 0.0 <= first["metrics"]["eval/accuracy"] <= 1.0
    checkpoint_files = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
    metrics_before = open(os.path.join(workdir, "metrics.jsonl")).read()

    previous = {"stages": {"vit": {"train_seconds": first["train_seconds"]}}}
    second = demo.run_stage("vit", config, workdir, previous=previous)
    assert second["reused"]
    assert second["train_seconds"] == first["train_seconds"], (
        "the reused stage reports its own run's time"
    )
    assert second["metrics"]["eval/accuracy"] == first["metrics"]["eval/accuracy"]
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == checkpoint_files
    assert open(os.path.join(workdir, "metrics.jsonl")).read() == metrics_before, (
        "nothing retrained"
    )


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="--samples_per_class"):
        demo.main(["--samples_per_class", "0"])
    with pytest.raises(ValueError, match="--train_steps must be >= 1, got 0"):
        demo.main(["--train_steps", "0"])


def test_short_stages_evaluate_and_save_at_their_last_step():
    for _, name in demo.STAGES:
        config = load_config(name)
        demo.shorten(config, 7)
        assert (config.num_train_steps, config.eval_every, config.checkpoint_every) == (7, 7, 7)
        assert config.log_every <= 7 and config.warmup_steps == 3


@pytest.mark.xdist_group("trained_runs")  # with the other readers of the trained runs
def test_completions_are_judged_by_the_vit_and_the_wide_sample_is_written(trained_runs, tmp_path):
    import jax
    import numpy as np
    from PIL import Image

    from attnjax.inference import generate
    from attnjax.tasks import classification

    runs = trained_runs
    vit_config, (_, predict) = (
        checkpoint.read_config(runs["vit"]),
        classification.make_predict(runs["vit"]),
    )
    path = str(tmp_path / "completions.png")
    fraction = demo.complete_and_classify(runs["prior"], vit_config, predict, 12, path, shown=4)
    # 3 rows (originals, kept rows, completions) of 4 digits of 8x8 pixels, at scale 4.
    assert np.asarray(Image.open(path)).shape == (4 * (3 * 9 + 1), 4 * (4 * 9 + 1))

    run = generate.load_prior(runs["prior"])
    completed = generate.complete_test_images(
        run, 12, 2, jax.random.key(run.config.seed + 2), **generate.sampling_settings(run)
    )
    vit_inputs = (np.clip(completed["completions"], 0, 1) - 0.5) / 0.5
    predicted = np.argmax(np.asarray(predict(vit_inputs)), -1)
    assert fraction == np.mean(predicted == completed["labels"])

    wide = str(tmp_path / "wide.png")
    assert demo.sliding_window_sample(runs["prior"], wide) == (4, 8)
    assert np.asarray(Image.open(wide)).shape == (4 * 10, 4 * 18)


def test_bad_completion_count_raises():
    with pytest.raises(ValueError, match="--completions must be >= 1, got 0"):
        demo.main(["--completions", "0"])


@pytest.mark.xdist_group("trained_runs")  # with the other readers of the trained runs
def test_domain_fids_are_pytorch_fids_distance_on_the_vits_pre_logits(trained_runs):
    """Each domain FID against pytorch-fid's ``calculate_frechet_distance`` of ``np.mean`` and
    ``np.cov`` of pre-logits computed here by the ViT itself."""
    import numpy as np
    from pytorch_fid.fid_score import calculate_frechet_distance

    from attnjax import data
    from attnjax.tasks import classification
    from attnjax.tasks import prior as prior_task

    vqgan = prior_task.load_vqgan(trained_runs["vqgan"])
    test_digits, reconstructions, _ = demo.reconstruct_test_digits(vqgan)
    samples = np.random.default_rng(0).random((40, *test_digits.shape[1:]), np.float32)
    fids = demo.domain_fids(trained_runs["vit"], vqgan, samples, reconstructions, test_digits)

    vit_config, variables = checkpoint.load(trained_runs["vit"], variables=())
    model = classification.create_model(vit_config)

    def statistics(pixels):
        inputs = data.normalize(np.clip(pixels, 0, 1), vit_config.data)
        features = np.asarray(model.apply(variables, inputs, return_aux=True)[1]["pre_logits"])
        return features.mean(0), np.cov(features, rowvar=False)

    to_pixels = lambda images: data.denormalize(images, vqgan.config.data)
    test = statistics(to_pixels(test_digits))
    train_digits, _ = prior_task.load_images(vqgan.config.data, "train[:40]", 0)
    expected = {
        "samples": (samples, 40),
        "reconstructions": (to_pixels(reconstructions), len(test_digits)),
        "train_digits": (to_pixels(train_digits), 40),
    }
    assert sorted(fids) == sorted(expected)
    for name, (images, count) in expected.items():
        reference = calculate_frechet_distance(*statistics(images), *test)
        assert fids[name]["n"] == count and fids[name]["n_reference"] == len(test_digits)
        assert fids[name]["fid"] == pytest.approx(reference, rel=1e-3), name
    assert fids["samples"]["fid"] > fids["train_digits"]["fid"], "noise is farther than digits"


def test_the_kernel_choices_are_fixed_unless_the_user_asks_for_timing(monkeypatch):
    # As in a fresh process: other tests of this worker may have set the switch for theirs.
    monkeypatch.setattr(autotune, "_enabled", None)
    monkeypatch.delenv(autotune.ENV_SWITCH, raising=False)
    assert autotune.enabled()
    demo.fixed_kernel_choices()
    assert not autotune.enabled()
    monkeypatch.setenv(autotune.ENV_SWITCH, "always")
    demo.fixed_kernel_choices()
    assert autotune.enabled() and autotune.times_everywhere()
