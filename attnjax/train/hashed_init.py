"""A model's initialisation with its random hashes computed together: the same values in a
program that compiles in less time.

Every random initial value costs the compiled initialisation two or more Threefry-2x32 hashes
(the key folded with the parameter's path, then its bits), and on XLA:CPU each hash is a loop
of its own (JAX lowers it rolled there), compiled apart: about half of a small model's init
compile (benchmarks/results/hashed_init.md). ``hashed_together(fn)`` evaluates ``fn``'s program
with the hashes deferred: each round runs every operation whose inputs are ready, then hashes
all the waiting inputs as one concatenated call, and so on, as many rounds as the longest chain
of keys. Threefry is elementwise, so each value gets the same bits as before; the outputs are
bit-identical to ``fn``'s (tests/train/test_hashed_init.py).

Hashes of more than ``LARGEST_BATCHED`` elements are not concatenated: their broadcast keys and
counters would be written out in full (ViT-B/16's 86M draws ran 4x slower so). On a CPU those of
one shape (a ViT's blocks' matrices) are one loop over the draws around one hash instead
(``_stacked``). A program this cannot rewrite (a key array in any other operation, an effect, a
loop over keys) runs as ``fn``, and so does one the rewrite fails on (logged). For
initialisations only: the rewrite drops custom derivative rules.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import types
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from attnjax import compat

LARGEST_BATCHED = 1 << 18
LARGEST_STACKED = 1 << 25  # elements one loop over large draws writes: 2 x 128 MiB of bits
_CALLS = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call")


class _Unsupported(Exception):
    pass


def hashed_together(fn: Callable) -> Callable:
    """``fn`` (array arguments -> a pytree of arrays) with its Threefry hashes batched; the same
    outputs, bit for bit."""

    @functools.wraps(fn)
    def batched(*args):
        internals = _internals()
        if internals is None or _plain.active:
            return fn(*args)
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        if any(internals.is_key(v.aval) for v in closed.jaxpr.outvars):
            return fn(*args)
        leaves = jax.tree.leaves(args)
        try:
            inputs, equations = [_Slot() for _ in leaves], []
            outputs = _inline(internals, closed, inputs, equations, {}, {})
            # A key argument enters as its data, as the key operations were expanded to take it.
            data = [
                jax.random.key_data(x) if internals.is_key(jax.typeof(x)) else x for x in leaves
            ]
            outputs = _evaluate(internals, equations, dict(zip(inputs, data)), outputs)
        except _Unsupported:
            return fn(*args)
        except Exception as error:  # a jax whose programs differ: its values stay right, slower
            logging.warning("initialisation traced as written: hashed_init failed (%r)", error)
            return fn(*args)
        return jax.tree.unflatten(jax.tree.structure(shapes), outputs)

    return batched


class _Plain(threading.local):
    active = False


_plain = _Plain()


@contextlib.contextmanager
def shapes_only():
    """Within it ``hashed_together(fn)`` is ``fn``: for ``jax.eval_shape``, where the rewrite
    would only trace the program a second time."""
    before, _plain.active = _plain.active, True
    try:
        yield
    finally:
        _plain.active = before


class _Slot:
    """A value of the flattened program, set once it has been computed."""

    __slots__ = ()


def _inline(internals, closed, inputs: list, equations: list, expanded: dict, seen: dict) -> list:
    """``closed`` appended to ``equations`` as ``(primitive, params, inputs, outputs)`` over
    physical values: nested calls inlined, key arrays as their uint32 data, the key operations
    expanded into the hashes they make (``expanded``: those programs by signature, traced once
    per rewrite, under the config it runs with: ``jax_threefry_partitionable`` changes them),
    an operation already appended on the same inputs not appended again (``seen``: so that the
    counters of equal-shaped draws are one value, which ``_stacked`` need not copy) -> its
    outputs."""
    jaxpr, env = closed.jaxpr, {}

    def read(var):
        return ("literal", var.val) if isinstance(var, internals.Literal) else env[var]

    for var, value in zip(jaxpr.constvars, closed.consts):
        env[var] = ("literal", value)
    env.update(zip(jaxpr.invars, inputs))
    for equation in jaxpr.eqns:
        ins, primitive, params = (
            [read(v) for v in equation.invars],
            equation.primitive,
            equation.params,
        )
        if primitive.name in _CALLS:
            inner = params.get("jaxpr", params.get("call_jaxpr"))
            if not hasattr(inner, "consts"):
                raise _Unsupported(primitive.name)
            outs = _inline(internals, inner, ins, equations, expanded, seen)
        elif primitive in (internals.wrap, internals.unwrap):
            outs = ins
        elif primitive in internals.expansions:
            avals = [v.aval for v in equation.invars]
            traced = _expanded(internals, primitive, avals, params, expanded)
            outs = _inline(internals, traced, ins, equations, expanded, seen)
        else:
            values = [v.aval for v in (*equation.invars, *equation.outvars)]
            if equation.effects or any(internals.is_key(a) for a in values):
                raise _Unsupported(primitive.name)
            signature = _signature(primitive, params, ins)
            outs = seen.get(signature) if signature is not None else None
            if outs is None:
                outs = [_Slot() for _ in equation.outvars]
                equations.append((primitive, params, ins, outs))
                if signature is not None:
                    seen[signature] = outs
        env.update(zip(equation.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _signature(primitive, params: dict, ins: list):
    """What decides an operation's outputs, hashable, or None where a parameter is not or a
    literal is more than a few numbers (not worth comparing)."""
    parts = []
    for x in ins:
        if isinstance(x, _Slot):
            parts.append(x)
            continue
        value = np.asarray(x[1])
        if value.size > 16 or value.dtype == object:
            return None
        parts.append((value.dtype.str, value.shape, value.tobytes()))
    signature = (primitive, tuple(sorted(params.items())), tuple(parts))
    try:
        hash(signature)
    except TypeError:
        return None
    return signature


def _expanded(internals, primitive, avals, params, expanded: dict):
    """The program of a key operation over its keys' data (``expanded``: see ``_inline``)."""

    def trace():
        fn = internals.expansions[primitive](avals, params)
        physical = [internals.physical_aval(a) for a in avals]
        return jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in physical))

    signature = (primitive, tuple(avals), tuple(sorted(params.items())))
    try:
        hash(signature)
    except TypeError:
        return trace()
    if signature not in expanded:
        expanded[signature] = trace()
    return expanded[signature]


