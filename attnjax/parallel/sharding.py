"""Device meshes and partition rules: how a train state is laid out over devices, declared.

A mesh is a config field, ``config.mesh = {"data": -1, "fsdp": 1, "model": 1}`` (axis name ->
size; one size may be -1, "the devices left over"). Axes:

* ``data``: the batch is split along it, parameters are replicated over it.
* ``fsdp``: the batch is split along it too, and every array a rule marks ``FSDP`` is split
  along its largest dimension that divides evenly (parameters, their optimiser moments and
  their EMA alike), so each device holds ``1 / fsdp`` of them. XLA gathers a weight before
  the layer that uses it and reduce-scatters its gradient.
* ``model``: tensor parallelism in Megatron-LM's layout; the batch is replicated over it. A
  parameter whose rule gives it logical axis names (``Logical``) is split over it along its
  ``heads``, ``mlp`` or ``vocab`` dimension (``LOGICAL_AXIS_RULES``): q/k/v and the first MLP
  layer by columns, the attention output and the second MLP layer by rows, the embedding and the
  logits' layer by the vocabulary. Its ``embed`` dimension then goes over ``fsdp`` where that
  divides it. Each attention and MLP block then all-reduces its output
  forward and its input gradient backward, and no weight moves between the ``model`` devices.

Partition rules (big_vision's style) are ``(regex, spec)`` pairs matched with ``re.search``
against a leaf's "/"-joined path in the whole train state, the first match wins:
``params/blocks_0/mlp/fc1/kernel`` and its Adam moment
``opt_state/1/0/mu/blocks_0/mlp/fc1/kernel`` hit the same rule and get the same layout, so the
optimiser state follows its parameter. ``spec`` is a ``PartitionSpec``, ``FSDP`` or a
``Logical``: the names a model file gives its parameters' dimensions (its ``PARAM_AXES``), laid
out by ``LOGICAL_AXIS_RULES`` when the mesh's ``model`` axis is larger than 1 and as ``FSDP``
otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "model")
BATCH_AXES = ("data", "fsdp")
FSDP = "fsdp"

# Building blocks of a task's rules (``SHARDING_RULES`` in its module). As in PyTorch's FSDP,
# every array is split (a 1-D bias too, when the axis divides it); scalars, step counters and
# class-count-sized head biases (10, 1000: rarely divisible) stay whole.
WHOLE_SCALARS = (r"(^|/)(count|step|mini_step|gradient_step)$|(^|/)head/bias$", P())
SPLIT_REST = (r".*", FSDP)
REPLICATED = ((r".*", P()),)
# Logical axis -> mesh axis (MaxText's ``logical_axis_rules``): Megatron's layout. An axis mapped
# to ``model`` must be divisible by its size; one mapped to ``fsdp`` is split only where it is.
LOGICAL_AXIS_RULES = {"heads": "model", "mlp": "model", "vocab": "model", "embed": "fsdp"}


@dataclasses.dataclass(frozen=True)
class Logical:
    """A parameter's logical axis names, one per trailing dimension (``None``: an axis no rule
    splits). Right-aligned, so a scanned stack's leading ``[depth]`` axis stays whole."""

    names: tuple[str | None, ...]


def activation_axis_rules(mesh: Mesh) -> tuple:
    """Flax's logical axis rules for the activations the models name (``nn.with_logical_constraint``
    on each block's output): the residual stream's ``batch`` over the mesh's batch axes, its other
    axes whole. Without them XLA split the activations of some layouts with an fsdp axis along
    their width too: the collectives of a ViT's and a prior's step (width 384) moved 3.4-6.9x the
    bytes on four of the six such layouts measured, and no layout moved more with the rules
    (benchmarks/results/tensor_parallel.md)."""
    return (("batch", batch_spec(mesh)[0] or None), ("length", None), ("embed", None))


