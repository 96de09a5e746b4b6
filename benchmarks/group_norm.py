"""GroupNorm(32) on the ch64 VQGAN's maps: attnjax's (statistics summed over the positions, then
over each group's channels) against Flax's ``nn.GroupNorm`` (both at once) and PyTorch's, under
the XLA:CPU flags attnjax sets, forward and forward + backward, and a group's sum alone.

    python benchmarks/group_norm.py [--repeats 30]

Shapes: one CPU device's half of ``compare_torch.py``'s VQGAN batch of 16 (8 maps) at the
autoencoder's three resolutions. Each program is jitted alone on the default device; torch runs
on one thread (one XLA device computes on one core when ``train.py`` splits the batch over the
cores). Median of ``--repeats`` calls in ms. Writes benchmarks/results/group_norm.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch
from timing import median_seconds

from attnjax import xla_cpu
from attnjax.models.group_norm import GroupNorm
from attnjax.ops.platform import processor

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SHAPES = [(8, 32, 32, 64), (8, 32, 32, 128), (8, 16, 16, 128), (8, 8, 8, 128)]
GROUPS = 32


def _jax_rows(module, x, repeats):
    variables = module.init(jax.random.key(0), x)
    forward = jax.jit(module.apply)
    both = jax.jit(jax.grad(lambda v, x: jnp.sum(module.apply(v, x) ** 2), (0, 1)))
    out = {}
    for name, fn in (("forward", forward), ("forward_backward", both)):
        call = lambda fn=fn: jax.block_until_ready(fn(variables, x))
        call()
        out[name] = 1e3 * median_seconds(call, repeats)
    return out


def _group_sums(x, repeats):
    batch, channels = x.shape[0], x.shape[-1]
    at_once = jax.jit(lambda x: jnp.sum(x.reshape(batch, -1, GROUPS, channels // GROUPS), (1, 3)))
    two_steps = jax.jit(
        lambda x: jnp.sum(jnp.sum(x.reshape(batch, -1, channels), 1).reshape(batch, GROUPS, -1), -1)
    )
    out = {}
    for name, fn in (("sum_at_once", at_once), ("sum_in_two_steps", two_steps)):
        call = lambda fn=fn: jax.block_until_ready(fn(x))
        call()
        out[name] = 1e3 * median_seconds(call, repeats)
    return out


def _torch_rows(x, repeats):
    reference = torch.nn.GroupNorm(GROUPS, x.shape[-1], eps=1e-6)
    tx = torch.from_numpy(np.ascontiguousarray(np.asarray(x).transpose(0, 3, 1, 2)))
    tx.requires_grad_(True)

    def forward():
        with torch.no_grad():
            reference(tx)

    def forward_backward():
        tx.grad = None
        reference.zero_grad()
        (reference(tx) ** 2).sum().backward()

    out = {}
    for name, fn in (("forward", forward), ("forward_backward", forward_backward)):
        fn()
        out[name] = 1e3 * median_seconds(fn, repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for shape in SHAPES:
        x = jnp.asarray(np.random.default_rng(0).standard_normal(shape, dtype=np.float32))
        flax_norm = nn.GroupNorm(num_groups=GROUPS, epsilon=1e-6, use_fast_variance=False)
        row = dict(
            shape=shape,
            attnjax=_jax_rows(GroupNorm(num_groups=GROUPS, epsilon=1e-6), x, args.repeats),
            flax=_jax_rows(flax_norm, x, args.repeats),
            torch=_torch_rows(x, args.repeats),
            **_group_sums(x, args.repeats),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    machine = dict(
        cpu=processor(),
        cores=os.cpu_count(),
        jax=jax.__version__,
        torch=torch.__version__,
        xla_flags=xla_cpu.in_effect(),
    )
    record = {"machine": machine, "rows": rows}
    (RESULTS / "group_norm.json").write_text(json.dumps(record, indent=2))
    lines = [
        "# GroupNorm(32) on the ch64 VQGAN's maps (`python benchmarks/group_norm.py`)",
        "",
        f"{machine['cpu']}, {machine['cores']} cores; jax {machine['jax']} with "
        f"`{machine['xla_flags']}`, torch {machine['torch']} on one thread; median of "
        f"{args.repeats} calls in ms, one XLA device. A group's sum: `[batch, positions, groups, "
        "channels per group]` reduced over positions and channels at once (Flax) or first over "
        "positions, then over the group's channels (attnjax).",
        "",
        "| maps | attnjax fwd | Flax fwd | torch fwd | attnjax fwd+bwd | Flax fwd+bwd "
        "| torch fwd+bwd | group sum at once | in two steps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, f, t = r["attnjax"], r["flax"], r["torch"]
        lines.append(
            f"| {'x'.join(map(str, r['shape']))} | {a['forward']:.2f} | {f['forward']:.2f} "
            f"| {t['forward']:.2f} | {a['forward_backward']:.2f} | {f['forward_backward']:.2f} "
            f"| {t['forward_backward']:.2f} | {r['sum_at_once']:.2f} "
            f"| {r['sum_in_two_steps']:.2f} |"
        )
    (RESULTS / "group_norm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
