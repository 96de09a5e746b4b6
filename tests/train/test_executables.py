"""attnjax/train/executables.py: a program found by its key runs without tracing the Python again,
gives the values the traced program gives, and any change to the key (identity, source, flags,
shapes) traces and compiles anew; a damaged entry is compiled again and replaced."""

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from attnjax import compat, xla_cpu
from attnjax.train import compilation_cache, executables, host_trees, performance


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(executables.ENV_DIR, str(tmp_path / "executables"))
    return tmp_path / "executables"


def counted_step():
    """A jitted ``step(state, x)`` and the list of its tracings."""
    traced = []

    def step(state, x):
        traced.append(x.shape)
        new = {"w": jnp.tanh(state["w"] @ x), "n": state["n"] + 1}
        return new, {"loss": jnp.mean(new["w"] ** 2)}

    return jax.jit(step, donate_argnums=(0,)), traced


def state():
    return {"w": jnp.arange(16.0).reshape(4, 4) / 16, "n": jnp.int32(0)}


def run(identity, x=None):
    """Two steps of the program, cached under ``identity`` (None: not cached)."""
    jitted, traced = counted_step()
    step = (
        jitted if identity is None else executables.ExecutableCache(identity).cached("step", jitted)
    )
    x = jnp.eye(4) * 0.5 if x is None else x
    s, out = step(state(), x)
    s, out = step(s, x)  # the same program again, in this process
    return jax.device_get((s, out)), traced


def test_a_second_process_loads_the_program_without_tracing_and_computes_the_same(cache_dir):
    before = executables.counts()
    first, traced = run({"config": {"lr": 1}})
    assert traced == [(4, 4)]  # traced once for both calls
    assert [p.suffix for p in cache_dir.iterdir()] == [executables.SUFFIX]
    second, traced = run({"config": {"lr": 1}})
    assert traced == []  # loaded: the Python was not traced
    after = executables.counts()
    assert after["written"] - before["written"] == 1 and after["loaded"] - before["loaded"] == 1
    expected, _ = run(None)
    for got in (first, second):
        jax.tree.map(np.testing.assert_array_equal, got, expected)


def test_a_program_prepared_from_shapes_is_what_the_first_call_runs(cache_dir, monkeypatch):
    """``prepare`` with ``jax.ShapeDtypeStruct``s traces once, here, and compiles and keeps the
    program on a thread; the first call with values of that signature runs it (nothing traced
    or compiled again) and gives the plain program's values."""
    before = executables.counts()
    jitted, traced = counted_step()
    cache = executables.ExecutableCache({"config": {"lr": 1}})
    step = cache.cached("step", jitted)
    x = jnp.eye(4) * 0.5
    shapes = jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding), (state(), x)
    )
    step.prepare(*shapes)
    assert traced == [(4, 4)]
    monkeypatch.setattr(cache, "_program", lambda *a: pytest.fail("compiled at the call"))
    s, out = step(state(), x)
    s, out = step(s, x)
    assert traced == [(4, 4)] and executables.counts()["written"] == before["written"] + 1
    expected, _ = run(None)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get((s, out)), expected)
    step.prepare(*shapes)  # compiled already: nothing traced again
    assert traced == [(4, 4)]
    # A new run of the same identity: kept, so prepare leaves it to the load.
    jitted, traced = counted_step()
    step = executables.ExecutableCache({"config": {"lr": 1}}).cached("step", jitted)
    step.prepare(*shapes)
    assert traced == []
    again, _ = run({"config": {"lr": 1}})
    jax.tree.map(np.testing.assert_array_equal, again, expected)


@pytest.mark.parametrize("change", ["identity", "source", "xla_flags", "dtype"])
def test_any_change_in_the_key_traces_and_compiles_again(cache_dir, monkeypatch, change):
    run({"config": {"lr": 1}})
    x = None
    identity = {"config": {"lr": 1}}
    if change == "identity":
        identity = {"config": {"lr": 2}}
    elif change == "source":
        monkeypatch.setattr(executables, "source_digest", lambda: "edited")
    elif change == "xla_flags":
        monkeypatch.setenv(
            "XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false"
        )
    else:
        x = jnp.eye(4, dtype=jnp.float16) * 0.5
    _, traced = run(identity, x)
    assert len(traced) == 1
    assert len(list(cache_dir.iterdir())) == 2


