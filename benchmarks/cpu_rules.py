"""Every CPU-specific rule of attnjax against its alternative, on the processor at hand.

    python benchmarks/cpu_rules.py [--repeats 7] [--rounds 5] [--no-devices]

The rules (``attnjax/ops/convolution.py``, ``kernel_choice.py``, ``parallel/data_parallel.py``):
  * conv_kernel_gradient: on large maps with idle cores, XLA's kernel-gradient convolution or
    ``kh * kw`` matrix products, timed once per shape on the machine (``attnjax.ops.autotune``);
  * conv_patches: a kernel larger than the map runs as patches x matrix, not XLA's convolution;
  * attention: from ``CPU_TIMED_FROM`` up to ``CPU_TIMED_BELOW`` tokens the fused, explicit or
    blocked path, timed once per class of shapes on the machine (``kernel_choice.cpu_shape_class``:
    lengths up to a power of two, batch x heads up to a power of four; the row's shape is the one
    timed for its class), forward + backward for a differentiated call, forward only for the
    others; below, a fixed rule (rows marked "not timed"); then blocked, with the CPU tile sizes
    from ``CPU_LONG_BLOCK_FROM`` tokens;
  * cpu_devices: one XLA CPU device per core (the batch split over them) or one device, each
    count in its own process.
Each row times the chosen path and the alternative alternately (A B A B ...), forward +
backward (rows marked "forward only": the forward): the fastest of ``--repeats`` calls each
(more for short calls), in ``--rounds`` rounds, the median round reported. Prints a table with
the processor and writes ``benchmarks/results/cpu_rules.json`` and ``cpu_rules.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attnjax.ops import attention, autotune, blocked_attention, convolution, kernel_choice
from attnjax.ops.platform import cpu_cores, processor

RESULTS = pathlib.Path(__file__).parent / "results"
NHWC = ("NHWC", "HWIO", "NHWC")
# (lhs [b, h, w, c_in], kernel, c_out, where): the 3x3 convolutions of compare_torch.py's VQGAN
# rows (taming, ch 64, 32 px, batch 16) and of the digits VQGAN (ch 32, 16 px, batch 32).
KERNEL_GRADIENT_SHAPES = [
    ((16, 32, 32, 64), 3, 64, "VQGAN ch64, 32x32 level"),
    ((16, 16, 16, 128), 3, 128, "VQGAN ch64, 16x16 level"),
    ((16, 16, 16, 64), 3, 128, "VQGAN ch64, 64 -> 128"),
    ((32, 16, 16, 32), 3, 32, "digits VQGAN, 16x16 level"),
]
# Kernels larger than the map: LPIPS's VGG16 on 32 px images, the PatchGAN's last layers.
PATCHES_SHAPES = [
    ((32, 2, 2, 512), 3, 512, 1, "SAME", "LPIPS VGG16 at 2x2"),
    ((16, 4, 4, 256), 4, 512, 1, ((1, 1), (1, 1)), "PatchGAN 4x4 kernel, 3x3 output"),
]
# (batch, tokens, heads, head_dim, causal): the digits ViT's and prior's 17 tokens and the digits
# VQGAN's one-head mid-block attention over its 4x4 codes, train and eval batches (make demo), a
# two-head causal 17-token shape, either side of each threshold, the CIFAR ViT's 65 tokens (batch
# 128, 8 heads of 32) and compare_torch.py's MHA row (16 x 256 tokens).
ATTENTION_SHAPES = [
    (64, 17, 4, 16, False),
    (64, 17, 4, 32, True),
    (32, 16, 1, 64, False),
    (360, 16, 1, 64, False),
    (64, 17, 2, 8, True),
    (8, 32, 8, 64, True),
    (8, 64, 8, 64, True),
    (128, 65, 8, 32, False),
    (16, 128, 8, 32, True),
    (8, 197, 8, 64, False),
    (16, 256, 8, 32, True),
    (1, 512, 8, 64, True),
    (4, 512, 8, 64, True),
    (1, 512, 8, 64, False),
    (1, 1024, 8, 64, True),
    (1, 2048, 8, 64, True),
]


ROUNDS = 5


def fastest_ms(calls: dict, repeats: int) -> dict:
    """Per blocking call, the fastest of ``repeats`` calls in ms, after a warm-up, the calls
    alternating (the statistic ``attnjax.ops.autotune`` chooses by, the call a passing load
    disturbed least), measured in ``ROUNDS`` rounds -> ``{name: [ms per round]}``: a millisecond
    call's fastest moves by 5-25% between minutes on a shared machine."""
    per_round = autotune.fastest_per_round(calls, repeats, ROUNDS)
    return {name: [1e3 * t for t in seconds] for name, seconds in per_round.items()}


