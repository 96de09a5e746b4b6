"""Compile a config for a TPU or GPU it is not running on: memory, FLOPs and throughput, predicted.

    python -m attnjax.compile --config configs/vit_imagenet.py --target tpu:v5e:2x4
    JAX_PLATFORMS=cpu python -m attnjax.compile --config configs/vit_imagenet.py \\
        --target gpu:h100:8 --json vit_h100.json --config.batch_size=1024
    python train.py --config configs/vit_imagenet.py --compile_only=tpu:v5e:2x4

The config's mesh is built on the target's compile-only devices (``targets``), its train step,
eval step and, for the prior, sampler are compiled from abstract inputs (``programs``), and the
command prints per device what each program holds against the chip's memory, its FLOPs, its
collectives, its compile time and the throughput its FLOPs predict (``report``). Exit status:
0 every program fits; 2 one does not (one line on stderr says what it needs, what the chip has
and what to change); 1 any other failure.
"""

from __future__ import annotations

import json
import sys

from attnjax import tasks
from attnjax.compile import programs, report, targets

EXIT_DOES_NOT_FIT = 2


def run(config, target_name: str, *, config_name: str = "", json_path: str | None = None) -> int:
    """Compiles ``config`` for ``target_name``, prints the report (and writes it as JSON to
    ``json_path``) -> the exit status."""
    target = targets.parse(target_name)
    task = tasks.get_task(config.task)
    try:
        mesh, compiled = programs.compile_programs(config, task, target)
    except programs.DoesNotFit as refused:
        line = report.refusal_for(config, target, refused)
        if json_path:
            _write(json_path, {"config": config_name, "target": target.name, "fits": False,
                               "devices": len(target.devices), "refused": line,
                               "device_memory_bytes": target.memory_per_device})  # fmt: skip
        print(line, file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    result = report.summary(config_name, target, mesh, compiled)
    print(report.format_text(result))
    if json_path:
        _write(json_path, result)
    for name, record in result["programs"].items():
        if not record["fits"]:
            needed = record["bytes_per_device"]
            print(report.refusal(config, target, name, needed, None), file=sys.stderr)
            return EXIT_DOES_NOT_FIT
    return 0


def _write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
