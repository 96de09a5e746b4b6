"""glibc's malloc as attnjax's commands start it (huge pages: ``attnjax/huge_pages.py``), and set
to keep the memory a process frees (one arena, no block mapped on its own, no trimming below
2 GiB), each against glibc's defaults, on ``compare_torch.py``'s training rows.

    python benchmarks/malloc_cpu.py [--rows mha,gpt_train] [--rounds 2] [--repeats 7]

XLA:CPU allocates each call's temporary buffers in one ``malloc`` and frees them when it returns;
glibc by default maps such a block afresh and unmaps it at ``free``, so each step faults its
working memory in again, 4 KiB at a time. Huge pages keep blocks in each thread's heaps (those
beyond 64 MiB mapped, on 2 MiB pages); the kept setting keeps everything in one heap. Both are
glibc's own tunables (``GLIBC_TUNABLES``, read when a process starts); huge-later is huge pages
held back until the first row's first call has run (``prctl(PR_SET_THP_DISABLE)``). Each
setting runs in fresh processes, alternating (huge pages, kept, glibc's defaults, for
``--rounds`` rounds), every row in each: the median step of attnjax and of torch (in the same
process, so under the same malloc), and per attnjax step the page faults and the kernel time
(``getrusage``). Writes benchmarks/results/malloc_cpu.{json,md} with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

from attnjax import huge_pages
from attnjax.ops.platform import cpu_cores, processor, processor_details

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TRAINING_ROWS = (
    "sdpa_1024,mha,vit_cifar_train,vit_ti16_train,vqgan_autoencoder,gpt_train,vqgan_gan_step"
)
KEPT = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"
HUGE_PAGES = huge_pages.tunables_with_huge_pages("")
# Huge pages' setting without the huge pages: blocks kept in each thread's heaps, 4 KiB pages.
HEAPS = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"
# Huge pages in one heap that every thread shares: memory one thread faulted in and freed is
# there for the blocks any other thread asks for next (``--prefault-gib``).
ONE_HEAP = "huge pages, one heap"
# Huge pages held back until the first call has run (the kernel's per-process switch,
# prctl(PR_SET_THP_DISABLE)): the first call on 4 KiB pages, the later ones on huge pages.
LATER = "huge pages after the first call"
SETTINGS = {
    "huge pages": HUGE_PAGES,
    ONE_HEAP: HUGE_PAGES + ":glibc.malloc.arena_max=1",
    LATER: HUGE_PAGES,
    "kept": KEPT,
    "heaps": HEAPS,
    "glibc's defaults": "",
}
SHORT = {
    "huge pages": "huge",
    ONE_HEAP: "one-heap",
    LATER: "huge-later",
    "kept": "kept",
    "heaps": "heaps",
    "glibc's defaults": "glibc's",
}
BASELINE = "glibc's defaults"

# One process: every row's attnjax step and torch step, and the attnjax step's faults and kernel
# time per call.
PROCESS = r"""
import json, resource, sys, tempfile
sys.path.insert(0, "benchmarks")
import compare_torch
from timing import median_seconds

rows, repeats, prefault = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
import ctypes, time
PR_SET_THP_DISABLE = 41  # <linux/prctl.h>: the process's memory on small pages while set
libc = ctypes.CDLL(None)
held = sys.argv[4] == "1" and libc.prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0
prefault_s = 0.0
if prefault:  # faulted in by this thread alone, then freed to the heap the first call takes
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    start = time.perf_counter()
    block = libc.malloc(prefault)
    if block:
        libc.memset(block, 0, prefault)
        libc.free(block)
    prefault_s = time.perf_counter() - start
compare_torch.use_devices(0)
compare_torch.torch.set_num_threads(compare_torch.os.cpu_count())
results = {}
with tempfile.TemporaryDirectory() as directory:
    table = compare_torch.rows(False, directory)
    for name in rows:
        description, jax_step, torch_step = table[name]()
        # The first call on its own: a run's first step waits for it, faults and all.
        before = resource.getrusage(resource.RUSAGE_SELF)
        first_s = median_seconds(jax_step, 1)
        after = resource.getrusage(resource.RUSAGE_SELF)
        if held:  # huge pages from here on
            libc.prctl(PR_SET_THP_DISABLE, 0, 0, 0, 0)
            held = False
        first = dict(
            first_ms=1e3 * first_s,
            first_faults=after.ru_minflt - before.ru_minflt,
            first_kernel_s=after.ru_stime - before.ru_stime,
        )
        jax_step(), torch_step()  # warm-up (the heap grows over the first calls)
        before = resource.getrusage(resource.RUSAGE_SELF)
        jax_ms = 1e3 * median_seconds(jax_step, repeats)
        after = resource.getrusage(resource.RUSAGE_SELF)
        torch_ms = 1e3 * median_seconds(torch_step, repeats)
        results[name] = dict(
            workload=description,
            attnjax_ms=jax_ms,
            torch_ms=torch_ms,
            faults_per_step=(after.ru_minflt - before.ru_minflt) / repeats,
            kernel_s_per_step=(after.ru_stime - before.ru_stime) / repeats,
            **first,
        )
