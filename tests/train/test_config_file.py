"""attnjax/train/config_file.py: a ``--config`` that cannot be loaded, or an override it cannot
take, told in one line naming the file or the flag (real ``train.py`` and compile-command
processes)."""

import subprocess
import sys

from helpers import ROOT

CONFIG = "configs/prior_digits.py"
HINT = "; --verbose shows the traceback"
EXPECTED = "expected a Python file with a get_config(), as configs/*.py"


def error_line(tmp_path, command, *flags) -> str:
    """The last line of ``python *command *flags``'s error output, after checking that it
    failed with status 1, printed no traceback and made no workdir."""
    workdir = tmp_path / "run"
    run = subprocess.run(
        [sys.executable, *command, *flags], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 1, run.stderr[-2000:]
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    assert not workdir.exists()
    return run.stderr.strip().splitlines()[-1]


def train_py(tmp_path):
    return ["train.py", f"--workdir={tmp_path / 'run'}"]


def test_a_config_that_cannot_be_loaded_is_one_line_naming_the_file_and_line(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def get_config():\n    return undefined_name\n")
    missing = str(tmp_path / "missing.py")
    undefined = "line 2: NameError: name 'undefined_name' is not defined"
    compile_command = ["-m", "attnjax.compile", "--target=cpu"]
    cases = [  # (program, its command, the --config, the cause, its hint)
        ("train.py", train_py(tmp_path), missing, f"[Errno 2] No such file or directory: "
         f"{missing!r}", HINT),
        ("train.py", train_py(tmp_path), str(broken), undefined, HINT),
        ("attnjax.compile", compile_command, str(broken), undefined, ""),
    ]  # fmt: skip
    for program, command, path, cause, hint in cases:
        assert error_line(tmp_path, command, f"--config={path}") == (
            f"{program}: error: --config {path!r} could not be loaded: {cause} ({EXPECTED}{hint})"
        )


def test_an_override_of_a_field_the_config_lacks_is_one_line_naming_the_flag(tmp_path):
    close_match = '; Did you mean "batch_size" instead of "batchsize"?'  # ml_collections' own
    cases = [  # (the override, the missing key, the close match)
        ("--config.batchsize=3", "batchsize", close_match),
        ("--config.data.data_dir=/tmp", "data_dir", ""),  # the prior reads its VQGAN's data
    ]
    for override, key, close in cases:
        assert error_line(tmp_path, train_py(tmp_path), f"--config={CONFIG}", override) == (
            f"train.py: error: --{override.split('=')[0][2:]}: the config of {CONFIG} has no "
            f"field {key!r}{close} (an override sets a field the config's get_config() made{HINT})"
        )


def test_a_config_argument_get_config_does_not_take_or_a_missing_file_with_an_override(tmp_path):
    line = "train.py: error: --config {!r} could not be loaded: {} ({}{})"
    takes = "TypeError: get_config() takes 0 positional arguments but 1 was given"
    assert error_line(tmp_path, train_py(tmp_path), f"--config={CONFIG}:extra") == line.format(
        CONFIG, takes, EXPECTED, HINT
    )
    missing = str(tmp_path / "missing.py")
    flags = (f"--config={missing}", "--config.batch_size=3")
    assert error_line(tmp_path, train_py(tmp_path), *flags) == line.format(
        missing, f"[Errno 2] No such file or directory: {missing!r}", EXPECTED, HINT
    )
