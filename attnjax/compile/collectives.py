"""What a compiled program's collectives move, read from its optimised HLO text.

``moved_bytes(hlo)`` -> ``{kind: bytes}``: per device and per call of the program, the bytes of
each collective's result (the gathered array of an all-gather, the reduced one of an all-reduce,
one device's piece of a reduce-scatter), summed by kind. A collective inside a ``while`` loop
counts once per trip where the trip count is known, so a scanned model's per-layer collectives
count ``depth`` times: XLA's ``known_trip_count`` where the backend keeps it (CPU, GPU), else a
loop condition ``counter < constant`` (XLA:TPU drops the annotation; ``lax.scan`` and XLA's own
windowed matrix products count from 0 by 1). A loop of unknown length counts its body once and
is reported by ``unknown_trip_loops``.

Asynchronous pairs (``all-gather-start`` / ``-done``) count at their ``-done``, whose result is
the collective's output alone (a ``-start``'s tuple repeats the operand); a collective wrapped in
an ``async-start`` computation counts inside that computation.
"""

from __future__ import annotations

import collections
import math
import re

KINDS = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([0-9,]*)\]")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_CONSTANT = re.compile(r"^\s*%?([\w.\-]+)\s*=\s*[su](?:8|16|32|64)\[\]\S*\s+constant\((\d+)\)")
_LESS_THAN = re.compile(r"compare\(%?[\w.\-]+,\s*%?([\w.\-]+)\),\s*direction=LT")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")


def result_bytes(shape_text: str) -> int:
    """``"f32[16,32]{1,0}"`` or a tuple ``"(bf16[8], f32[2,2])"`` -> its bytes."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _computations(hlo: str) -> tuple[dict, str | None]:
    """HLO text -> ({computation name: its instruction lines}, the entry computation's name)."""
    bodies, entry, current = {}, None, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(1)
            bodies[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None and line.strip() == "}":
            current = None
        elif current is not None:
            bodies[current].append(line)
    return bodies, entry


def _trip_count(rest: str, bodies: dict) -> int | None:
    """A ``while``'s trips: XLA's annotation, else its condition's ``counter < constant``."""
    known = _TRIP.search(rest)
    if known:
        return int(known.group(1))
    condition = _CONDITION.search(rest)
    lines = bodies.get(condition.group(1), []) if condition else []
    constants = dict(m.groups() for m in map(_CONSTANT.match, lines) if m)
    roots = [_LESS_THAN.search(line) for line in lines if line.lstrip().startswith("ROOT")]
    if roots and roots[0] and roots[0].group(1) in constants:
        return int(constants[roots[0].group(1)])
    return None


def moved_bytes(hlo: str) -> dict:
    """The program's collective bytes per kind (see the module docstring), and
    ``unknown_trip_loops``: how many loops of unknown trip count held collectives (counted once)."""
    bodies, entry = _computations(hlo)
    unknown = [0]

    def visit(name: str, seen: tuple) -> collections.Counter:
        moved = collections.Counter()
        if name not in bodies or name in seen:
            return moved
        for line in bodies[name]:
            match = _INSTRUCTION.match(line)
            if not match:
                continue
            shape, op, rest = match.groups()
            kind = op.removesuffix("-done")
            if kind in KINDS and not op.endswith("-start"):
                moved[kind] += result_bytes(shape)
            elif op == "while" and _BODY.search(rest):
                inner = visit(_BODY.search(rest).group(1), seen + (name,))
                trips = _trip_count(rest, bodies)
                if inner and trips is None:
                    unknown[0] += 1
                for k, v in inner.items():
                    moved[k] += v * (trips or 1)
            elif op in ("call", "async-start") and _CALLS.search(rest):
                moved.update(visit(_CALLS.search(rest).group(1), seen + (name,)))
            elif op == "conditional" and _BRANCHES.search(rest):
                branches = [
                    b.strip().lstrip("%") for b in _BRANCHES.search(rest).group(1).split(",")
                ]
                counts = [visit(b, seen + (name,)) for b in branches]
                moved.update(max(counts, key=lambda c: sum(c.values()), default={}))
        return moved

    moved = visit(entry, ()) if entry else collections.Counter()
    return {**{kind: moved.get(kind, 0) for kind in KINDS}, "unknown_trip_loops": unknown[0]}
