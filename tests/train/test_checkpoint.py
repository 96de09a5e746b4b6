"""attnjax/checkpoint.py: Orbax save/restore, best-by-metric, load() for downstream users."""

import json
import os
from typing import Any

import chex
import flax
import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from attnjax import data
from attnjax.train import checkpoint


@flax.struct.dataclass
class State:  # the shape of a task state with BatchNorm statistics and EMA (e.g. a VQGAN)
    step: jax.Array
    params: Any
    opt_state: Any
    batch_stats: Any
    ema_params: Any = None


def make_config(**overrides):
    config = ml_collections.ConfigDict(
        dict(
            task="classification",
            model_name="vit",
            model=dict(width=8, depth=1),
            max_to_keep=2,
            best_metric="",
            best_mode="max",
        )
    )
    config.update(overrides)
    return config


def make_state(seed, ema=False):
    rng = np.random.default_rng(seed)
    params = {
        "dense": {
            "kernel": rng.normal(size=(3, 4)).astype(np.float32),
            "bias": rng.normal(size=(4,)).astype(np.float32),
        }
    }
    return State(
        step=jnp.asarray(seed, jnp.int32),
        params=params,
        opt_state=({"mu": jax.tree.map(np.zeros_like, params)}, jnp.asarray(7)),
        batch_stats={"bn": {"mean": rng.normal(size=(4,)).astype(np.float32)}},
        ema_params=jax.tree.map(lambda x: x * 0.5, params) if ema else None,
    )


def assert_trees_equal(a, b):
    chex.assert_trees_all_equal(a, b)


def test_save_restore_roundtrip_and_max_to_keep(tmp_path):
    workdir = str(tmp_path)
    config = make_config()
    ckpt = checkpoint.Checkpointer(workdir, config)
    for step in (1, 2, 3):
        ckpt.save(step, make_state(step), {"next_index": 10 * step})
    ckpt.close()

    assert checkpoint.latest_step(workdir) == 3
    ckpt = checkpoint.Checkpointer(workdir, config)
    assert ckpt.manager.all_steps() == [2, 3]
    iterator = data.make_iterator(grain.MapDataset.range(100))
    restored = ckpt.restore(make_state(0), iterator)
    ckpt.close()
    assert_trees_equal(restored, make_state(3))
    assert next(iterator) == 30 and iterator.get_state() == {"next_index": 31}


def test_best_checkpoint_and_load(tmp_path):
    workdir = str(tmp_path)
    config = make_config(best_metric="eval/accuracy")
    checkpoint.write_config(workdir, config)
    ckpt = checkpoint.Checkpointer(workdir, config)
    for step, accuracy in ((1, 0.5), (2, 0.9), (3, 0.7)):
        state = make_state(step, ema=True)
        ckpt.save(step, state, {"next_index": step})
        ckpt.save_best(step, state, {"eval/accuracy": accuracy, "eval/loss": 1.0 - accuracy})
    with pytest.raises(ValueError, match="config.best_metric='eval/accuracy'"):
        ckpt.save_best(4, make_state(4), {"eval/loss": 0.1})
    ckpt.close()

    loaded_config, params = checkpoint.load(workdir)
    assert loaded_config.model.to_dict() == config.model.to_dict()
    assert_trees_equal(params, make_state(3, ema=True).ema_params)  # EMA by default
    _, raw = checkpoint.load(workdir, use_ema=False)
    assert_trees_equal(raw, make_state(3).params)
    _, best = checkpoint.load(workdir, best=True, use_ema=False)
    assert_trees_equal(best, make_state(2).params)
    _, variables = checkpoint.load(workdir, step=2, use_ema=False, variables=("batch_stats",))
    assert sorted(variables) == ["batch_stats", "params"]
    assert_trees_equal(variables["batch_stats"], make_state(2).batch_stats)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a training workdir"):
        checkpoint.load(str(tmp_path))


def test_check_compatible_names_the_differing_field(tmp_path):
    workdir = str(tmp_path)
    config = make_config()
    checkpoint.write_config(workdir, config)
    checkpoint.check_compatible(workdir, make_config(model=dict(width=16, depth=1)))  # no ckpt yet
    ckpt = checkpoint.Checkpointer(workdir, config)
    ckpt.save(1, make_state(1), {"next_index": 1})
    ckpt.close()
    checkpoint.check_compatible(workdir, make_config(max_to_keep=5))  # same model: fine
    with pytest.raises(ValueError, match=r"config.model: checkpoint has .*'width': 8"):
        checkpoint.check_compatible(workdir, make_config(model=dict(width=16, depth=1)))
    with pytest.raises(ValueError, match="config.task"):
        checkpoint.check_compatible(workdir, make_config(task="vqgan"))


