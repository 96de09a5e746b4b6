"""The suite's warning filters (pyproject.toml): a deprecation fails a test, so what the next
release of jax, flax, optax, orbax, grain or numpy removes is seen while it still works."""

import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_deprecation_fails_the_test_that_meets_it(tmp_path):
    planted = tmp_path / "test_planted.py"
    planted.write_text(
        textwrap.dedent("""
            import warnings

            def deprecated_call():
                warnings.warn("planted: use the new call", DeprecationWarning, stacklevel=2)

            def test_meets_a_deprecation():
                deprecated_call()

            def test_meets_none():
                pass
        """)
    )
    result = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml")),
            *("--rootdir", str(tmp_path), "-p", "no:cacheprovider", "-n", "0", str(planted)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout
    assert "1 failed, 1 passed" in result.stdout, result.stdout
    assert "DeprecationWarning: planted: use the new call" in result.stdout, result.stdout