def test_the_cached_step_still_traces_and_lowers_for_whoever_reads_its_program(cache_dir):
    jitted, traced = counted_step()
    step = executables.ExecutableCache({}).cached("step", jitted)
    jaxpr = step.trace(state(), jnp.eye(4)).jaxpr  # what the FLOP count for MFU reads
    assert "tanh" in str(jaxpr) and traced == [(4, 4)]
    assert "tanh" in step.lower(state(), jnp.eye(4)).as_text()


def test_the_mfu_count_is_kept_beside_the_step_and_read_by_a_run_that_loads_it(cache_dir):
    """A repeated run loads its step without tracing it, and reads the step's FLOP count
    instead of tracing the step for it; a damaged count is traced and written again."""
    x = jnp.eye(4)
    for kept, expected in ((False, [(4, 4)]), (True, []), ("damaged", [(4, 4)])):
        jitted, traced = counted_step()
        step = executables.ExecutableCache({"config": {}}).cached("step", jitted)
        step(state(), x)
        note = step.beside(performance.NOTE, state(), x)
        assert note.exists() == bool(kept) and note.name.endswith(executables.NOTE_SUFFIX)
        if kept == "damaged":
            note.write_text("half a numb")
        utilization = performance.Utilization(jax.devices("cpu")[:1])
        utilization.count(step, state(), x, kept_by=step)
        assert traced == expected, kept
        assert utilization.flops_per_step == 2 * 4 * 4 * 4 == float(note.read_text())


def test_one_step_called_with_two_signatures_in_turn_runs_each_own_program(cache_dir):
    jitted, traced = counted_step()
    step = executables.ExecutableCache({}).cached("step", jitted)
    wide, half = jnp.eye(4) * 0.5, jnp.eye(4, dtype=jnp.float16) * 0.5
    got = [step(state(), x) for x in (wide, half, wide, half)]
    assert traced == [(4, 4), (4, 4)]  # one program per signature, each traced once
    assert got[0][0]["w"].dtype == jnp.float32 and got[1][1]["loss"].dtype == jnp.float32
    plain = [jax.jit(counted_step()[0])(state(), x) for x in (wide, half)]
    for got_one, expected in zip(got, plain * 2):
        jax.tree.map(np.testing.assert_array_equal, got_one, expected)


def test_inside_another_trace_the_step_is_traced_as_a_plain_jit(cache_dir):
    jitted, traced = counted_step()
    step = executables.ExecutableCache({}).cached("step", jitted)
    shapes = jax.eval_shape(step, state(), jnp.eye(4))
    assert shapes[1]["loss"].shape == () and traced == [(4, 4)]
    assert list(cache_dir.glob("*")) == []  # nothing compiled or kept


def test_a_damaged_entry_is_compiled_again_and_replaced(cache_dir):
    first, _ = run({"config": {}})
    (entry,) = cache_dir.iterdir()
    entry.write_bytes(entry.read_bytes()[:100])  # cut short
    second, traced = run({"config": {}})
    assert traced == [(4, 4)]
    jax.tree.map(np.testing.assert_array_equal, second, first)
    _, traced = run({"config": {}})
    assert traced == []  # the replacement loads


def test_off_leaves_the_jitted_function_as_it_is(monkeypatch, tmp_path):
    monkeypatch.setenv(executables.ENV_DIR, "off")
    jitted, _ = counted_step()
    assert executables.ExecutableCache({}).cached("step", jitted) is jitted
    # By default the entries live in the compilation cache's directory, and without it, nowhere.
    monkeypatch.delenv(executables.ENV_DIR)
    monkeypatch.setattr(compilation_cache, "current_directory", lambda: str(tmp_path))
    assert executables.directory() == tmp_path / executables.SUBDIRECTORY
    monkeypatch.setattr(compilation_cache, "current_directory", lambda: None)
    assert executables.ExecutableCache({}).cached("step", jitted) is jitted