def test_latest_step_ignores_unfinished_and_missing(tmp_path):
    workdir = str(tmp_path)
    assert checkpoint.latest_step(workdir) is None
    ckpt = checkpoint.Checkpointer(workdir, make_config())
    ckpt.save(4, make_state(4), {"next_index": 0})
    ckpt.close()
    # A step Orbax had not finished writing when the process died: a temporary name, not counted.
    os.makedirs(os.path.join(workdir, "checkpoints", "9.orbax-checkpoint-tmp-123"))
    assert checkpoint.latest_step(workdir) == 4
    assert checkpoint.latest_step(workdir, best=True) is None


def test_a_checkpoint_of_other_process_counts_resumes_from_its_global_position(tmp_path):
    """Two processes' iterator states (written here as grain writes them) stand for one global
    position, which a run on one process resumes from; per-worker states, which are no
    position, are refused in one line naming what was saved and what was asked, and the
    checkpoint is kept where it is (it is intact); a missing process's file is damage."""
    workdir = str(tmp_path)
    ckpt = checkpoint.Checkpointer(workdir, make_config())
    ckpt.save(5, make_state(5), {"next_index": 7})
    ckpt.close()
    data_dir = os.path.join(workdir, "checkpoints", "5", "data")

    def write_states(*states):
        for name in os.listdir(data_dir):
            os.remove(os.path.join(data_dir, name))
        for index, state in enumerate(states):
            with open(os.path.join(data_dir, f"process_{index}-of-{len(states)}.json"), "w") as f:
                json.dump(state, f)

    write_states({"next_index": 7}, {"next_index": 7})
    ckpt = checkpoint.Checkpointer(workdir, make_config())
    iterator = data.make_iterator(grain.MapDataset.range(100))
    step, restored = ckpt.restore_intact(make_state(0), iterator)
    assert step == 5 and next(iterator) == 7
    assert_trees_equal(restored, make_state(5))

    workers = {"workers_state": {"0": {"next_index": 3}}, "last_worker_index": 0}
    write_states(workers, workers)
    with pytest.raises(
        checkpoint.elastic.CheckpointLayoutError,
        match=rf"^checkpoint 5 in {workdir}/checkpoints is intact but was saved by 2 "
        r"process\(es\) with per-worker iterator states \(config.data.worker_count > 0\); this "
        r"run has 1 process\(es\) with plain iterators, which take only the states of as many "
        r"processes: rerun on 2 process\(es\), or with --config.data.worker_count=0 where",
    ):
        ckpt.restore_intact(make_state(0), data.make_iterator(grain.MapDataset.range(100)))
    assert ckpt.manager.all_steps() == [5]

    write_states({"next_index": 7}, {"next_index": 7})
    os.remove(os.path.join(data_dir, "process_1-of-2.json"))
    with pytest.raises(checkpoint.checkpoint_integrity.DamagedCheckpointError):
        ckpt.restore_intact(make_state(0), data.make_iterator(grain.MapDataset.range(100)))
    assert os.path.isdir(os.path.join(workdir, "checkpoints", "damaged-5"))
    ckpt.close()


def test_a_logged_background_disk_full_error_is_handed_on_naming_its_directory():
    """What Orbax's writer thread logs (``logging.error(..., exc_info=True)`` inside its
    ``except``): a disk-full error reaches the callback, naming the directory written to."""
    import errno

    from absl import logging

    from attnjax.train import checkpoint_integrity

    got = []
    directories = ["/runs/a/checkpoints", "/runs/a/checkpoints_best"]
    with checkpoint_integrity.background_write_failures(directories, got.append):
        for error in (
            OSError(errno.EFBIG, "File too large"),
            ValueError("Failed writing /runs/a/checkpoints_best/3.tmp [os_error_code='28']"),
            ValueError("unrelated"),
        ):
            try:
                raise error
            except ValueError:
                logging.error("Failed in background save thread", exc_info=True)
            except OSError:
                logging.error("directory: /runs/a/checkpoints/3", exc_info=True)
        logging.error("no exception attached: ignored")
    logging.error("after the block", exc_info=OSError(errno.ENOSPC, "full"))
    assert [type(e) for e in got] == [checkpoint_integrity.CheckpointWriteError] * 2
    assert [e.errno for e in got] == [errno.EFBIG, errno.ENOSPC]
    assert "could not write a checkpoint to /runs/a/checkpoints: File too large" in str(got[0])
    assert "to /runs/a/checkpoints_best: No space left on device (errno ENOSPC)" in str(got[1])