print(json.dumps({"rows": results, "prefault_s": prefault_s}))
"""


def run(rows: str, repeats: int, tunables: str, prefault: int = 0, hold: bool = False) -> dict:
    env = {**os.environ, "GLIBC_TUNABLES": tunables, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", PROCESS, rows, str(repeats), str(prefault), str(int(hold))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"malloc_cpu: the process with GLIBC_TUNABLES={tunables!r} failed:\n"
            + done.stderr[-3000:]
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(runs: dict, machine: dict) -> str:
    names = list(runs[BASELINE][0]["rows"])
    settings = list(runs)
    columns = [
        ("attnjax first call ms", "first_ms", "{:.0f}"),
        ("kernel s, first call", "first_kernel_s", "{:.2f}"),
        ("attnjax ms", "attnjax_ms", "{:.0f}"),
        ("faults / step", "faults_per_step", "{:.0f}"),
    ]
    columns += [
        ("kernel s / step", "kernel_s_per_step", "{:.2f}"),
        ("torch ms", "torch_ms", "{:.0f}"),
    ]
    header = [f"{title}, {SHORT[setting]}" for title, _, _ in columns for setting in settings]
    lines = [
        f"Machine: {machine['processor']} ({machine.get('details', '')}), {machine['cores']} "
        f"cores; {machine['rounds']} rounds "
        "of fresh processes, the settings alternating; a cell lists each round's median step.",
        "",
    ]
    if machine.get("prefault_gib") and ONE_HEAP in runs:
        seconds = ", ".join(f"{r['prefault_s']:.2f}" for r in runs[ONE_HEAP])
        lines += [
            f"One heap: {machine['prefault_gib']} GiB faulted in by one thread and freed before "
            f"the first row ({seconds} s).",
            "",
        ]
    lines += [
        "| row | " + " | ".join(header) + " |",
        "|---|" + "---|" * len(header),
    ]
    for name in names:
        cells = [
            ", ".join(fmt.format(r["rows"][name][key]) for r in runs[setting])
            for _, key, fmt in columns
            for setting in settings
        ]
        workload = runs[BASELINE][0]["rows"][name]["workload"]
        lines.append(f"| {workload} | " + " | ".join(cells) + " |")

    def median_ms(setting, name):
        return statistics.median(r["rows"][name]["attnjax_ms"] for r in runs[setting])

    others = [setting for setting in settings if setting != BASELINE]
    lines += [
        "",
        "attnjax's step, glibc's defaults over each setting (median over rounds; above 1: faster):",
        "",
        "| row | " + " | ".join(others) + " |",
        "|---|" + "---|" * len(others),
    ]
    for name in names:
        ratios = [f"{median_ms(BASELINE, name) / median_ms(s, name):.2f}x" for s in others]
        lines.append(
            f"| {runs[BASELINE][0]['rows'][name]['workload']} | " + " | ".join(ratios) + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default=TRAINING_ROWS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--settings",
        default=",".join(SHORT.values()),
        help=f"comma-separated, from {list(SHORT.values())}; glibc's defaults always run",
    )
    parser.add_argument(
        "--prefault-gib",
        type=float,
        default=0.0,
        help="in the one-heap setting, GiB faulted in and freed before the first row",
    )
    parser.add_argument("--out", default=str(RESULTS / "malloc_cpu.json"))
    args = parser.parse_args()
    prefault = int(args.prefault_gib * 2**30)
    if prefault < 0:
        raise SystemExit(f"--prefault-gib: {args.prefault_gib} is negative; expected GiB >= 0")
    chosen = set(args.settings.split(",")) | {SHORT[BASELINE]}
    unknown = sorted(chosen - set(SHORT.values()))
    if unknown:
        raise SystemExit(
            f"--settings: unknown {unknown}; expected names from {list(SHORT.values())}"
        )
    runs = {setting: [] for setting in SETTINGS if SHORT[setting] in chosen}
    for round_ in range(args.rounds):
        for setting in runs:
            extra = prefault if setting == ONE_HEAP else 0
            result = run(args.rows, args.repeats, SETTINGS[setting], extra, setting == LATER)
            runs[setting].append(result)
            print(f"round {round_ + 1}, {setting}: {json.dumps(result['rows'])}", flush=True)
    machine = dict(
        processor=processor(),
        details=processor_details(),
        cores=cpu_cores(),
        rounds=args.rounds,
        prefault_gib=args.prefault_gib,
    )
    out = pathlib.Path(args.out)
    out.write_text(json.dumps({"machine": machine, "runs": runs}, indent=2))
    text = table(runs, machine)
    out.with_suffix(".md").write_text(
        "# glibc's malloc on huge pages, kept, or as default, on CPU\n\n" + text + "\n"
    )
    print(text)


if __name__ == "__main__":
    main()
