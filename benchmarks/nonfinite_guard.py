"""The non-finite guard of a train step, as ``attnjax.train.optim`` writes it (a select between
the old and the updated state, ``guard_nonfinite``) against the update inside ``lax.cond``
(nothing computed for a skipped step, and no old state kept beside the new one), on the
classification task's own train step.

    python benchmarks/nonfinite_guard.py [--rows vit_digits,vit_b16] [--rounds 5]

Per row, one process, one CPU device: both steps compiled from the same state, three steps of
each compared bit for bit, then timed in alternating rounds (a round: the median of 3 steps),
and each program's temporary buffers (what a step allocates afresh, and its first call faults
in). Writes benchmarks/results/nonfinite_guard.{json,md} with the machine.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from attnjax import huge_pages

if __name__ == "__main__":
    huge_pages.restart_with_huge_pages()  # as train.py starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from timing import alternating_ms  # noqa: E402

from attnjax import xla_cpu  # noqa: E402
from attnjax.ops.platform import cpu_cores, processor, processor_details  # noqa: E402
from attnjax.parallel import data_parallel  # noqa: E402
from attnjax.train import optim  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
B16 = {
    **{"model.width": 768, "model.num_heads": 12, "model.mlp_dim": 3072, "model.num_classes": 1000},
    "data.image_size": 224,
}
ROWS = {  # name: (description, config file, overrides, batch)
    "vit_digits": ("ViT digits (4 x 64), batch 64", "vit_digits", {}, 64),
    "vit_b16": ("ViT-B/16 at 224 px, batch 8", "vit_folder", B16, 8),
}


def cond_apply_gradients(state, grads, metrics, *, config, tx, axis_name=None):
    """``optim.apply_gradients`` with the update inside ``lax.cond`` on the loss and gradient
    norm being finite, instead of a select after it."""
    assert axis_name is None and state.ema_params is None  # one device, no EMA (the rows)
    metrics = dict(
        metrics,
        grad_norm=optax.tree.norm(grads),
        learning_rate=optim.learning_rate_at(config, state.step),
    )

    def update(state, grads):
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        return state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state)

    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
    new_state = jax.lax.cond(finite, update, lambda state, _: state, state, grads)
    metrics["nonfinite"] = (~finite).astype(jnp.float32)
    return new_state.replace(step=state.step + 1), metrics


def build(name: str):
    """``(description, train_step(state, batch, rng), state, batch)`` of a row's config."""
    import configs
    from attnjax import tasks

    description, module, overrides, batch_size = ROWS[name]
    config = configs.load(module)
    config.update_from_flattened_dict(overrides)
    task = tasks.get_task(config.task)
    model = task.create_model(config)
    size, channels = config.data.image_size, model.in_channels
    rng = np.random.default_rng(0)
    batch = {
        "image": rng.uniform(-1, 1, (batch_size, size, size, channels)).astype(np.float32),
        "label": rng.integers(0, config.model.num_classes, batch_size).astype(np.int32),
    }
    state = task.create_train_state(jax.random.key(0), config, model, batch)

    def train_step(state, batch, rng):
        return task.train_step(state, batch, rng, config=config, model=model)

    return description, train_step, state, batch


def measure(name: str, rounds: int) -> dict:
    description, train_step, state, batch = build(name)
    guards = {"cond": cond_apply_gradients, "select": optim.apply_gradients}
    programs, result = {}, {"workload": description}
    for label, guard in guards.items():
        optim.apply_gradients = guard  # read by the task's train step while it is traced
        jax.clear_caches()  # else jit hands back the step traced with the other guard
        try:
            start = time.perf_counter()
            lowered = jax.jit(train_step, donate_argnums=0).lower(state, batch, jax.random.key(1))
            programs[label] = lowered.compile()
            result[f"{label}_compile_s"] = time.perf_counter() - start
        finally:
            optim.apply_gradients = guards["select"]
        temp = programs[label].memory_analysis().temp_size_in_bytes
        result[f"{label}_temp_mib"] = temp / 2**20
    states, leaves = {}, {}
    for label, program in programs.items():
        current = jax.tree.map(np.array, state)  # a copy each: the steps donate their state
        for step in range(3):
            current, _ = program(current, batch, jax.random.key(step))
        states[label], leaves[label] = current, jax.tree.leaves(jax.device_get(current))
    result["same_bits"] = all(
        np.array_equal(a, b) for a, b in zip(leaves["cond"], leaves["select"], strict=True)
    )

    def call(label):
        def step():
            states[label], metrics = programs[label](states[label], batch, jax.random.key(0))
            jax.block_until_ready(metrics)

        return step

    for label, ms in alternating_ms({k: call(k) for k in programs}, rounds, 3).items():
        result[f"{label}_ms"] = ms
    result["select_over_cond"] = float(
        np.median(result["select_ms"]) / np.median(result["cond_ms"])
    )
    return result


def table(results: dict, machine: dict) -> str:
    lines = [
        f"Machine: {machine['processor']}, {machine['cores']} cores, one CPU device; jax "
        f"{machine['jax']}; $XLA_FLAGS `{machine['xla_flags']}`; {machine['rounds']} rounds "
        "alternating, a round's step the median of 3 steps.",
        "",
        "| workload | temp MiB, cond | temp MiB, select | same bits | step ms, cond | "
        "step ms, select | select / cond (medians) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        lines.append(
            f"| {r['workload']} | {r['cond_temp_mib']:.0f} | {r['select_temp_mib']:.0f} | "
            f"{'yes' if r['same_bits'] else 'no'} | "
            f"{', '.join(f'{x:.0f}' for x in r['cond_ms'])} | "
            f"{', '.join(f'{x:.0f}' for x in r['select_ms'])} | {r['select_over_cond']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    data_parallel.set_cpu_devices(1)
    results = {}
    for name in args.rows.split(","):
        if name not in ROWS:
            raise SystemExit(f"--rows: unknown row {name!r}; expected one of {list(ROWS)}")
        results[name] = measure(name, args.rounds)
        print(name, json.dumps(results[name]), flush=True)
    machine = dict(
        processor=f"{processor()} ({processor_details()})",
        cores=cpu_cores(),
        jax=jax.__version__,
        xla_flags=xla_cpu.in_effect(),
        rounds=args.rounds,
    )
    out = RESULTS / "nonfinite_guard.json"
    out.write_text(json.dumps(dict(machine=machine, rows=results), indent=2))
    text = table(results, machine)
    out.with_suffix(".md").write_text(f"# The non-finite guard: cond against select\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
