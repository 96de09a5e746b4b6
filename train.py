"""Train any attnjax task from an ml_collections config.

    python train.py --config configs/vit_digits.py --workdir runs/digits
    python train.py --config configs/vit_cifar10.py --workdir runs/cifar --config.batch_size=256

``--compile_only=tpu:v5e:2x4`` (or ``gpu:h100:8``, ``cpu``) trains nothing: it compiles the
config's programs for that target and reports memory, FLOPs and predicted throughput
(``python -m attnjax.compile``, same exit status).

Rerunning the same command resumes from the workdir's latest checkpoint. The loop itself is
``attnjax.tasks.train_and_evaluate`` (callable from Python).

Exit status: 0 done; 1 failed, with one line on stderr naming the problem (``--verbose``
adds the traceback); 75 (``EX_TEMPFAIL``) stopped by SIGTERM/SIGINT after saving the current
step: requeue, rerunning the same command continues (``attnjax/preemption.py``).
"""

import sys

if __name__ == "__main__":
    from attnjax import huge_pages

    # First: glibc reads its tunables only when a process starts.
    huge_pages.restart_with_huge_pages()

from attnjax.train import collector  # noqa: E402

# Before jax, Flax, Orbax and grain are imported: at Python's default thresholds their imports
# alone run several full collections, about 0.1 s of every start.
collector.raise_thresholds()

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from attnjax import compat  # noqa: E402
from attnjax.compile import run as compile_only  # noqa: E402
from attnjax.parallel import data_parallel, watchdog  # noqa: E402
from attnjax.parallel.watchdog import one_line  # noqa: E402
from attnjax.tasks import train_and_evaluate  # noqa: E402
from attnjax.train import compilation_cache, config_file, preemption  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/vit_digits.py", "Training config file (configs/*.py[:arg])."
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and plots.")
_VERBOSE = flags.DEFINE_bool("verbose", False, "On failure, print the traceback too.")
_COMPILE_ONLY = flags.DEFINE_string(
    "compile_only",
    None,
    "Compile for this target (tpu:v5e:2x4, gpu:h100:8, cpu) and report memory and FLOPs instead "
    "of training: python -m attnjax.compile.",
)


def _exit_failed():
    """Status 1. One process of several leaves at once: JAX's shutdown at exit waits at a barrier
    for every process, where a dead or failed peer would hold it ``shutdown_timeout_seconds``
    (300 s). The run has closed what it held already (checkpoint writes, the lock)."""
    if jax.distributed.is_initialized():
        watchdog.exit_failed()
    sys.exit(1)


def _config_name() -> str:
    return config_flags.get_config_filename(flags.FLAGS["config"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        # Orbax logs every save step at INFO; the progress bar and eval tables say enough.
        logging.set_verbosity(logging.WARNING)
    config = config_file.loaded(_CONFIG, "train.py")
    if _COMPILE_ONLY.value:
        if compat.persistent_cache_reloads_compile_only_programs():
            compilation_cache.enable()
        try:
            status = compile_only(config, _COMPILE_ONLY.value, config_name=_config_name())
        except ValueError as error:
            print(f"train.py: error: {one_line(error)}", file=sys.stderr)
            status = 1
        sys.exit(status)
    compilation_cache.enable()
    try:
        data_parallel.use_cpu_cores(config)
        metrics = train_and_evaluate(config, _WORKDIR.value)
    except preemption.Preempted as stopped:
        print(f"train.py: {stopped}", file=sys.stderr)
        sys.exit(preemption.REQUEUE_EXIT_CODE)
    except Exception as error:
        if _VERBOSE.value:
            raise
        print(
            f"train.py: error: {one_line(error)} (--verbose shows the traceback)", file=sys.stderr
        )
        _exit_failed()
    summary = ", ".join(
        f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(metrics.items())
    )
    logging.info("final: %s", summary)
    print(f"final: {summary}")


if __name__ == "__main__":
    flags.register_multi_flags_validator(
        ["workdir", "compile_only"],
        lambda values: values["workdir"] is not None or bool(values["compile_only"]),
        "--workdir is required (except with --compile_only)",
    )
    app.run(main, flags_parser=config_file.flags_parser("train.py"))