def logical_rules(param_axes) -> tuple:
    """A model file's ``PARAM_AXES`` (``(regex, names)`` pairs) -> partition rules."""
    return tuple((pattern, Logical(tuple(names))) for pattern, names in param_axes)


def make_mesh(mesh_config=None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """``{"data": -1, "fsdp": 2}`` -> a ``Mesh`` over ``devices`` (default: all of them)."""
    devices = list(jax.devices() if devices is None else devices)
    if hasattr(mesh_config, "to_dict"):
        mesh_config = mesh_config.to_dict()
    sizes = dict(mesh_config or {"data": -1})
    unknown = [name for name in sizes if name not in AXES]
    if unknown:
        raise ValueError(f"config.mesh has axis {unknown[0]!r}; expected axes among {AXES}.")
    free = [name for name, size in sizes.items() if int(size) == -1]
    if len(free) > 1:
        raise ValueError(
            f"config.mesh={sizes} has {len(free)} axes of size -1; at most one may "
            f"take the devices left over."
        )
    fixed = math.prod(int(size) for size in sizes.values() if int(size) != -1)
    if free:
        if fixed < 1 or len(devices) % fixed:
            raise ValueError(
                f"config.mesh={sizes}: {len(devices)} devices do not split into "
                f"axes of sizes {fixed} x (-1)."
            )
        sizes[free[0]] = len(devices) // fixed
    if math.prod(int(s) for s in sizes.values()) != len(devices):
        raise ValueError(
            f"config.mesh={sizes} has {math.prod(sizes.values())} positions but "
            f"there are {len(devices)} devices."
        )
    names = tuple(sizes)
    shape = tuple(int(sizes[name]) for name in names)
    axis_types = (jax.sharding.AxisType.Auto,) * len(names)
    try:
        return jax.make_mesh(shape, names, devices=devices, axis_types=axis_types)
    except NotImplementedError:
        # An axis that is no product of whole physical axes (model 2 on a 4x4x4 v5p slice):
        # JAX's placement refuses it unless told to split a physical axis, which it does only
        # for v5e by itself. Each mesh axis still gets neighbouring chips.
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return Mesh(grid, names, axis_types=axis_types)


def batch_spec(mesh: Mesh) -> P:
    """Leading (batch) dimension split over every batch axis the mesh has."""
    return P(tuple(name for name in BATCH_AXES if name in mesh.axis_names))


def batch_size_divisor(mesh: Mesh) -> int:
    """How many ways the batch is split: the product of the mesh's batch axes."""
    return math.prod(mesh.shape[name] for name in BATCH_AXES if name in mesh.axis_names)


def path_name(path) -> str:
    """A tree path as "a/b/0/c" (dict keys, dataclass fields and sequence indices alike)."""
    parts = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
    return "/".join(parts)


def fsdp_spec(shape: Sequence[int], mesh: Mesh) -> P:
    """The largest dimension that ``mesh``'s fsdp axis divides, split along that axis."""
    size = dict(mesh.shape).get(FSDP, 1)
    if size == 1 or not shape:
        return P()
    candidates = [d for d in range(len(shape)) if shape[d] % size == 0]
    if not candidates:
        return P()
    dim = max(candidates, key=lambda d: (shape[d], -d))
    return P(*([None] * dim + [FSDP]))


def logical_spec(name: str, shape: Sequence[int], mesh: Mesh, names: Sequence) -> P:
    """``shape``'s trailing dimensions named ``names``, laid out by ``LOGICAL_AXIS_RULES`` on
    ``mesh``; a one-line ValueError naming the leaf ``name`` where ``model`` does not divide."""
    sizes = dict(mesh.shape)
    if len(names) > len(shape):
        raise ValueError(f"{name}: logical axes {tuple(names)} for an array of shape {shape}.")
    spec = [None] * (len(shape) - len(names))
    for size, logical in zip(shape[len(spec) :], names):
        axis = LOGICAL_AXIS_RULES.get(logical)
        if sizes.get(axis, 1) == 1:
            spec.append(None)
        elif size % sizes[axis] == 0:
            spec.append(axis)
        elif axis == FSDP:
            spec.append(None)
        else:
            raise ValueError(
                f"config.mesh.{axis}={sizes[axis]} does not divide the {logical} axis "
                f"({size}) of {name}."
            )
    return P(*spec)


def matching_rule(name: str, rules):
    """The spec of the first rule whose pattern ``name`` matches, or None."""
    return next((spec for pattern, spec in rules if re.search(pattern, name)), None)


def leaf_spec(name: str, shape: Sequence[int], mesh: Mesh, rules) -> P:
    spec = matching_rule(name, rules)
    if isinstance(spec, Logical) and dict(mesh.shape).get("model", 1) > 1:
        return logical_spec(name, shape, mesh, spec.names)
    if spec == FSDP or isinstance(spec, Logical):
        return fsdp_spec(shape, mesh)
    return P() if spec is None else spec


def tree_shardings(tree, mesh: Mesh, rules):
    """A ``NamedSharding`` per array leaf of ``tree`` (any pytree of arrays/shape structs)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, leaf_spec(path_name(path), np.shape(x), mesh, rules)),
        tree,
    )


def left_whole(tree, mesh: Mesh, rules, min_bytes: int = 1 << 20) -> list:
    """The arrays of ``tree`` (``min_bytes`` or more) that a rule splits over ``fsdp`` but that
    every device holds whole, because the fsdp axis divides none of their dimensions (width 3200
    over 256 chips): ``[(path, shape, bytes)]``, largest first. Empty without an fsdp axis."""
    if dict(mesh.shape).get(FSDP, 1) == 1:
        return []
    whole = []

    def visit(path, x):
        if not hasattr(x, "dtype"):
            return
        name, shape = path_name(path), tuple(np.shape(x))
        size = math.prod(shape) * np.dtype(x.dtype).itemsize
        rule = matching_rule(name, rules)
        split = rule == FSDP or isinstance(rule, Logical)
        if split and size >= min_bytes and FSDP not in leaf_spec(name, shape, mesh, rules):
            whole.append((name, shape, size))

    jax.tree_util.tree_map_with_path(visit, tree)
    return sorted(whole, key=lambda item: -item[2])


def rules_for(config, default_rules=None):
    """``config.partition_rules`` (pairs of regex and ``"fsdp"`` or a tuple of axis names) if
    set, else ``default_rules`` (the task's ``SHARDING_RULES``), else everything replicated."""
    custom = config.get("partition_rules", None)
    if custom:
        return tuple((pattern, spec if spec == FSDP else P(*spec)) for pattern, spec in custom)
    return tuple(default_rules) if default_rules else REPLICATED


def check_model_axis(config, **sizes: int) -> None:
    """A one-line ValueError when ``config.mesh``'s ``model`` axis does not divide one of
    ``sizes`` (the model's heads, MLP width, vocabulary: what the task's rules split over it).
    ``config.partition_rules`` replace the task's rules, and their own layout is not checked."""
    if config.get("partition_rules", None):
        return
    mesh = config.get("mesh", None) or {}
    mesh = mesh.to_dict() if hasattr(mesh, "to_dict") else dict(mesh)
    model = int(mesh.get("model", 1))
    if model == -1:
        model = jax.device_count() // math.prod(int(s) for n, s in mesh.items() if n != "model")
    for field, size in sizes.items():
        if model > 1 and size % model:
            raise ValueError(
                f"config.mesh.model={model} does not divide the model's {field}={size}; "
                f"tensor parallelism splits it over that axis."
            )


def bytes_per_device(tree) -> int:
    """Bytes of ``tree``'s arrays held by the first addressable device (shards are equal)."""
    device = None
    total = 0
    for leaf in jax.tree.leaves(tree):
        shards = leaf.addressable_shards
        device = shards[0].device if device is None else device
        total += sum(s.data.nbytes for s in shards if s.device == device)
    return total