def test_the_directory_is_kept_under_its_size_bound(cache_dir, monkeypatch):
    monkeypatch.setenv(executables.ENV_MAX_GB, "0")  # every entry past the bound once written
    run({"config": {}})
    assert list(cache_dir.iterdir()) == []


def test_a_task_outside_attnjax_is_keyed_by_its_source(tmp_path):
    from ml_collections import ConfigDict

    from attnjax.tasks import classification

    config = ConfigDict({"task": "mine", "lr": 0.1})
    assert executables.identity_of(config, classification) == {
        "config": {"task": "mine", "lr": 0.1}
    }
    module = tmp_path / "my_task.py"
    module.write_text("STEP = 1\n")
    task = type("Task", (), {"__file__": str(module)})
    first = executables.identity_of(config, task)["task_source"]
    module.write_text("STEP = 2\n")
    assert executables.identity_of(config, task)["task_source"] != first


# Runs a one-device program under the cache in a process with two CPU devices -> its result.
ONE_DEVICE_OF_TWO = """
import sys, jax, jax.numpy as jnp
from attnjax.train import executables
assert len(jax.devices()) == 2
init = jax.jit(lambda r, x: x * 2 + jax.random.normal(r, x.shape))
step = executables.ExecutableCache({"config": {}}).cached("init", init)
print(float(step(jax.random.key(0), jnp.ones(3)).sum()), executables.counts())
"""


def test_a_program_of_one_device_among_several_loads_onto_that_device(cache_dir):
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    runs = [
        subprocess.run(
            [sys.executable, "-c", ONE_DEVICE_OF_TWO], env=env, capture_output=True, text=True
        )
        for _ in range(2)
    ]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    (first, written), (second, loaded) = (r.stdout.split(" ", 1) for r in runs)
    assert first == second and "'written': 1" in written and "'loaded': 1" in loaded


# A program run under the cache, with JAX's persistent cache in argv[1] -> its result and counts.
WITH_JAX_CACHE = """
import json, sys, jax, jax.numpy as jnp
from attnjax.train import compilation_cache, executables
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
compilation_cache.enable()

def chain(x):
    for i in range(20):
        x = jnp.sin(x[::-1] * 1.1 + i) @ x
    return x

step = executables.ExecutableCache({"config": {}}).cached("chain", jax.jit(chain))
value = float(step(jnp.eye(16) / 4).sum())
other = float(jax.jit(lambda x: jnp.cos(x) @ x)(jnp.eye(16)).sum())  # not kept: JAX's cache
print(json.dumps([value, other, executables.counts(), compilation_cache.counts()]))
"""


def test_a_program_jaxs_cache_holds_is_compiled_again_kept_and_then_loaded(cache_dir, tmp_path):
    import subprocess
    import sys

    def run(executable_cache):
        env = {**os.environ, executables.ENV_DIR: executable_cache}
        command = [sys.executable, "-c", WITH_JAX_CACHE, str(tmp_path / "jax")]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    value, other, _, jax_counts = run("off")  # JAX's cache now holds both programs
    assert jax_counts["hits"] == 0 and jax_counts["misses"] >= 2
    # XLA:CPU serialises an executable read back from JAX's cache without its code: the kept
    # program is compiled past that cache, and the plain jit after it still reads from it.
    again, other_again, counts, jax_counts = run(str(cache_dir))
    assert (again, other_again) == (value, other)
    assert counts["written"] == 1 and counts["loaded"] == 0
    assert jax_counts["hits"] >= 1 and jax_counts["misses"] == 0
    third, _, counts, _ = run(str(cache_dir))  # loaded as kept, not traced
    assert third == value and counts["loaded"] == 1 and counts["written"] == 0


def counted_init():
    """A jitted ``init(rng, x)`` (random weights shaped by ``x``) and the list of its tracings."""
    traced = []

    def init(rng, x):
        traced.append(x.shape)
        k1, k2 = jax.random.split(rng)
        return {"w": jax.random.normal(k1, (x.shape[-1], 3)), "b": jax.random.uniform(k2, (3,))}

    return jax.jit(init), traced


