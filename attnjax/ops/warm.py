"""Times the CPU attention choices of a grid of shape classes ahead of time, once per machine:

    python -m attnjax.ops.warm [--lengths 512,1000] [--rows 4,16,64] [--dims 32,64]

A training run times the classes its own programs meet at its first step; this command fills the
cache (``attnjax.ops.autotune``) for every class of the grid, forward + backward and forward
only, causal and not, so that later calls of those classes, in or out of training, only read it.
Classes already in the cache cost nothing. Prints one line per class with the choice.
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
import tqdm

from attnjax.ops import attention, autotune, kernel_choice

HEADS = 4  # rows = batch * heads; the class rounds rows, not heads


def warm(lengths, rows, dims, dtype=jnp.float32) -> list[dict]:
    """Times every class of the grid not yet in the cache -> one row per class. Lengths outside
    ``kernel_choice.CPU_TIMED_FROM`` to ``CPU_TIMED_BELOW`` are left out: there a fixed rule
    runs untimed."""
    lengths = [n for n in lengths if kernel_choice.cpu_timed(n)]
    grid = list(itertools.product(lengths, rows, dims, (False, True)))
    done = []
    with autotune.timing_window(), tqdm.tqdm(grid, unit="class", desc="attention classes") as bar:
        for length, row_count, dim, causal in bar:
            heads = min(HEADS, row_count)
            shape = jax.ShapeDtypeStruct((max(1, row_count // heads), length, heads, dim), dtype)
            default = kernel_choice.choose_implementation("cpu", dtype, length, length, dim, dim)
            start = time.perf_counter()
            trained = attention.timed_cpu_path(shape, shape, shape, None, causal, default)
            inferred = attention.forward_cpu_path(shape, shape, shape, None, causal, default)
            done.append(
                dict(
                    length=length,
                    rows=row_count,
                    dim=dim,
                    causal=causal,
                    training=trained,
                    inference=inferred,
                    seconds=round(time.perf_counter() - start, 2),
                )
            )
    return done


def _integers(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attnjax.ops.warm", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--lengths", type=_integers, default=[512, 1000])
    parser.add_argument("--rows", type=_integers, default=[4, 16, 64])
    parser.add_argument("--dims", type=_integers, default=[32, 64])
    args = parser.parse_args(argv)
    if not autotune.enabled():
        print(f"python -m attnjax.ops.warm: ${autotune.ENV_SWITCH} is off: nothing to time")
        return 2
    for row in warm(args.lengths, args.rows, args.dims):
        print(
            f"{row['length']:5d} tokens, {row['rows']:4d} rows, dim {row['dim']:3d}, "
            f"{'causal' if row['causal'] else 'full  '}: training {row['training']:8s} "
            f"inference {row['inference']:8s} ({row['seconds']:.1f} s)"
        )
    print(f"cache: {autotune.cache_path()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
