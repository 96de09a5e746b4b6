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
_rows: list[dict] = []


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    own, children = _cpu()
    start = time.monotonic()
    yield
    own_after, children_after = _cpu()
    _rows.append(
        dict(
            test=item.nodeid.split("@")[0],
            wall=time.monotonic() - start,
            own=own_after - own,
            children=children_after - children,
            worker=os.environ.get("PYTEST_XDIST_WORKER", "main"),
        )
    )


def pytest_sessionfinish(session):
    if os.environ.get(OUT_DIR):
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(os.environ[OUT_DIR], f"{worker}.json"), "w") as f:
            json.dump(_rows, f)


def _table(rows, key, limit):
    grouped = collections.defaultdict(lambda: dict(own=0.0, children=0.0, wall=0.0, tests=0))
    for row in rows:
        entry = grouped[key(row)]
        for field in ("own", "children", "wall"):
            entry[field] += row[field]
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
    for title, rows in (("test file", result["files"]), ("test", result["slowest"])):
        lines += [
            "",
            f"| {title} | CPU (s) | share | own | processes | wall (s) | tests |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            cpu = row["own"] + row["children"]
            lines.append(
                f"| {row['name']} | {cpu:.1f} | {cpu / total:.1%} | {row['own']:.1f} | "
                f"{row['children']:.1f} | {row['wall']:.1f} | {row['tests']} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--md", default=os.path.join(ROOT, "benchmarks/results/suite_cpu.md"))
    parser.add_argument("--json", default=os.path.join(ROOT, "benchmarks/results/suite_cpu.json"))
    args, selection = parser.parse_known_args(argv)
    selection = selection or ["-m", "not cuda", "tests"]
    command = ["-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "suite_cpu", *selection]
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, **{OUT_DIR: out})
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [os.path.dirname(os.path.abspath(__file__)), env.get("PYTHONPATH")])
        )
        start = time.monotonic()
        status = subprocess.run([sys.executable, *command], cwd=ROOT, env=env).returncode
        wall = time.monotonic() - start
        rows = []
        for name in sorted(os.listdir(out)):
            with open(os.path.join(out, name)) as f:
                rows += json.load(f)
    if not rows:
        print(f"suite_cpu: no test ran (pytest exit status {status})", file=sys.stderr)
        return 1
    worker_cpu, worker_wall = collections.Counter(), collections.Counter()
    for row in rows:
        worker_cpu[row["worker"]] += row["own"] + row["children"]
        worker_wall[row["worker"]] += row["wall"]
    own = sum(row["own"] for row in rows)
    children = sum(row["children"] for row in rows)
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