def compiled_call(fn, *args):
    compiled = jax.jit(fn).lower(*args).compile()
    return lambda: jax.block_until_ready(compiled(*args))


def row(rule, shape, chosen, alternative, ms):
    """``ms``: ``{name: [ms per round]}``; the row gives the median rounds and the range of the
    rounds' ratios."""
    ratios = [a / c for a, c in zip(ms[alternative], ms[chosen])]
    return dict(
        rule=rule,
        shape=shape,
        chosen=chosen,
        alternative=alternative,
        chosen_ms=float(np.median(ms[chosen])),
        alternative_ms=float(np.median(ms[alternative])),
        ratio=float(np.median(ms[alternative]) / np.median(ms[chosen])),
        ratio_range=[min(ratios), max(ratios)],
    )


def kernel_gradient_rows(repeats):
    rows = []
    for lhs, k, c_out, where in KERNEL_GRADIENT_SHAPES:
        rhs, pads = (k, k, lhs[-1], c_out), ((1, 1), (1, 1))
        positions, channels = lhs[1] * lhs[2], lhs[-1] * c_out
        timed = (
            positions >= convolution.PRODUCT_KERNEL_GRAD_MIN_POSITIONS
            and channels >= convolution.PRODUCT_KERNEL_GRAD_MIN_CHANNELS
            and convolution._cores_left_idle()
        )
        args = (lhs, rhs, (1, 1), pads, jnp.float32)
        chosen = convolution.kernel_gradient_path(*args) if timed else "xla"
        candidates = convolution.kernel_gradient_candidates(*args)
        ms = fastest_ms({name: build() for name, build in candidates.items()}, repeats)
        shape = f"{where}: {lhs} * {k}x{k}x{lhs[-1]}x{c_out}" + ("" if timed else " (not timed)")
        rows.append(row("conv_kernel_gradient", shape, chosen, _other(chosen, ms), ms))
    return rows


def _other(chosen, ms):
    return min((name for name in ms if name != chosen), key=lambda name: np.median(ms[name]))


def patches_rows(repeats):
    rows = []
    for lhs, k, c_out, stride, padding, where in PATCHES_SHAPES:
        rng = np.random.default_rng(0)
        x = rng.standard_normal(lhs).astype(np.float32)
        w = rng.standard_normal((k, k, lhs[-1], c_out)).astype(np.float32)

        def grads(conv):
            def loss(x, w):
                out = conv(x, w, (stride, stride), padding, dimension_numbers=NHWC)
                return jnp.sum(out * jnp.cos(out))

            return jax.grad(loss, (0, 1))

        ms = fastest_ms(
            {
                "patches": compiled_call(grads(convolution.conv_general_dilated), x, w),
                "xla": compiled_call(grads(lax.conv_general_dilated), x, w),
            },
            repeats,
        )
        shape = f"{where}: {lhs} * {k}x{k}x{lhs[-1]}x{c_out}"
        rows.append(row("conv_patches", shape, "patches", "xla", ms))
    return rows


