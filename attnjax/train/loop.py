"""The training loop every task shares: ``train_and_evaluate(config, workdir) -> metrics``.

Order of business, so that a bad config fails before anything in the workdir changes:
task, parallel mode and batch divisibility, model identity against existing checkpoints,
model, data, train state (optimiser), and only then checkpoints, config.json and logs.

Per-step RNG keys are ``fold_in(key(seed), step)``, the data stream is a function of the seed
and the iterator position, and both the state and the iterator position are checkpointed, so a
resumed run computes exactly what an uninterrupted one would.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from absl import logging

from attnjax import data
from attnjax.train import (
    checkpoint,
    checkpoint_integrity,
    nonfinite,
    parallel,
    preemption,
    report,
    sharding,
    workdir_lock,
)

LOOP_FIELDS = (
    "task",
    "seed",
    "num_train_steps",
    "batch_size",
    "log_every",
    "eval_every",
    "checkpoint_every",
    "max_to_keep",
)


def _check_loop_fields(config) -> None:
    missing = [k for k in LOOP_FIELDS if k not in config]
    if missing:
        raise ValueError(f"config lacks the training-loop field(s) {missing}.")
    for key in (
        "num_train_steps",
        "batch_size",
        "log_every",
        "eval_every",
        "checkpoint_every",
        "max_to_keep",
    ):
        if int(config[key]) < 1:
            raise ValueError(f"config.{key}={config[key]!r} must be a positive integer.")
    nonfinite.check_config(config)
    parallel.cpu_devices_wanted(config)  # rejects a negative config.cpu_devices


def evaluate(
    task, dp, compiled_eval_step, state, datasets, *, config, model, workdir, step
) -> dict:
    """Runs the eval set once -> ``{"eval/<name>": sum / count}``; writes the task's images."""
    totals, first = None, None
    for batch in data.make_iterator(datasets.eval, config.get("data")):
        first = batch if first is None else first
        sums = compiled_eval_step(state, dp.shard_batch(batch))
        totals = sums if totals is None else jax.tree.map(np.add, totals, sums)
    totals = dp.fetch(totals)
    count = float(totals.pop("count"))
    metrics = {f"eval/{k}": float(v) / count for k, v in totals.items()}
    if hasattr(task, "write_images"):
        whole = dp.to_host(state)  # a collective: every process takes part
        if jax.process_index() == 0:
            task.write_images(whole, first, config=config, model=model, workdir=workdir, step=step)
    return metrics


class _StepKeys:
    """``fold_in(train_rng, i)`` for step ``i``, computed ``chunk`` steps at a time into host memory.

    A key made on the device per step is a small computation queued behind the running step, and
    the loop waits for it before it can dispatch the next one; keys from host memory let the
    loop run ahead of the device, as it does with batches. Same keys as folding in one by one."""

    def __init__(self, train_rng, chunk: int):
        self.train_rng, self.chunk, self.first, self.keys = (
            train_rng,
            max(int(chunk), 1),
            None,
            None,
        )

    def __call__(self, index: int) -> np.ndarray:
        if self.first is None or not self.first <= index < self.first + self.chunk:
            self.first = index
            fold = jax.vmap(lambda i: jax.random.fold_in(self.train_rng, i))
            self.keys = np.asarray(fold(jnp.arange(index, index + self.chunk, dtype=jnp.uint32)))
        return self.keys[index - self.first]


