"""docs/own_images.md: its commands, as written, on the digits written as a folder of PNG files
(tiny models, 2 steps, an FID of few images): every stage trains, samples are written and an FID
printed, and the folder is byte for byte what it was."""

import os
import re
import shlex

import pytest
from absl import flags
from helpers import ROOT, TINY_RUN_SCHEDULE, tiny_vit_flags, write_digits_folder
from ml_collections import config_flags

from attnjax import fid
from attnjax.data import prepare
from attnjax.inference import generate
from attnjax.tasks import train_and_evaluate

pytestmark = [
    pytest.mark.xdist_group("trained_runs"),
    # ml_collections' config_flags loads a config file as train.py does, with load_module.
    pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning"),
]

STEPS = 2
# Logged, evaluated and saved once, at the end.
SCHEDULE = [
    f"--config.{k}={v}"
    for k, v in dict(
        num_train_steps=STEPS,
        warmup_steps=1,
        log_every=STEPS,
        eval_every=STEPS,
        checkpoint_every=STEPS,
    ).items()
]
BATCHES = [f"--config.{k}={TINY_RUN_SCHEDULE[k]}" for k in ("batch_size", "eval_batch_size")]
# Test images written, the FID's real images: Inception at 299 x 299 on each is most of what the
# two FID commands cost.
TEST_IMAGES = 24
# What each command gets appended: tiny models, 2 steps, few samples.
TINY = {
    "configs/vit_folder.py": [*tiny_vit_flags(), *SCHEDULE],
    "configs/vqgan_folder.py": [
        *SCHEDULE,
        *BATCHES,
        "--config.model.ddconfig.ch=32",
        "--config.model.ddconfig.num_res_blocks=1",
        "--config.model.ddconfig.z_channels=8",
        "--config.model.n_embed=16",
        "--config.model.embed_dim=8",
    ],
    "configs/prior_folder.py": [
        *SCHEDULE,
        *BATCHES,
        "--config.model.n_layer=1",
        "--config.model.n_head=2",
        "--config.model.n_embd=16",
        "--config.sampling.top_k=8",  # of the tiny VQGAN's 16 codes
        "--config.sampling.per_class=2",
    ],
    "attnjax.fid": ["--dims=64", "--no-progress"],
    "attnjax.inference.generate": ["--dims=64", "--number=16"],
}


def page_commands():
    """The ``python ...`` commands of the page's code blocks, continuation lines joined."""
    with open(os.path.join(ROOT, "docs", "own_images.md")) as page:
        blocks = re.findall(r"```\n(.*?)```", page.read(), flags=re.S)
    return [
        line
        for block in blocks
        for line in block.replace("\\\n", " ").splitlines()
        if line.startswith("python ")
    ]


def train(argv):
    values = flags.FlagValues()
    argv = ["train.py", *argv]
    config_flags.DEFINE_config_file("config", None, flag_values=values, sys_argv=argv)
    flags.DEFINE_string("workdir", None, "", flag_values=values)
    values(argv)
    return train_and_evaluate(values.config, values.workdir)


def snapshot(root):
    return {
        path: (path.read_bytes(), path.stat().st_mtime_ns)
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def test_the_pages_commands_train_every_stage_sample_and_print_an_fid(
    digits_dir, inception_weights, tmp_path, capsys, monkeypatch
):
    images = write_digits_folder(digits_dir, tmp_path / "digits_png", test_images=TEST_IMAGES)
    before = snapshot(tmp_path / "digits_png")
    monkeypatch.chdir(tmp_path)
    os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")
    commands = page_commands()
    assert [c.split()[1:3] for c in commands] == [
        ["train.py", "--config"],
        ["train.py", "--config"],
        ["train.py", "--config"],
        ["-m", "attnjax.inference.generate"],
        ["-m", "attnjax.fid"],
        ["-m", "attnjax.data.prepare"],
    ]
    for command in commands:
        argv = shlex.split(command.replace("$IMAGES", images))[1:]
        argv = [inception_weights["npz"] if a == "inception.npz" else a for a in argv]
        if argv[0] == "train.py":
            metrics = train(argv[1:] + TINY[argv[2]])
            assert metrics["step"] == STEPS
        elif argv[1] == "attnjax.inference.generate":
            assert os.path.isfile(generate.main(argv[2:] + TINY[argv[1]]))
        elif argv[1] == "attnjax.fid":
            assert fid.main(argv[2:] + TINY[argv[1]]) == 0
            last = capsys.readouterr().out.splitlines()[-1]
            assert re.fullmatch(r"FID: \d+\.\d+(e[-+]\d+)?", last), last
        else:
            assert prepare.main(argv[2:]) == 0
    assert os.path.isfile(tmp_path / "runs" / "own" / "samples.png")
    assert snapshot(tmp_path / "digits_png") == before