def attention_rows(repeats):
    """Below ``CPU_TIMED_BELOW`` tokens the table times the programs a timed choice times
    (``attention.cpu_path_candidates``), forward + backward (a differentiated call's choice) and
    forward only (a forward-only call's); from there the CPU tiles against the default ones."""
    rows = []
    for batch, length, heads, depth, causal in ATTENTION_SHAPES:
        rng = np.random.default_rng(0)
        q, k, v = (
            rng.standard_normal((batch, length, heads, depth)).astype(np.float32) for _ in range(3)
        )
        rule = kernel_choice.choose_implementation("cpu", jnp.float32, length, length, 64, 64)
        shape = f"{'causal' if causal else 'full'} {batch} x {length} tokens x {heads} x {depth}"
        if length < kernel_choice.CPU_TIMED_BELOW:
            for backward, choose in (
                (True, attention.timed_cpu_path),
                (False, attention.forward_cpu_path),
            ):
                chosen = choose(q, k, v, None, causal, rule)
                _, candidates = attention.cpu_path_candidates(q, k, v, None, causal, backward)
                ms = fastest_ms({name: build() for name, build in candidates.items()}, repeats)
                name = "attention" if backward else "attention, forward only"
                untimed = " (not timed)" if length < kernel_choice.CPU_TIMED_FROM else ""
                rows.append(row(name, shape + untimed, chosen, _other(chosen, ms), ms))
            continue
        calls = {}
        tiles = {
            rule: kernel_choice.blocked_tiles("cpu", length, length),
            "blocked 128x128 tiles": (
                kernel_choice.DEFAULT_QUERY_BLOCK,
                kernel_choice.DEFAULT_KEY_BLOCK,
            ),
        }
        for name, (query_block, key_block) in tiles.items():

            def loss(q, k, v, query_block=query_block, key_block=key_block):
                out = blocked_attention.blocked_dot_product_attention(
                    q, k, v, is_causal=causal, query_block=query_block, key_block=key_block
                )
                return jnp.sum(out * jnp.cos(out))

            calls[name] = compiled_call(jax.grad(loss, (0, 1, 2)), q, k, v)
        ms = fastest_ms(calls, repeats)
        rows.append(row("attention", shape, rule, _other(rule, ms), ms))
    return rows


def devices_worker(count: int, repeats: int) -> dict:
    """In a fresh process: ms per train step on ``count`` CPU devices, the batch split over them
    as train.py splits it: the digits VQGAN task's own step (configs/vqgan_digits.py, batch 32,
    what ``make demo`` trains) and compare_torch.py's VQGAN autoencoder (ch 64, 32 px, batch 16)."""
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from torch_vs_jax import Jax, use_devices

    use_devices(count)
    from rows_vqgan import DDCONFIG, autoencoder_step

    import configs.vqgan_digits
    from attnjax.models import vqgan
    from attnjax.tasks import vqgan as vqgan_task

    rng = np.random.default_rng(0)
    calls = {}
    digits = configs.vqgan_digits.get_config()
    model = vqgan_task.create_model(digits)
    images = rng.uniform(-1, 1, (digits.batch_size, 16, 16, 1)).astype(np.float32)
    state = vqgan_task.create_train_state(jax.random.key(0), digits, model, {"image": images})

    def digits_step(state, images):
        batch, key = {"image": images}, jax.random.key(1)
        return vqgan_task.train_step(state, batch, key, config=digits, model=model)[0]

    calls["digits VQGAN train step (the task's), batch 32"] = Jax(
        digits_step, state, images, donate=True
    )

    model = vqgan.create_vqgan(DDCONFIG, 512, 64, quantizer={"legacy": True})
    images = rng.uniform(-1, 1, (16, 32, 32, 3)).astype(np.float32)
    variables = model.init(jax.random.key(0), images[:1])
    calls["VQGAN ch64 32px autoencoder step, batch 16"] = autoencoder_step(model, variables, images)
    return {"devices": jax.device_count(), "ms": fastest_ms(calls, repeats)}


