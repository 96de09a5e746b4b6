"""The training loop every task shares: ``train_and_evaluate(config, workdir) -> metrics``.

Order of business, so that a bad config fails before anything in the workdir changes:
task, parallel mode and batch divisibility, model identity against existing checkpoints,
model, data, train state (optimiser), and only then the workdir lock, checkpoints, config.json
and logs. What the run holds open (the lock, the watchdog, the checkpointer, the metric writer,
the progress bar, the signal handlers) sits on one ``contextlib.ExitStack``: closed in reverse,
so the checkpointer's pending writes finish before the lock is released, whatever ended the run,
and the watchdog (``attnjax.parallel.watchdog``) bounds each phase, that wait included.

Per-step RNG keys are ``fold_in(key(seed), step)``, the data stream is a function of the seed
and the iterator position, and both the state and the iterator position are checkpointed, so a
resumed run computes exactly what an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import numbers
from typing import Any, Callable

import jax
import numpy as np
import tqdm
from absl import logging

from attnjax import data
from attnjax.ops import autotune
from attnjax.parallel import data_parallel, sharding, watchdog
from attnjax.train import (
    checkpoint,
    checkpoint_integrity,
    executables,
    hashed_init,
    keys,
    nonfinite,
    performance,
    preemption,
    report,
    steps,
    workdir_lock,
)

# Config fields every run needs; the counts and sizes among them must be positive, except the
# steps: 0 trains nothing and saves the initial state (a pretrained model, used as it is).
POSITIVE_FIELDS = ("batch_size", "log_every", "eval_every", "checkpoint_every", "max_to_keep")
LOOP_FIELDS = ("task", "seed", "num_train_steps", *POSITIVE_FIELDS)


def _check_loop_fields(config) -> None:
    missing = [k for k in LOOP_FIELDS if k not in config]
    if missing:
        raise ValueError(f"config lacks the training-loop field(s) {missing}.")
    for key in POSITIVE_FIELDS:
        if int(config[key]) < 1:
            raise ValueError(f"config.{key}={config[key]!r} must be a positive integer.")
    if int(config.num_train_steps) < 0:
        raise ValueError(
            f"config.num_train_steps={config.num_train_steps!r} must be >= 0 (0: save the "
            "initial state)."
        )
    nonfinite.check_config(config)
    watchdog.settings(config)
    data_parallel.cpu_devices_wanted(config)  # rejects a negative config.cpu_devices


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


def train_and_evaluate(config, workdir: str, task) -> dict:
    """Trains ``task`` (a task module, see ``attnjax.tasks``) as ``config`` says in ``workdir``,
    resuming from its latest checkpoint if any.

    Returns the final metrics: ``step``, the last ``train/*`` averages, ``eval/*`` of the final
    evaluation, ``steps_per_sec`` (training steps only, compile excluded after the first log)
    and whatever the task's ``finalize`` adds. Calling it again on a finished workdir trains
    nothing and returns the final evaluation again (pipelines can rerun stages cheaply).
    """
    _check_loop_fields(config)
    data_parallel.maybe_initialize_distributed(config)
    dp = make_data_parallel(config, task)
    executables.read_ahead(config)  # the last run's programs, loaded while the data is read
    identity = getattr(task, "IDENTITY_FIELDS", checkpoint.DEFAULT_IDENTITY_FIELDS)
    checkpoint.check_compatible(workdir, config, identity)
    model = task.create_model(config)
    datasets = _make_datasets(config, task)
    init_rng, train_rng = keys.run_keys(config)
    # A resumed run replaces every value of its initial state: it needs only its shapes and layout.
    latest = checkpoint.latest_step(workdir) if dp.mode == "jit" else None
    resuming, prepared, state = latest is not None, None, None
    example = next(data.make_iterator(datasets.train, config.get("data")))
    # Steps to train and no kept train step (not a warm start): compiled on a thread from here.
    ahead = config.num_train_steps > (latest or 0) and not executables.reading_ahead()
    if resuming or (dp.mode == "jit" and ahead):
        state = _create_train_state(config, task, model, example, dp, init_rng, abstract=True)
        batch_and_key = (steps.placed_batch(example, dp), init_rng) if ahead else None
        prepared = steps.kept(config, task, model, dp, state, ahead=batch_and_key)
    if not resuming:
        state = _create_train_state(config, task, model, example, dp, init_rng)
    profile = performance.ProfileWindow(config, workdir, enabled=jax.process_index() == 0)

    is_main = jax.process_index() == 0
    with contextlib.ExitStack() as stack:
        if is_main:  # registered once taken: a failure to take it releases no one's lock
            stack.callback(workdir_lock.release, workdir, workdir_lock.acquire(workdir, config))
        # Bounds every phase from here on: a dead or stalled peer never hangs this process.
        progress = watchdog.Watchdog(config, workdir)
        stack.callback(progress.stop)
        stack.enter_context(_published())  # a failure while closing, too
        progress.enter("restore", 0)
        ckpt = checkpoint.Checkpointer(workdir, config)
        if jax.process_count() > 1:  # one process learns of a failed write at its next save
            managers = (m for m in (ckpt.manager, ckpt.best_manager) if m is not None)
            stack.enter_context(
                checkpoint_integrity.background_write_failures(
                    [str(m.directory) for m in managers], progress.fail
                )
            )
        stack.callback(ckpt.close)  # waits for pending writes
        stack.callback(progress.enter, "save")  # the wait for the pending writes
        train_iter = data.make_iterator(datasets.train, config.get("data"))
        start, state = _restore(ckpt, state, train_iter, workdir)
        if resuming and start is None:  # its steps went between the look and the restore
            state = _create_train_state(config, task, model, example, dp, init_rng)
        saves_initial = start is None and config.num_train_steps == 0
        start = start or 0
        if is_main:
            checkpoint.write_config(workdir, config)
            report.record_environment(workdir, start)
        _log_setup(config, datasets, dp)
        if dp.mode == "pmap":
            state = dp.place_state(state)
        if saves_initial:
            ckpt.save(0, dp.checkpointable(state), train_iter.get_state())
        train_step, eval_step = prepared or steps.kept(config, task, model, dp, state)
        batches = data_parallel.Prefetcher(
            train_iter, dp.shard_batch, size=config.get("prefetch", 2)
        )
        writer = report.MetricWriter(workdir, enabled=is_main, resume_step=start)
        stack.callback(writer.close)
        run = _Run(
            config,
            task,
            model,
            workdir,
            dp,
            datasets,
            train_step,
            eval_step,
            ckpt,
            writer,
            watch=nonfinite.NonfiniteWatch(config, start),
            bar=stack.enter_context(_progress_bar(config, start, enabled=is_main)),
            # pmap's per-device step is not counted: no MFU there.
            utilization=performance.Utilization(dp.mesh.devices.flat, config),
            profile=profile,
            progress=progress,
        )
        stack.callback(profile.stop)
        stop = stack.enter_context(preemption.StopRequest())
        # An asynchronous checkpoint write that failed may surface in any later Orbax call, not
        # only in the Checkpointer's own (TensorStore's ValueError, its errno in the message).
        # Published at once: the closing may wait for the others.
        with (
            _published(),
            checkpoint_integrity.disk_full_as_write_error(str(ckpt.manager.directory)),
        ):
            state, result = _train(
                run, state, start, batches, keys.StepKeys(config, train_rng, config.log_every), stop
            )
            _finish(run, state, start, result)
    if is_main:
        report.plot_curves(workdir)
    return result


@contextlib.contextmanager
def _published():
    """A failure (not a preemption) inside the block is published to the other processes, whose
    watchdogs then stop them with its line; the error goes on."""
    try:
        yield
    except preemption.Preempted:
        raise
    except Exception as error:
        watchdog.publish_failure(error)
        raise


def make_data_parallel(config, task, devices=None) -> data_parallel.DataParallel:
    """The run's placement: ``config.mesh`` over ``devices`` (default ``run_devices``) with the
    task's partition rules."""
    return data_parallel.DataParallel(
        config.get("parallel", "jit"),
        config.batch_size,
        config.get("eval_batch_size") or None,
        mesh=config.get("mesh", None),
        rules=sharding.rules_for(config, getattr(task, "SHARDING_RULES", None)),
        devices=data_parallel.run_devices(config) if devices is None else devices,
    )


def _make_datasets(config, task) -> data.Datasets:
    make_datasets = getattr(task, "make_datasets", data.make_datasets)
    return make_datasets(
        config, process_index=jax.process_index(), process_count=jax.process_count()
    )


def _create_train_state(config, task, model, example, dp, init_rng, abstract=False):
    """The task's initial state for ``example`` (a train batch); under jit already in the mesh
    layout restored checkpoints take. ``abstract``: its ``jax.ShapeDtypeStruct``s in that layout
    (jit), a target to restore into."""
    if abstract:
        shapes = abstract_train_state(config, task, model, example, init_rng)
        return data_parallel.placed_shapes(shapes, dp.state_shardings(shapes))
    state = initial_state(task, config, model, example, init_rng)
    return dp.place_state(state) if dp.mode == "jit" else state


def initial_state(task, config, model, example, rng):
    """``task.create_train_state``, computed on the host's CPU where the default device is an
    accelerator (the caller places it on the mesh): XLA compiles an initialisation 3-5x sooner
    for the CPU (benchmarks/results/initial_state_h200.json). The random bits are the same on
    every backend; a value drawn from them may differ from the GPU's in its last bits."""
    cpu = None if jax.default_backend() == "cpu" else _host_cpu()
    if cpu is None:
        return task.create_train_state(rng, config, model, example)
    with jax.default_device(cpu):
        return task.create_train_state(jax.device_put(rng, cpu), config, model, example)


def _host_cpu():
    """The host's first CPU device; None where ``JAX_PLATFORMS`` leaves out the CPU."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None


def abstract_train_state(config, task, model, example, rng):
    """The task's train state as ``jax.ShapeDtypeStruct``s, nothing initialised: the state's
    shapes for ``example`` (a batch, or its ``ShapeDtypeStruct``s). ``init_from``'s pretrained
    weights replace values, never shapes, and are not read."""
    config = config.copy_and_resolve_references()
    if config.get("init_from"):
        config.init_from = ""
    with hashed_init.shapes_only():
        return jax.eval_shape(
            lambda key, batch: task.create_train_state(key, config, model, batch), rng, example
        )


def _restore(ckpt, state, train_iter, workdir) -> tuple[int | None, Any]:
    """The newest intact checkpoint, ``train_iter`` set to its position -> ``(step, state)``;
    ``(None, state)`` on a fresh start."""
    start, state = ckpt.restore_intact(state, train_iter)
    if start is not None:
        logging.info("resumed from %s at step %d", workdir, start)
    return start, state


def _log_setup(config, datasets, dp) -> None:
    logging.info(
        "%s: %d train / %d eval examples, %d devices (%s), global batch %d",
        config.task,
        datasets.num_train_examples,
        datasets.num_eval_examples,
        dp.mesh.size,
        dp.mode,
        config.batch_size,
    )


def _progress_bar(config, start: int, *, enabled: bool) -> tqdm.tqdm:
    return tqdm.tqdm(
        total=config.num_train_steps,
        initial=start,
        desc=config.task,
        unit="step",
        disable=not enabled or config.get("quiet", False),
        dynamic_ncols=True,
    )


@dataclasses.dataclass
class _Run:
    """What the step loop's helpers share, fixed once the run is set up."""

    config: Any
    task: Any
    model: Any
    workdir: str
    dp: data_parallel.DataParallel
    datasets: data.Datasets
    train_step: Callable
    eval_step: Callable
    ckpt: checkpoint.Checkpointer
    writer: report.MetricWriter
    watch: nonfinite.NonfiniteWatch
    bar: tqdm.tqdm
    utilization: performance.Utilization
    profile: performance.ProfileWindow
    progress: watchdog.Watchdog


def _model_flops_step(run: _Run) -> Callable:
    """The step whose products MFU counts: the train step, or where the model recomputes its
    blocks (remat), the same step traced without recomputing them (traced, never compiled)."""
    if (plain := performance.without_remat(run.model)) is run.model:
        return run.train_step
    step = functools.partial(run.task.train_step, config=run.config, model=plain, axis_name=None)
    return jax.jit(run.dp.traced_on_mesh(step))


def _train(run: _Run, state, start: int, batches, step_keys, stop) -> tuple[Any, dict]:
    """Steps ``start + 1 .. num_train_steps``, logging, evaluating and saving on schedule ->
    ``(state, result)``. Raises ``Preempted`` after saving when ``stop`` asks for it."""
    config, num_steps = run.config, run.config.num_train_steps
    result: dict = {"step": start}
    pending = []  # metrics of the steps since the last log, still on the device
    throughput = performance.Throughput(start, num_steps)
    for step in range(start + 1, num_steps + 1):
        run.progress.enter("step", step)
        batch, data_state = next(batches)
        run.profile.before(step)
        if step == start + 1:
            # CPU kernel choices this run's programs meet are timed while they are traced.
            with autotune.timing_window():
                state, metrics = run.train_step(state, batch, step_keys(step - 1))
            _report_first_step(run, metrics)
        else:
            state, metrics = run.train_step(state, batch, step_keys(step - 1))
        run.profile.after(step, state)
        pending.append(metrics)
        run.bar.update(1)
        last = step == num_steps
        if step % config.log_every == 0 or last:
            # The step's FLOPs, for MFU, counted once: the shapes it just ran on.
            if run.dp.mode == "jit" and run.utilization.flops_per_step is None:
                args = (state, batch, step_keys(step - 1))
                run.utilization.count(_model_flops_step(run), *args, kept_by=run.train_step)
            result.update(_log_train(run, step, pending, throughput))
            pending = []
        if step % config.eval_every == 0 or last:
            run.progress.enter("evaluation", step)
            _check_pending_finite(run, step, pending)
            result.update(_evaluate_and_keep_best(run, state, step))
        preempted = stop.requested(step)
        if step % config.checkpoint_every == 0 or last or preempted:
            run.progress.enter("save", step)
            _check_pending_finite(run, step, pending)
            run.ckpt.save(step, run.dp.checkpointable(state), data_state)
        result["step"] = step
        if step % config.log_every == 0:
            throughput.restart()
        if preempted and not last:
            # The caller's exit stack closes the checkpointer, which waits for this save.
            raise preemption.Preempted(step, str(run.ckpt.manager.directory), stop.signal_name)
    return state, result


def _report_first_step(run: _Run, metrics) -> None:
    """The wait before the first result, and where its compiled programs came from."""
    jax.block_until_ready(metrics)
    line = executables.first_step_line()
    logging.info(line)
    if jax.process_index() == 0 and not run.config.get("quiet", False):
        run.bar.write(line)


def _log_train(run: _Run, step: int, pending: list, throughput: performance.Throughput) -> dict:
    """Fetches the metrics of the steps since the last log, checks their non-finite flags and
    writes their averages -> the scalars written."""
    fetched = run.dp.fetch(pending)
    run.watch.check(step, [m.pop("nonfinite") for m in fetched])
    logged = jax.tree.map(lambda *xs: float(np.mean(xs)), *fetched)
    throughput.add(step, len(pending))
    scalars = {f"train/{k}": v for k, v in logged.items()}
    if throughput.steps:
        scalars["steps_per_sec"] = throughput.steps / throughput.seconds
        run.progress.measured(throughput.seconds / throughput.steps)
        scalars.update(run.utilization.scalars(scalars["steps_per_sec"]))
    if run.watch.mode == "skip":
        scalars["train/skipped_steps"] = run.watch.skipped
    run.writer.write(step, scalars)
    shown = "loss" if "loss" in logged else min(logged)
    run.bar.set_postfix({shown: f"{logged[shown]:.4f}"}, refresh=False)
    return scalars


def _check_pending_finite(run: _Run, step: int, pending: list) -> None:
    """Before a save: the flags of the steps not yet fetched (one small transfer)."""
    run.watch.check(step, run.dp.fetch([m["nonfinite"] for m in pending]))


def _evaluate(run: _Run, state, step: int) -> dict:
    with autotune.timing_window():  # only the first traces; later ones reuse its programs
        return evaluate(
            run.task,
            run.dp,
            run.eval_step,
            state,
            run.datasets,
            config=run.config,
            model=run.model,
            workdir=run.workdir,
            step=step,
        )


def _evaluate_and_keep_best(run: _Run, state, step: int) -> dict:
    """Evaluates, writes and shows the metrics, saves the best checkpoint -> the metrics."""
    metrics = _evaluate(run, state, step)
    run.writer.write(step, metrics)
    run.bar.write(report.format_table(step, metrics))
    run.ckpt.save_best(step, run.dp.checkpointable(state), metrics)
    return metrics


def _finish(run: _Run, state, start: int, result: dict) -> None:
    """Adds to ``result`` the final evaluation of an already finished run (trained nothing) and
    what the task's ``finalize`` returns; a run that trained also logs the latter's numbers
    (FIDs computed once, at the end) at its last step."""
    last = run.config.num_train_steps
    run.progress.enter("finish", last)
    if start >= last:
        result.update(_evaluate(run, state, start))
    if hasattr(run.task, "finalize"):
        host = run.dp.to_host(state)
        extra = run.task.finalize(
            host, result, config=run.config, model=run.model, workdir=run.workdir
        )
        result.update(extra or {})
        logged = {k: v for k, v in (extra or {}).items() if isinstance(v, numbers.Real)}
        if logged and start < last:
            run.writer.write(last, logged)