def _evaluate(internals, equations: list, values: dict, outputs: list) -> list:
    """``outputs`` of ``equations`` (``_inline``'s) from ``values``, the inputs' values, the
    hashes deferred and batched round by round."""

    def get(x):
        return x[1] if isinstance(x, tuple) else values[x]

    def ready(equation):
        return all(isinstance(x, tuple) or x in values for x in equation[2])

    todo = equations
    while todo:
        progressed = True
        while progressed:  # every operation but the hashes, as far as the values go
            progressed, waiting = False, []
            for equation in todo:
                primitive, params, ins, outs = equation
                if primitive is not internals.threefry and ready(equation):
                    results = primitive.bind(*map(get, ins), **params)
                    values.update(zip(outs, results if primitive.multiple_results else [results]))
                    progressed = True
                else:
                    waiting.append(equation)
            todo = waiting
        hashes = [e for e in todo if ready(e)]  # only hashes are left ready
        if not hashes:
            if todo:
                raise RuntimeError(f"{len(todo)} operations left whose inputs never came")
            break
        _hash(internals, hashes, get, values)
        done = set(map(id, hashes))
        todo = [e for e in todo if id(e) not in done]
    return [get(x) for x in outputs]


def _hash(internals, hashes: list, get, values: dict) -> None:
    """The ready hashes: those up to ``LARGEST_BATCHED`` elements as one call, larger ones
    stacked with the others of their shapes (``_stacked``)."""
    together, large = [], {}
    for _, _, ins, outs in hashes:
        operands = [get(x) for x in ins]
        shape = np.broadcast_shapes(*(np.shape(x) for x in operands))
        if math.prod(shape) > LARGEST_BATCHED:
            shapes = (shape, *(np.shape(x) for x in operands))
            large.setdefault(shapes, []).append((ins, operands, outs))
        else:
            together.append((operands, shape, outs))
    for (shape, *_), group in large.items():
        _stacked(internals, shape, group, values)
    if not together:
        return
    columns = [
        jnp.concatenate([jnp.broadcast_to(ops[i], shape).reshape(-1) for ops, shape, _ in together])
        for i in range(4)
    ]
    first, second = internals.threefry.bind(*columns)
    offset = 0
    for _, shape, outs in together:
        size = math.prod(shape)
        values[outs[0]] = first[offset : offset + size].reshape(shape)
        values[outs[1]] = second[offset : offset + size].reshape(shape)
        offset += size


