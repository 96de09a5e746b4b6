"""benchmarks/suite_cpu.py's account of JAX's stages: a process started under a test reports its
tracing, lowering and compiles at exit, under that test, and the rows add them up."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import suite_cpu  # noqa: E402

# Two programs: a jitted function of two operations, then the same function at a new shape.
PROGRAM = (
    "import jax, jax.numpy as jnp\n"
    "f = jax.jit(lambda x: jnp.sin(x) * 2)\n"
    "f(jnp.zeros(3, jnp.float32)).block_until_ready()\n"
    "f(jnp.zeros(4, jnp.float32)).block_until_ready()\n"
)


def test_a_started_process_reports_its_stages_under_its_test(tmp_path):
    test = "tests/x.py::test_y@group (call)"
    env = dict(os.environ, SUITE_CPU_DIR=str(tmp_path), PYTEST_CURRENT_TEST=test)
    env["PYTHONPATH"] = os.pathsep.join([suite_cpu.SITE, env.get("PYTHONPATH", "")])
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # no cache: both programs are compiled here
    subprocess.run([sys.executable, "-c", PROGRAM], env=env, check=True, timeout=120)
    # A process outside any test writes nothing.
    env.pop("PYTEST_CURRENT_TEST")
    subprocess.run([sys.executable, "-c", "import sitecustomize"], env=env, check=True, timeout=60)

    (account,) = [json.loads(p.read_text()) for p in tmp_path.glob("process-*.json")]
    assert account["test"] == "tests/x.py::test_y"
    stages = account["stages"]
    # jnp.zeros' own programs compile too; the jitted function's two shapes at least.
    assert stages["programs"] >= 2 and stages["cache_hits"] == 0, stages
    assert stages["tracing"] > 0 and stages["lowering"] > 0 and stages["compiling"] > 0, stages
    assert 0 < stages["tracing"] + stages["lowering"] + stages["compiling"] < account["cpu"] + 1

    row = dict(test="tests/x.py::test_y", own=0.0, children=1.0, wall=1.0, worker="gw0")
    (tmp_path / "gw0.json").write_text(json.dumps([dict(row, stages=dict(stages))]))
    rows, accounts = suite_cpu.collect(str(tmp_path))
    assert accounts == [account]
    assert rows[0]["process_stages"] == {k: round(v, 3) for k, v in stages.items()}
    (file_row,) = suite_cpu._table(rows, lambda r: r["test"].split("::")[0], 10)
    assert file_row["programs"] == 2 * stages["programs"]  # the own process's and the started one's


def test_a_stage_nested_in_another_counts_once(monkeypatch):
    stages = suite_cpu.stages
    # Real traces this worker ran earlier on this thread must not fall inside the made-up ones.
    monkeypatch.setattr(stages, "_outermost", {})
    monkeypatch.setattr(stages, "_totals", dict.fromkeys(stages.FIELDS, 0.0))
    trace = next(e for e, stage in stages.STAGES.items() if stage == "tracing")
    before = stages.snapshot()
    stages._on_duration(trace, 0.5)  # an inner trace, ending now
    stages._on_duration(trace, 2.0)  # the trace around it, ending a moment later
    stages._on_duration(trace, 0.25)  # one that does not contain the last: counted as well
    added = stages.difference(stages.snapshot(), before)
    assert abs(added["tracing"] - 2.25) < 0.01, added