def devices_rows(repeats, rounds: int = 2):
    """One device per core (the default) against one device, alternating processes 1, n, n, 1."""
    per_core = cpu_cores()
    if per_core < 2:
        return []
    counts = [1, per_core, per_core, 1][: 2 * rounds]
    times = {1: [], per_core: []}
    for count in counts:
        out = subprocess.run(
            [
                *(sys.executable, __file__, "--devices-worker", str(count)),
                *("--repeats", str(repeats), "--rounds", str(ROUNDS)),
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        times[count].append(json.loads(out.strip().splitlines()[-1])["ms"])
    rows = []
    for name in times[1][0]:
        ms = {
            f"{per_core} devices": [x for t in times[per_core] for x in t[name]],
            "1 device": [x for t in times[1] for x in t[name]],
        }
        rows.append(row("cpu_devices", name, f"{per_core} devices", "1 device", ms))
    return rows


NOTE = """`python benchmarks/cpu_rules.py` (JSON: [cpu_rules.json](cpu_rules.json)). *chosen* is the
path attnjax takes on this machine: a fixed rule, or a choice timed once per shape (convolution)
or class of shapes (attention: lengths up to a power of two, batch x heads up to a power of four)
(`attnjax.ops.autotune`, made afresh for this table, the default kept unless another path is 2%
faster); *alternative* is the fastest other path. The milliseconds are a second measurement of
the same programs, apart from the one behind a timed choice: the fastest of at least 7 calls
each, more for short calls (0.1 s of calls per candidate), the candidates alternating, in 5
rounds: the medians, and in brackets the range of the rounds' ratios."""


def table(rows, meta) -> str:
    lines = [
        f"Processor: {meta['processor']} ({meta['cores']} cores), jax {meta['jax']}, "
        f"fastest of at least {meta['repeats']} calls, median of {meta['rounds']} rounds, "
        "forward + backward, the candidates alternating; "
        f"load average before / after: {meta['load_before']} / {meta.get('load_after', '-')}.",
        "",
        "| rule | shape | chosen | ms | alternative | ms | alternative / chosen (rounds) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        low, high = r["ratio_range"]
        lines.append(
            f"| {r['rule']} | {r['shape']} | {r['chosen']} | {r['chosen_ms']:.2f} "
            f"| {r['alternative']} | {r['alternative_ms']:.2f} "
            f"| {r['ratio']:.2f} ({low:.2f}-{high:.2f}) |"
        )
    return "\n".join(lines)


def main():
    global ROUNDS
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--no-devices", action="store_true", help="skip the cpu_devices rows")
    parser.add_argument("--devices-worker", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS / "cpu_rules.json"))
    args = parser.parse_args()
    ROUNDS = args.rounds
    if args.devices_worker:
        print(json.dumps(devices_worker(args.devices_worker, args.repeats)))
        return
    jax.config.update("jax_num_cpu_devices", 1)
    meta = dict(
        processor=processor(),
        cores=cpu_cores(),
        jax=jax.__version__,
        repeats=args.repeats,
        rounds=ROUNDS,
        load_before=" ".join(f"{x:.2f}" for x in os.getloadavg()),
    )
    rows = []
    # The kernel-gradient choices are timed afresh here, not read from this user's cache.
    with tempfile.TemporaryDirectory() as directory:
        os.environ[autotune.ENV_CACHE] = os.path.join(directory, "cpu_rules.json")
        autotune.set_enabled(True)
        os.environ[autotune.ENV_SWITCH] = "always"  # every choice met is timed, not only a run's
        for section in (kernel_gradient_rows, patches_rows, attention_rows):
            new = section(args.repeats)
            print("\n".join(table(new, meta).splitlines()[4:]), flush=True)
            rows += new
    if not args.no_devices:
        rows += devices_rows(max(3, args.repeats // 2))
    meta["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    text = table(rows, meta)
    print("\n" + text)
    out = pathlib.Path(args.out)
    out.write_text(json.dumps(dict(machine=meta, rows=rows), indent=2))
    out.with_suffix(".md").write_text(f"# CPU rules on this machine\n\n{NOTE}\n\n{text}\n")
    print(f"saved {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
