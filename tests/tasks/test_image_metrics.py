"""attnjax/tasks/image_metrics.py: the ``config.fid`` fields are checked before any training."""

import os

import pytest
from helpers import load_config, tiny_vqgan_config

from attnjax.tasks import image_metrics, train_and_evaluate


def test_no_network_named_is_no_fid():
    config = load_config("vqgan_digits")
    assert not image_metrics.enabled(config)
    image_metrics.check_config(config)
    del config["fid"]  # a config written before the field existed
    assert not image_metrics.enabled(config)


def test_each_bad_field_is_one_line_naming_it(tmp_path):
    weights = tmp_path / "inception.npz"
    weights.write_bytes(b"")
    cases = [
        (dict(inception=str(weights), classifier=str(tmp_path)), "name one feature network"),
        (dict(inception=str(tmp_path / "missing.npz")), "config.fid.inception="),
        (dict(classifier=str(tmp_path / "no_run")), "config.fid.classifier="),
        (dict(inception=str(weights), dims=100), "config.fid.dims=100"),
        (dict(inception=str(weights), num_images=1), "config.fid.num_images=1"),
        (dict(classifier=str(tmp_path), batch_size=0), "config.fid.batch_size=0"),
    ]
    for fields, message in cases:
        config = load_config("prior_digits")
        config.fid.update(fields)
        with pytest.raises(ValueError, match=message) as raised:
            image_metrics.check_config(config)
        assert "\n" not in str(raised.value)


def test_a_training_run_with_a_bad_field_stops_before_writing(digits_dir, tmp_path):
    config = tiny_vqgan_config(digits_dir)
    config.fid.inception = str(tmp_path / "missing.npz")
    workdir = tmp_path / "run"
    with pytest.raises(ValueError, match="missing.npz"):
        train_and_evaluate(config, str(workdir))
    assert not os.path.exists(workdir) or not os.listdir(workdir)