def _stacked(internals, shape: tuple, group: list, values: dict) -> None:
    """Large hashes of one shape, ``(ins, operands, outs)`` each, as few calls as
    ``LARGEST_STACKED`` allows: a loop over the draws, whose operands that differ between them
    (the keys) are stacked and those they share (the counters, one value through ``_inline``'s
    ``seen``) are not copied. The loop hashes one draw at a time, which the caches hold: one
    call over the stacked draws ran ViT-B/16's initialisation 0.3 s slower on a CPU. There,
    where each call is a loop compiled apart, ViT-B/16's 73 large draws are 3 loops, its
    initialisation's compile 1.9 s shorter (benchmarks/results/hashed_init_stacked.md).
    Elsewhere a call is one kernel: each runs alone, and the peak memory stays one draw's."""
    per_call = max(1, LARGEST_STACKED // math.prod(shape))
    if jax.default_backend() != "cpu":
        per_call = 1
    for start in range(0, len(group), per_call):
        chunk = group[start : start + per_call]
        if len(chunk) == 1:
            ((_, operands, outs),) = chunk
            values.update(zip(outs, internals.threefry.bind(*operands)))
            continue
        shared, stacked = {}, []
        for i in range(4):
            first_in = chunk[0][0][i]
            if isinstance(first_in, _Slot) and all(ins[i] is first_in for ins, _, _ in chunk):
                shared[i] = chunk[0][1][i]
            else:
                stacked.append(jnp.stack([ops[i] for _, ops, _ in chunk]))

        def one(draw, shared=shared):
            draw = iter(draw)
            operands = [shared[i] if i in shared else next(draw) for i in range(4)]
            return tuple(internals.threefry.bind(*operands))

        first, second = jax.lax.map(one, stacked)
        for index, (_, _, outs) in enumerate(chunk):
            values[outs[0]], values[outs[1]] = first[index], second[index]


@functools.cache
def _internals() -> types.SimpleNamespace | None:
    modules = compat.random_internals()
    if modules is None:
        return None
    core, dtypes, prng, threefry2x32 = modules
    try:
        return types.SimpleNamespace(
            Literal=core.Literal,
            physical_aval=core.physical_aval,
            is_key=lambda aval: dtypes.issubdtype(getattr(aval, "dtype", None), dtypes.prng_key),
            wrap=prng.random_wrap_p,
            unwrap=prng.random_unwrap_p,
            expansions=_expansions(prng),
            threefry=threefry2x32.threefry2x32_p,
        )
    except AttributeError:
        return None


def _expansions(prng) -> dict[Any, Callable]:
    """For each key operation, ``(in avals, params) -> fn`` over the keys' uint32 data."""

    def seed(avals, params):
        return lambda seeds: prng.random_seed_impl_base(seeds, impl=params["impl"])

    def split(avals, params):
        keys = avals[0]
        return lambda data: prng.random_split_impl_base(
            keys.dtype._impl, data, keys.ndim, shape=params["shape"]
        )

    def fold_in(avals, params):
        keys = avals[0]
        return lambda data, messages: prng.random_fold_in_impl_base(
            keys.dtype._impl, data, messages, keys.shape
        )

    def bits(avals, params):
        keys = avals[0]
        return lambda data: prng.random_bits_impl_base(
            keys.dtype._impl, data, keys.ndim, bit_width=params["bit_width"], shape=params["shape"]
        )

    return {
        prng.random_seed_p: seed,
        prng.random_split_p: split,
        prng.random_fold_in_p: fold_in,
        prng.random_bits_p: bits,
    }