def test_kept_outputs_are_read_back_for_equal_arguments_and_not_for_others(cache_dir):
    rng, x = np.asarray(jax.random.PRNGKey(3)), np.ones((2, 5), np.float32)
    expected = jax.device_get(counted_init()[0](rng, x))
    before = executables.counts()["results_read"]
    jitted, traced = counted_init()
    first = executables.ExecutableCache({"config": {}}).memoized("init", jitted)(rng, x)
    assert traced == [(2, 5)]
    assert sorted(p.suffix for p in cache_dir.iterdir()) == [
        executables.SUFFIX,
        executables.RESULTS_SUFFIX,
    ]
    jitted, traced = counted_init()
    second = executables.ExecutableCache({"config": {}}).memoized("init", jitted)(rng, x)
    assert traced == [] and executables.counts()["results_read"] == before + 1
    for got in (first, second):
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(got), expected)
    # Where the program leaves its outputs: the default device, uncommitted.
    assert all(not leaf.committed for leaf in jax.tree.leaves(second))
    # Other values of an argument (a batch of other pixels, another seed): the program runs.
    for other_rng, other_x in ((rng, x * 2), (np.asarray(jax.random.PRNGKey(4)), x)):
        jitted, traced = counted_init()
        got = executables.ExecutableCache({"config": {}}).memoized("init", jitted)(
            other_rng, other_x
        )
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(got), jitted(other_rng, other_x))
    assert executables.counts()["results_read"] == before + 1


def initialiser(rng):
    """Draws through erf_inv and a matrix product: LLVM's optimisation changes their rounding."""
    a = jax.random.normal(rng, (64, 32))
    return {"a": a, "w": a @ jax.random.truncated_normal(rng, -2.0, 2.0, (32, 8))}


def shifted_initialiser(rng):
    return initialiser(jax.random.fold_in(rng, 7))


# XLA's defaults for a training run's programs (the suite's own flags compile unoptimised).
OPTIMISED = {"xla_backend_optimization_level": 3}
if compat.xla_cpu_loop_emitter_flags():
    OPTIMISED["xla_cpu_use_fusion_emitters"] = True


def test_run_once_programs_agree_with_optimised_ones_to_float32_rounding():
    rng = np.asarray(jax.random.PRNGKey(0))
    optimised = jax.device_get(jax.jit(initialiser, compiler_options=OPTIMISED)(rng))
    quick = jax.jit(initialiser, compiler_options=xla_cpu.run_once_options(64 * 32 + 64 * 8))
    quick = jax.device_get(quick(rng))
    assert not np.array_equal(optimised["a"], quick["a"])  # two programs, told apart
    for x, y in zip(jax.tree.leaves(optimised), jax.tree.leaves(quick)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_a_small_run_once_program_compiles_with_the_run_once_options_a_large_one_without(
    cache_dir, monkeypatch
):
    # Options whose program the suite's default flags do not compile: the outputs tell which ran.
    bound = 64 * 32 + 64 * 8  # the initialiser's output elements
    monkeypatch.setattr(xla_cpu, "RUN_ONCE_MAX_ELEMENTS", bound)
    monkeypatch.setattr(compat, "xla_cpu_loop_emitter_flags", lambda: [])
    monkeypatch.setattr(xla_cpu, "RUN_ONCE_OPTIONS", OPTIMISED)
    rng = np.asarray(jax.random.PRNGKey(1))

    def once(identity):
        cache = executables.ExecutableCache(identity)
        program = cache.cached("init", jax.jit(shifted_initialiser), run_once=True)
        return jax.device_get(program(rng))

    # Each kept program compiled before any reference, from a program no other test compiles: an
    # executable that JAX's persistent cache gave this process (in memory since) is serialised
    # without its code (executables._compile).
    small = [once({"config": 1}), once({"config": 1})]  # compiled and kept, then loaded
    monkeypatch.setattr(xla_cpu, "RUN_ONCE_MAX_ELEMENTS", bound - 1)
    large = once({"config": 2})
    monkeypatch.setattr(xla_cpu, "RUN_ONCE_MAX_ELEMENTS", bound)
    config = ml_collections.ConfigDict({"seed": 3})  # executables.jit: the run-once path
    for keep in (False, True):
        program = executables.jit(config, f"init_{keep}", shifted_initialiser, keep_outputs=keep)
        small.append(jax.device_get(program(rng)))
    options = jax.device_get(jax.jit(shifted_initialiser, compiler_options=OPTIMISED)(rng))
    plain = jax.device_get(jax.jit(shifted_initialiser)(rng))
    assert not np.array_equal(plain["a"], options["a"])
    for got in small:
        jax.tree.map(np.testing.assert_array_equal, got, options)
    jax.tree.map(np.testing.assert_array_equal, large, plain)


def test_damaged_kept_outputs_run_the_program_and_are_replaced(cache_dir):
    rng, x = np.asarray(jax.random.PRNGKey(3)), np.ones((2, 5), np.float32)
    jitted, _ = counted_init()
    expected = jax.device_get(executables.ExecutableCache({}).memoized("init", jitted)(rng, x))
    (kept,) = cache_dir.glob(f"*{executables.RESULTS_SUFFIX}")
    kept.write_bytes(kept.read_bytes()[:50])
    before = executables.counts()["results_read"]
    jitted, _ = counted_init()
    got = executables.ExecutableCache({}).memoized("init", jitted)(rng, x)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(got), expected)
    assert executables.counts()["results_read"] == before  # run, not read
    jitted, traced = counted_init()
    executables.ExecutableCache({}).memoized("init", jitted)(rng, x)
    assert executables.counts()["results_read"] == before + 1 and traced == []


