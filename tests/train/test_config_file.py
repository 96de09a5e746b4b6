"""attnjax/train/config_file.py: what a ``--config`` and its overrides cannot do, told in one
line naming the flag or the file (real ``train.py`` processes; a file that cannot be loaded at
all: tests/train/test_faults.py)."""

import subprocess
import sys

from helpers import ROOT

CONFIG = "configs/prior_digits.py"
HINT = "; --verbose shows the traceback"


def train_py(tmp_path, *flags) -> str:
    """The last line of ``train.py``'s error output for ``flags``, after checking that it failed
    with status 1, printed no traceback and made no workdir."""
    workdir = tmp_path / "run"
    run = subprocess.run(
        [sys.executable, "train.py", f"--workdir={workdir}", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stderr[-2000:]
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    assert not workdir.exists()
    return run.stderr.strip().splitlines()[-1]


def test_an_override_of_a_field_the_config_lacks_is_one_line_naming_the_flag(tmp_path):
    close_match = '; Did you mean "batch_size" instead of "batchsize"?'  # ml_collections' own
    cases = [  # (the override, the missing key, the close match)
        ("--config.batchsize=3", "batchsize", close_match),
        ("--config.data.data_dir=/tmp", "data_dir", ""),  # the prior reads its VQGAN's data
    ]
    for override, key, close in cases:
        assert train_py(tmp_path, f"--config={CONFIG}", override) == (
            f"train.py: error: --{override.split('=')[0][2:]}: the config of {CONFIG} has no "
            f"field {key!r}{close} (an override sets a field the config's get_config() made{HINT})"
        )


def test_a_config_argument_get_config_does_not_take_or_a_missing_file_with_an_override(tmp_path):
    expected = (
        "train.py: error: --config {!r} could not be loaded: {} (expected a Python file with a "
        f"get_config(), as configs/*.py{HINT})"
    )
    takes = "TypeError: get_config() takes 0 positional arguments but 1 was given"
    assert train_py(tmp_path, f"--config={CONFIG}:extra") == expected.format(CONFIG, takes)
    missing = str(tmp_path / "missing.py")
    assert train_py(tmp_path, f"--config={missing}", "--config.batch_size=3") == expected.format(
        missing, f"[Errno 2] No such file or directory: {missing!r}"
    )
