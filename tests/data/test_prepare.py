"""attnjax/data/prepare.py and shards.py: a folder as ArrayRecord shards gives the folder's
batches; a prepare killed with SIGKILL and rerun writes the uninterrupted run's files."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
from helpers import ROOT, load_config

from attnjax import data
from attnjax.data import prepare, shards


def _files(directory):
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


def test_shards_give_the_batches_of_the_folder(digits_folder, tmp_path, capsys):
    out = tmp_path / "shards"
    assert prepare.main([f"folder:{digits_folder}", str(out), "--records_per_shard=500"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "train: 1437 images in 3 shards",
        "test: 360 images in 1 shards",
    ]
    metadata = shards.read_metadata(str(out))
    assert metadata["classes"] == [str(digit) for digit in range(10)]
    configs = [load_config("vit_digits") for _ in range(2)]
    configs[0].data.name, configs[1].data.name = f"folder:{digits_folder}", f"shards:{out}"
    from_folder, from_shards = (data.make_datasets(config) for config in configs)
    ours, theirs = data.make_iterator(from_shards.train), data.make_iterator(from_folder.train)
    for _ in range(20):
        got, want = next(ours), next(theirs)
        np.testing.assert_array_equal(got["image"], want["image"])
        np.testing.assert_array_equal(got["label"], want["label"])
    for got, want in zip(
        data.make_iterator(from_shards.eval), data.make_iterator(from_folder.eval)
    ):
        np.testing.assert_array_equal(got["image"], want["image"])
    # Run again on finished shards: nothing is rewritten.
    before = _files(out)
    assert prepare.main([f"folder:{digits_folder}", str(out), "--records_per_shard=500"]) == 0
    assert _files(out) == before


def test_a_killed_prepare_rerun_writes_the_uninterrupted_files(digits_folder, tmp_path):
    command = [sys.executable, "-m", "attnjax.data.prepare", f"folder:{digits_folder}"]
    flags = ["--records_per_shard=40"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert prepare.main([f"folder:{digits_folder}", str(whole), *flags]) == 0

    proc = subprocess.Popen([*command, str(killed), *flags], cwd=ROOT, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if killed.is_dir() and any(name.endswith(".array_record") for name in os.listdir(killed)):
            break
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-2000:]
    kept = {name for name in os.listdir(killed) if name.endswith(".array_record")}
    assert kept and not (killed / shards.METADATA).exists()
    written = {name: os.stat(killed / name).st_mtime_ns for name in kept}

    rerun = subprocess.run([*command, str(killed), *flags], cwd=ROOT, capture_output=True)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert {name: os.stat(killed / name).st_mtime_ns for name in kept} == written  # kept as is
    assert _files(killed) == _files(whole)


def test_prepare_errors_are_one_line_naming_the_file(tmp_path, capsys):
    (tmp_path / "photos" / "train").mkdir(parents=True)
    (tmp_path / "photos" / "test").mkdir()
    (tmp_path / "photos" / "train" / "a.jpg").write_text("not a picture")
    (tmp_path / "photos" / "test" / "b.jpg").write_text("not a picture")
    assert prepare.main([str(tmp_path / "photos"), str(tmp_path / "out")]) == 1
    last = capsys.readouterr().err.splitlines()[-1]  # after the progress bar's
    assert last.startswith("prepare: error: ") and "a.jpg' is not an image" in last, last
    assert not (tmp_path / "out" / shards.METADATA).exists()
