"""Where the suite's CPU goes: seconds per test file and per test, in the test's own process and in
the processes it starts (train.py runs, launchers, notebook kernels), from one run of the suite as
`make test` runs it.

    python benchmarks/suite_cpu.py [--md benchmarks/results/suite_cpu.md]
                                   [--json benchmarks/results/suite_cpu.json] [PYTEST ARGS]

On a 2-core machine the suite is bound by its CPU seconds (both workers busy to the end), so
these, not the wall time of a test beside another one, say what a change saves. Around each test
(setup, call and teardown: a module fixture counts in the first test that uses it) every worker
reads getrusage for itself and for its children that have ended (the processes a test waits for;
a process killed and reaped counts too). PYTEST ARGS replace the default selection
(``-m "not cuda" tests``).

Beside the CPU, JAX's own account of its stages (``jax.monitoring``'s durations): wall seconds
spent tracing, lowering to MLIR and compiling in XLA, the count of programs compiled, and how many
the persistent compilation cache answered; for the test's own process and, through
``suite_cpu_site/sitecustomize.py`` on the workers' ``PYTHONPATH``, for each Python process a test
starts that ends by returning (one killed by a signal or ended by ``os._exit``, or started with a
``PYTHONPATH`` of its own, leaves no account: its CPU is in the processes column, its stages are
not).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import pytest

from attnjax.ops.platform import cpu_cores, processor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = "SUITE_CPU_DIR"  # where each worker writes its rows (set by main for the workers)
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "suite_cpu_site")
sys.path.insert(0, SITE)
import suite_cpu_stages as stages  # noqa: E402  (JAX's stage durations in this process)

if hasattr(sys.modules.get("sitecustomize"), "REPORTED_BY_PLUGIN"):  # ours: rows report this one
    sys.modules["sitecustomize"].REPORTED_BY_PLUGIN = True

_rows: list[dict] = []


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    own, children = _cpu()
    before = stages.snapshot()
    start = time.monotonic()
    yield
    own_after, children_after = _cpu()
    own_stages = stages.difference(stages.snapshot(), before)
    _rows.append(
        dict(
            test=stages.test_name(item.nodeid),
            wall=time.monotonic() - start,
            own=own_after - own,
            children=children_after - children,
            worker=os.environ.get("PYTEST_XDIST_WORKER", "main"),
            stages=own_stages,
        )
    )


def pytest_sessionfinish(session):
    if os.environ.get(OUT_DIR):
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(os.environ[OUT_DIR], f"{worker}.json"), "w") as f:
            json.dump(_rows, f)


def _table(rows, key, limit):
    grouped = collections.defaultdict(
        lambda: dict(own=0.0, children=0.0, wall=0.0, tests=0, **dict.fromkeys(stages.FIELDS, 0.0))
    )
    for row in rows:
        entry = grouped[key(row)]
        for field in ("own", "children", "wall"):
            entry[field] += row[field]
        for field, seconds in _stages(row).items():
            entry[field] += seconds
        entry["tests"] += 1
    ordered = sorted(grouped.items(), key=lambda kv: -(kv[1]["own"] + kv[1]["children"]))
    return [dict(name=name, **{k: round(v, 1) for k, v in e.items()}) for name, e in ordered][
        :limit
    ]


def _markdown(result) -> str:
    total = result["cpu_seconds"]
    lines = [
        "# The suite's CPU seconds",
        "",
        f"`python benchmarks/suite_cpu.py`: {result['command']}; {result['machine']}; "
        f"{result['tests']} tests, exit status {result['status']}.",
        "",
        f"pytest wall {result['wall_seconds']:.1f} s; CPU in the tests {total:.1f} s "
        f"(own {result['own_seconds']:.1f}, their processes {result['children_seconds']:.1f}); "
        f"per worker: "
        + ", ".join(f"{w} {s:.1f} s" for w, s in sorted(result["per_worker"].items()))
        + ". Outside the tests (start-up, collection, the workers' exits): "
        f"{result['outside_tests_seconds']:.1f} s of wall time.",
    ]
    jax_stages, accounted = result["stages"], result["accounted_processes"]
    lines += [
        "",
        "JAX's stages (`jax.monitoring`: wall seconds inside each, summed over threads, waits "
        f"for a core included), in the tests' own processes and in the {accounted['processes']} "
        f"processes they started that reported at exit ({accounted['cpu']:.1f} s of the "
        f"processes' {result['children_seconds']:.1f} s of CPU; a killed process, or one started "
        f"with its own PYTHONPATH, leaves no account): tracing {jax_stages['tracing']:.1f} s, "
        f"lowering {jax_stages['lowering']:.1f} s, compiling {jax_stages['compiling']:.1f} s "
        f"({jax_stages['programs']:.0f} programs, "
        f"{jax_stages['cache_hits']:.0f} of them read from the persistent compilation cache).",
    ]
    for title, rows in (("test file", result["files"]), ("test", result["slowest"])):
        lines += [
            "",
            f"| {title} | CPU (s) | share | own | processes | wall (s) | tests | tracing | "
            "lowering | compiling | programs |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            cpu = row["own"] + row["children"]
            lines.append(
                f"| {row['name']} | {cpu:.1f} | {cpu / total:.1%} | {row['own']:.1f} | "
                f"{row['children']:.1f} | {row['wall']:.1f} | {row['tests']} | "
                f"{row['tracing']:.1f} | {row['lowering']:.1f} | {row['compiling']:.1f} | "
                f"{row['programs']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def _stages(row) -> dict:
    """A row's JAX stages: its test's own process and the processes it started together."""
    return {f: row["stages"][f] + row["process_stages"][f] for f in stages.FIELDS}


def collect(out: str) -> tuple[list[dict], list[dict]]:
    """The workers' rows, each with ``process_stages`` summed over the accounts of the processes
    its test started, and those accounts -> ``(rows, accounts)``."""
    rows, accounts = [], []
    for name in sorted(os.listdir(out)):
        with open(os.path.join(out, name)) as f:
            if name.startswith("process-"):
                accounts.append(json.load(f))
            else:
                rows.extend(json.load(f))
    by_test = collections.defaultdict(lambda: dict.fromkeys(stages.FIELDS, 0.0))
    for account in accounts:
        for field in stages.FIELDS:
            by_test[account["test"]][field] += account["stages"][field]
    for row in rows:
        row["process_stages"] = {k: round(v, 3) for k, v in by_test[row["test"]].items()}
    return rows, accounts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--md", default=os.path.join(ROOT, "benchmarks/results/suite_cpu.md"))
    parser.add_argument("--json", default=os.path.join(ROOT, "benchmarks/results/suite_cpu.json"))
    args, selection = parser.parse_known_args(argv)
    selection = selection or ["-m", "not cuda", "tests"]
    command = ["-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "suite_cpu", *selection]
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, **{OUT_DIR: out})
        # The plugin's folder for pytest, SITE for every Python process the suite starts.
        here = os.path.dirname(os.path.abspath(__file__))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, SITE, env.get("PYTHONPATH")]))
        start = time.monotonic()
        status = subprocess.run([sys.executable, *command], cwd=ROOT, env=env).returncode
        wall = time.monotonic() - start
        rows, processes = collect(out)
    if not rows:
        print(f"suite_cpu: no test ran (pytest exit status {status})", file=sys.stderr)
        return 1
    worker_cpu, worker_wall = collections.Counter(), collections.Counter()
    for row in rows:
        worker_cpu[row["worker"]] += row["own"] + row["children"]
        worker_wall[row["worker"]] += row["wall"]
    own = sum(row["own"] for row in rows)
    children = sum(row["children"] for row in rows)
    totals = {field: round(sum(_stages(row)[field] for row in rows), 1) for field in stages.FIELDS}
    result = dict(
        command="python " + " ".join(command),
        machine=f"{processor()}, {cpu_cores()} cores",
        status=status,
        tests=len(rows),
        wall_seconds=round(wall, 1),
        cpu_seconds=round(own + children, 1),
        own_seconds=round(own, 1),
        children_seconds=round(children, 1),
        per_worker={w: round(s, 1) for w, s in worker_cpu.items()},
        stages=totals,
        accounted_processes=dict(
            processes=len(processes), cpu=round(sum(p["cpu"] for p in processes), 1)
        ),
        outside_tests_seconds=round(wall - max(worker_wall.values()), 1),
        files=_table(rows, lambda r: r["test"].split("::")[0], 40),
        slowest=_table(rows, lambda r: r["test"], 30),
        rows=rows,
    )
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    with open(args.md, "w") as f:
        f.write(_markdown(result))
    print(_markdown(result))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
