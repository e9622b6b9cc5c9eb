"""A curve's points packed into arrays: the stored form of kb.models.MetricSeries.

A run's curve is written once and read back whole (nothing queries one point of it in SQL:
queries go through the curve statistics in RunField), so a row per point bought nothing and
cost most of an ingest: 600 points were 600 b-tree inserts. Packed, a curve is one row of
little-endian arrays, the same bytes on SQLite and Postgres.

What the arrays cannot say by themselves goes in `flags`, one byte per point, stored only
when some point needs it: a null value (the arrays hold NaN for both a NaN and a null), a
point whose third item was an explicit null, and, when some points carry a wall time, the
points that have none.
"""
from __future__ import annotations

import math
from itertools import chain
from typing import NamedTuple, Sequence

import numpy as np

NULL_VALUE, NULL_WALL, NO_WALL = 1, 2, 4

_STEP, _FLOAT, _FLAG = np.dtype("<i8"), np.dtype("<f8"), np.dtype("u1")
EXACT_STEPS = 2.0**53       # below it a double holds every integer exactly


class Packed(NamedTuple):
    points: int
    step_bytes: bytes
    value_bytes: bytes
    wall_bytes: bytes | None      # None: no point has a third item
    flag_bytes: bytes | None      # None: every point reads back from the arrays alone


def pack(points: Sequence[Sequence]) -> Packed:
    """Points as the record gives them, `[step, value]` or `[step, value, wall_time]`; steps
    must fit a signed 64-bit integer (the record check holds them to 0..2^63-1)."""
    return pack_table(points, uniform_table(points))


def pack_table(points: Sequence[Sequence], table: np.ndarray | None) -> Packed:
    """`pack(points)` for a caller that has `uniform_table(points)` already (None: the curve has none)."""
    return _pack_any(points) if table is None else _pack_uniform(points, table)


def uniform_table(points: Sequence[Sequence]) -> np.ndarray | None:
    """Most curves as one (points x 2 or 3) float array: every point the same length and every
    step exact as a double (a None value is NaN). None for any other curve.

    One flat pass over the items costs half of numpy's nested-sequence conversion; a None
    stops it, and those curves take the nested one."""
    widths = set(map(len, points))
    if len(widths) != 1 or (width := widths.pop()) not in (2, 3):
        return None
    try:
        table = np.fromiter(chain.from_iterable(points), _FLOAT, len(points) * width).reshape(-1, width)
    except (TypeError, ValueError):       # a None; anything no float reads fails below as it did
        try:
            table = np.array(points, _FLOAT)
        except (TypeError, ValueError):
            return None
    if table[:, 0].max() >= EXACT_STEPS:
        return None
    return table


def _pack_uniform(points: Sequence[Sequence], table: np.ndarray) -> Packed:
    values = table[:, 1]
    flags = None
    nan = np.flatnonzero(np.isnan(values))
    if len(nan):
        nulls = [i for i in nan.tolist() if points[i][1] is None]
        if nulls:
            flags = np.zeros(len(table), _FLAG)
            flags[nulls] = NULL_VALUE
    walls = None
    if table.shape[1] == 3:
        walls = table[:, 2]
        null_walls = np.isnan(walls)              # a wall time is finite or null (the record check)
        if null_walls.any():
            flags = np.zeros(len(table), _FLAG) if flags is None else flags
            flags[null_walls] |= NULL_WALL
        walls = walls.astype(_FLOAT).tobytes()
    return Packed(len(table), table[:, 0].astype(_STEP).tobytes(), values.astype(_FLOAT).tobytes(), walls,
                  None if flags is None else flags.tobytes())


def _pack_any(points: Sequence[Sequence]) -> Packed:
    n = len(points)
    steps = np.fromiter((p[0] for p in points), _STEP, n)
    values = np.array([p[1] for p in points], _FLOAT)        # None -> NaN, marked below
    flags = None
    nulls = [i for i, p in enumerate(points) if p[1] is None]
    if nulls:
        flags = np.zeros(n, _FLAG)
        flags[nulls] = NULL_VALUE
    walls = None
    if any(len(p) > 2 for p in points):
        walls = np.array([p[2] if len(p) > 2 else None for p in points], _FLOAT)
        marks = [(NO_WALL if len(p) < 3 else NULL_WALL if p[2] is None else 0) for p in points]
        if any(marks):
            flags = np.zeros(n, _FLAG) if flags is None else flags
            flags |= np.array(marks, _FLAG)
    return Packed(n, steps.tobytes(), values.tobytes(), None if walls is None else walls.tobytes(),
                  None if flags is None else flags.tobytes())


def unpack(step_bytes: bytes, value_bytes: bytes, wall_bytes: bytes | None, flag_bytes: bytes | None) -> list[list]:
    """The points as written: NaN stays NaN, a null stays null, a two-item point stays two items."""
    s = np.frombuffer(step_bytes, _STEP).tolist()
    v = np.frombuffer(value_bytes, _FLOAT).tolist()
    if wall_bytes is None and flag_bytes is None:
        return [[a, b] for a, b in zip(s, v)]
    f = np.frombuffer(flag_bytes, _FLAG).tolist() if flag_bytes is not None else [0] * len(s)
    if wall_bytes is None:
        return [[a, None if g & NULL_VALUE else b] for a, b, g in zip(s, v, f)]
    out = []
    for a, b, w, g in zip(s, v, np.frombuffer(wall_bytes, _FLOAT).tolist(), f):
        b = None if g & NULL_VALUE else b
        out.append([a, b] if g & NO_WALL else [a, b, None if g & NULL_WALL or math.isnan(w) else w])
    return out