def train_and_evaluate(config, workdir: str, task) -> dict:
    """Trains ``task`` (a task module, see ``attnjax.tasks``) as ``config`` says in ``workdir``,
    resuming from its latest checkpoint if any.

    Returns the final metrics: ``step``, the last ``train/*`` averages, ``eval/*`` of the final
    evaluation, ``steps_per_sec`` (training steps only, compile excluded after the first log)
    and whatever the task's ``finalize`` adds. Calling it again on a finished workdir trains
    nothing and returns the final evaluation again (pipelines can rerun stages cheaply).
    """
    _check_loop_fields(config)
    parallel.maybe_initialize_distributed(config)
    dp = parallel.DataParallel(
        config.get("parallel", "jit"),
        config.batch_size,
        config.get("eval_batch_size") or None,
        mesh=config.get("mesh", None),
        rules=sharding.rules_for(config, getattr(task, "SHARDING_RULES", None)),
        devices=parallel.run_devices(config),
    )
    checkpoint.check_compatible(
        workdir, config, getattr(task, "IDENTITY_FIELDS", checkpoint.DEFAULT_IDENTITY_FIELDS)
    )

    model = task.create_model(config)
    make_datasets = getattr(task, "make_datasets", data.make_datasets)
    datasets = make_datasets(
        config, process_index=jax.process_index(), process_count=jax.process_count()
    )
    init_rng, train_rng = jax.random.split(jax.random.PRNGKey(config.seed))
    example = next(data.make_iterator(datasets.train, config.get("data")))
    state = task.create_train_state(init_rng, config, model, example)
    if dp.mode == "jit":
        state = dp.place_state(state)  # restored checkpoints take this layout

    is_main = jax.process_index() == 0
    lock = workdir_lock.acquire(workdir) if is_main else None
    try:
        ckpt = checkpoint.Checkpointer(workdir, config)
        train_iter = data.make_iterator(datasets.train, config.get("data"))
        start, state = ckpt.restore_intact(state, train_iter)
    except BaseException:
        workdir_lock.release(workdir, lock)
        raise
    if start is not None:
        logging.info("resumed from %s at step %d", workdir, start)
    start = start or 0
    if is_main:
        checkpoint.write_config(workdir, config)
    logging.info(
        "%s: %d train / %d eval examples, %d devices (%s), global batch %d",
        config.task,
        datasets.num_train_examples,
        datasets.num_eval_examples,
        dp.mesh.size,
        dp.mode,
        config.batch_size,
    )

    if dp.mode == "pmap":
        state = dp.place_state(state)
    compiled_train_step = dp.compile_train_step(
        functools.partial(task.train_step, config=config, model=model),
        dp.state_shardings(state) if dp.mode == "jit" else None,
    )
    compiled_eval_step = dp.compile_eval_step(
        functools.partial(task.eval_step, config=config, model=model)
    )
    batches = parallel.Prefetcher(train_iter, dp.shard_batch, size=config.get("prefetch", 2))
    writer = report.MetricWriter(workdir, enabled=is_main, resume_step=start)
    watch = nonfinite.NonfiniteWatch(config, start)

    step_keys = _StepKeys(train_rng, config.log_every)

    def check_pending_finite(step):
        """Before a save: the flags of the steps not yet fetched (one small transfer)."""
        watch.check(step, dp.fetch([m["nonfinite"] for m in pending]))

    num_steps = config.num_train_steps
    result: dict = {"step": start}
    pending, data_state = [], None
    train_time, timed_steps, tick = 0.0, 0, time.perf_counter()
    bar = tqdm.tqdm(
        total=num_steps,
        initial=start,
        desc=config.task,
        unit="step",
        disable=not is_main or config.get("quiet", False),
        dynamic_ncols=True,
    )
    stop = preemption.StopRequest().__enter__()
    try:
        for step in range(start + 1, num_steps + 1):
            batch, data_state = next(batches)
            state, metrics = compiled_train_step(state, batch, step_keys(step - 1))
            pending.append(metrics)
            bar.update(1)
            if step % config.log_every == 0 or step == num_steps:
                fetched = dp.fetch(pending)
                watch.check(step, [m.pop("nonfinite") for m in fetched])
                logged = jax.tree.map(lambda *xs: float(np.mean(xs)), *fetched)
                now = time.perf_counter()
                # The first interval includes compilation; count it once there is a later one.
                if step > start + len(pending) or step == num_steps:
                    train_time += now - tick
                    timed_steps += len(pending)
                scalars = {f"train/{k}": v for k, v in logged.items()}
                if timed_steps:
                    scalars["steps_per_sec"] = timed_steps / train_time
                if watch.mode == "skip":
                    scalars["train/skipped_steps"] = watch.skipped
                writer.write(step, scalars)
                result.update(scalars)
                shown = "loss" if "loss" in logged else min(logged)
                bar.set_postfix({shown: f"{logged[shown]:.4f}"}, refresh=False)
                pending = []
            if step % config.eval_every == 0 or step == num_steps:
                check_pending_finite(step)
                eval_metrics = evaluate(
                    task,
                    dp,
                    compiled_eval_step,
                    state,
                    datasets,
                    config=config,
                    model=model,
                    workdir=workdir,
                    step=step,
                )
                writer.write(step, eval_metrics)
                result.update(eval_metrics)
                bar.write(report.format_table(step, eval_metrics))
                ckpt.save_best(step, dp.checkpointable(state), eval_metrics)
            preempted = stop.requested(step)
            if step % config.checkpoint_every == 0 or step == num_steps or preempted:
                check_pending_finite(step)
                ckpt.save(step, dp.checkpointable(state), data_state)
            result["step"] = step
            tick = time.perf_counter() if step % config.log_every == 0 else tick
            if preempted and step < num_steps:
                # Raised before the `finally` below, whose ckpt.close() waits for the write.
                raise preemption.Preempted(step, str(ckpt.manager.directory), stop.signal_name)
        if start >= num_steps:  # already finished: report the final evaluation again
            result.update(
                evaluate(
                    task,
                    dp,
                    compiled_eval_step,
                    state,
                    datasets,
                    config=config,
                    model=model,
                    workdir=workdir,
                    step=start,
                )
            )
        if hasattr(task, "finalize"):
            result.update(
                task.finalize(
                    dp.to_host(state), result, config=config, model=model, workdir=workdir
                )
                or {}
            )
    except Exception as error:
        # An asynchronous checkpoint write that failed may surface in any later Orbax call, not
        # only in the Checkpointer's own (TensorStore's ValueError, its errno in the message).
        with checkpoint_integrity.disk_full_as_write_error(str(ckpt.manager.directory)):
            raise error
    finally:
        stop.__exit__(None, None, None)
        bar.close()
        try:
            ckpt.close()
        finally:
            writer.close()
            workdir_lock.release(workdir, lock)
    if is_main:
        report.plot_curves(workdir)
    return result
