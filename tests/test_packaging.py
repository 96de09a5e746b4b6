"""What attnjax declares to pip: ranges for the runtime, so that it installs beside the JAX a
user already has; exact versions only in the dev/CI environment's constraints files (envs/)."""

import importlib.metadata
import json
import pathlib
import shutil
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The libraries that follow JAX's releases: their floors are the versions the pinned
# environment tests.
JAX_STACK = ("jax", "flax", "optax", "orbax-checkpoint", "chex", "grain", "tensorflow-datasets")


def _project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _pins(path: pathlib.Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            requirement = Requirement(line)
            (specifier,) = requirement.specifier
            assert specifier.operator == "==", f"{path.name}: {line!r} is not an exact pin"
            pins[_normalised(requirement.name)] = specifier.version
    return pins


def _normalised(name: str) -> str:
    return name.lower().replace("_", "-")


def test_runtime_dependencies_are_ranges_with_the_tested_floors():
    lock = _pins(ROOT / "envs" / "lock-py311.txt")
    requirements = {_normalised(r.name): r for r in map(Requirement, _project()["dependencies"])}
    pinned = [str(r) for r in requirements.values() if any(s.operator == "==" for s in r.specifier)]
    assert not pinned, f"runtime pins in pyproject.toml (ranges only; pins go to envs/): {pinned}"
    for name in JAX_STACK:
        floors = [s.version for s in requirements[name].specifier if s.operator == ">="]
        assert floors == [lock[name]], (
            f"pyproject.toml: {name}'s floor {floors} is not the version the pinned environment "
            f"tests, {lock[name]} (envs/lock-py311.txt)"
        )


def test_tool_pins_are_the_locks():
    lock = _pins(ROOT / "envs" / "lock-py311.txt")
    tools = _pins(ROOT / "envs" / "tools.txt")
    differing = {name: (version, lock.get(name)) for name, version in tools.items()}
    differing = {name: pair for name, pair in differing.items() if pair[0] != pair[1]}
    assert not differing, f"envs/tools.txt and envs/lock-py311.txt disagree: {differing}"


def test_installing_attnjax_keeps_the_jax_this_environment_has(tmp_path):
    """pip, offline, asked to install attnjax into this environment: it installs attnjax alone,
    keeping whatever jax is here (0.10.2 in the pinned environment, the newest in
    `make test-newest`'s). Were a declared range to exclude it, pip would need another jax and,
    offline, fail."""
    source = tmp_path / "attnjax-source"
    source.mkdir()
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, source / part)
    for package in ("attnjax", "configs"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__py*"))
    report = tmp_path / "report.json"
    result = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "install", "--dry-run", "--no-index"),
            *("--no-build-isolation", "--quiet", "--report", str(report), str(source)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"pip could not install attnjax here:\n{result.stderr}"
    installs = {
        item["metadata"]["name"]: item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert installs == {"attnjax": _project()["version"]}, (
        f"pip would install {installs} besides attnjax; jax here is "
        f"{importlib.metadata.version('jax')}"
    )
