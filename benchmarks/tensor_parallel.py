"""Bytes the collectives of a train step move per device, by mesh, with and without the activation
axis rules (``attnjax.parallel.sharding.activation_axis_rules``), from the compiled HLO on 8 CPU
devices (nothing runs).

    python benchmarks/tensor_parallel.py

Models: a ViT of width 384, depth 2, 6 heads, MLP 1536 on 64x64 images in 8x8 patches (65
tokens), and a GPT prior of the same width and depth over 16x16 codes of 1021 (vocabulary 1032),
each at a global batch of 64 with SGD. A collective's bytes are those of its result (of each
element of a tuple), float32 and int32. Writes ``benchmarks/results/tensor_parallel.md``.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "tensor_parallel.md"
MESHES = (
    {"data": 8},
    {"fsdp": 8},
    {"data": 4, "model": 2},
    {"fsdp": 4, "model": 2},
    {"data": 2, "fsdp": 2, "model": 2},
)
KINDS = ("all-gather", "all-reduce", "all-to-all", "collective-permute")


def measure(name: str, mesh: dict, constrained: bool) -> dict:
    """One compiled train step in this process (8 CPU devices) -> bytes per collective kind."""
    import jax
    import numpy as np

    from attnjax.parallel import data_parallel, sharding
    from attnjax.tasks import classification, prior
    from attnjax.train import loop

    sys.path.insert(0, str(ROOT))
    from configs import prior_digits, vit_digits

    if not constrained:
        sharding.activation_axis_rules = lambda mesh: ()
    if name == "vit":
        task, config = classification, vit_digits.get_config()
        config.model.update(width=384, depth=2, num_heads=6, mlp_dim=1536)
        config.model.update(image_size=64, patch_size=8)
        batch = {"image": np.zeros((64, 64, 64, 1), np.float32), "label": np.zeros(64, np.int32)}
    else:
        task, config = prior, prior_digits.get_config()
        config.vqgan_codes.update(n_embed=1021, grid=(16, 16))
        config.model.update(n_layer=2, n_head=6, n_embd=384)
        batch = {"codes": np.zeros((64, 256), np.int32), "label": np.zeros(64, np.int32)}
    config.update(batch_size=64, optimizer="sgd", mesh=mesh)
    rules = sharding.rules_for(config, task.SHARDING_RULES)
    dp = data_parallel.DataParallel("jit", 64, mesh=config.mesh, rules=rules)
    model = task.create_model(config)
    shapes = loop.abstract_train_state(config, task, model, batch, jax.random.PRNGKey(0))
    state = data_parallel.placed_shapes(shapes, dp.state_shardings(shapes))
    batch = data_parallel.placed_shapes(batch, {k: dp.batch_sharding for k in batch})
    train_step = functools.partial(task.train_step, config=config, model=model)
    step = dp.compile_train_step(train_step, dp.state_shardings(state))
    hlo = step.lower(state, batch, jax.random.PRNGKey(0)).compile().as_text()
    moved = collections.Counter()
    for result, kind in re.findall(rf"= (\(.*?\)|\S+) ({'|'.join(KINDS)})(?:-start)?\(", hlo):
        for dims in re.findall(r"[fs]32\[([0-9,]*)\]", result):
            moved[kind] += 4 * int(np.prod([int(d) for d in dims.split(",") if d]))
    return dict(moved)


def main() -> None:
    if len(sys.argv) == 4:  # one measurement, in a process of its own
        print(json.dumps(measure(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1")))
        return
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    env.update(JAX_PLATFORMS="cpu", ATTNJAX_EXECUTABLE_CACHE="off")
    lines = [
        "# Collective bytes of a train step per device, by mesh (8 CPU devices, compiled HLO)",
        "",
        "`python benchmarks/tensor_parallel.py`; the models and the byte count: its docstring.",
        "'rules': the activation axis rules set (the residual stream split by the batch).",
        "",
        "| model | mesh | rules | " + " | ".join(KINDS) + " | total MB |",
        "|---|---|---|" + "---|" * (len(KINDS) + 1),
    ]
    for name in ("vit", "prior"):
        for mesh in MESHES:
            for constrained in (False, True):
                argv = [sys.executable, __file__, name, json.dumps(mesh), str(int(constrained))]
                out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
                moved = json.loads(out.stdout.strip().splitlines()[-1])
                cells = [f"{moved.get(kind, 0) / 1e6:.1f}" for kind in KINDS]
                layout = " x ".join(f"{axis} {size}" for axis, size in mesh.items())
                rules = "yes" if constrained else "no"
                total = f"{sum(moved.values()) / 1e6:.1f}"
                lines.append(
                    f"| {name} | {layout} | {rules} | " + " | ".join(cells + [total]) + " |"
                )
                print(lines[-1], flush=True)
    RESULTS.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
