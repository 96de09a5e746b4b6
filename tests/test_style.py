"""The house style, kept by the suite: ruff's formatter and linter (settings in pyproject.toml,
one line length of 100) and no module over 500 lines in the code a reader opens."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECKED = ("attnjax", "tests", "benchmarks", "configs", "demo.py", "train.py")
MAX_LINES = 500  # a reader finds any concept in one file and reads it in one sitting


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *CHECKED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_code_is_formatted():
    result = _ruff("format", "--check", "--quiet")
    assert result.returncode == 0, f"run `ruff format`:\n{result.stdout}{result.stderr}"


def test_code_passes_the_linter():
    result = _ruff("check", "--output-format", "concise", "--quiet")
    assert result.returncode == 0, f"`ruff check` found:\n{result.stdout}{result.stderr}"


def test_no_file_is_over_500_lines():
    long = {
        str(path.relative_to(ROOT)): count
        for folder in ("attnjax", "tests", "benchmarks")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (count := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines (split them by concept): {long}"