def test_arguments_placed_by_the_caller_or_traced_run_the_program(cache_dir):
    rng, x = jax.random.PRNGKey(3), jnp.ones((2, 5))
    jitted, _ = counted_init()
    memoized = executables.ExecutableCache({}).memoized("init", jitted)
    placed = jax.device_put(rng, jax.devices()[0])  # committed: the outputs would be too
    got = memoized(placed, x)
    assert all(leaf.committed for leaf in jax.tree.leaves(got))
    jax.eval_shape(memoized, rng, x)
    assert list(cache_dir.glob(f"*{executables.RESULTS_SUFFIX}")) == []


def test_host_arguments_whose_bytes_are_not_their_values_run_the_program(cache_dir):
    names = np.array(["a", None], dtype=object)  # pointers: equal bytes, other values
    memoized = executables.ExecutableCache({}).memoized("size", jax.jit(lambda n: n + 1))
    assert host_trees.on_default_device(names) is False
    assert int(memoized(np.int32(2))) == 3  # plain integers are kept
    assert len(list(cache_dir.glob(f"*{executables.RESULTS_SUFFIX}"))) == 1


def test_the_next_run_loads_its_listed_programs_ahead_and_a_damaged_list_reads_none(
    cache_dir, monkeypatch
):
    monkeypatch.setattr(executables, "_run", [None, []])  # this test's run only
    config = ml_collections.ConfigDict({"lr": 1})
    x = jnp.eye(4) * 0.5

    def start_and_step():
        executables.read_ahead(config)
        step = executables.jit(config, "step", lambda s, x: counted_step()[0](s, x))
        return jax.device_get(step(state(), x))

    first = start_and_step()  # nothing listed before: compiled, kept and listed
    (listed,) = cache_dir.glob("run-*.json")
    (entry,) = cache_dir.glob(f"step-*{executables.SUFFIX}")
    assert json.loads(listed.read_text()) == [entry.name]
    for damaged_list, read_ahead in ((False, 1), (True, 0)):
        if damaged_list:
            listed.write_text('{"not": "a list"')
        before = executables.counts()
        again = start_and_step()
        after = executables.counts()
        assert after["loaded"] - before["loaded"] == 1 and after["written"] == before["written"]
        assert after["read_ahead"] - before["read_ahead"] == read_ahead
        jax.tree.map(np.testing.assert_array_equal, again, first)
