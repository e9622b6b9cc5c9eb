"""kb.series: a curve packed into arrays reads back exactly as the record gave it."""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kb import series

steps = st.integers(min_value=0, max_value=2**63 - 1)
values = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True))
walls = st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False))
points = st.one_of(st.tuples(steps, values).map(list), st.tuples(steps, values, walls).map(list))


def same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


@given(st.lists(points, min_size=1, max_size=50))
@settings(max_examples=300, deadline=None)
def test_round_trip(curve):
    got = series.unpack(*series.pack(curve)[1:])
    assert len(got) == len(curve)
    for p, q in zip(got, curve):
        assert len(p) == len(q) and all(map(same, p, q)), (p, q)
        # a NaN stays a float and a null stays None: they mean different things (a divergence, no value)
        assert (p[1] is None) == (q[1] is None)


def test_plain_curves_store_no_flags():
    packed = series.pack([[0, 1.0], [1, 0.5]])
    assert packed.points == 2 and packed.wall_bytes is None and packed.flag_bytes is None
    packed = series.pack([[0, 1.0, 5.0], [1, float("nan"), 6.0]])
    assert packed.wall_bytes is not None and packed.flag_bytes is None      # NaN needs no flag
    assert len(packed.step_bytes) == len(packed.value_bytes) == 16


def test_uniform_and_general_paths_agree():
    """The one-conversion path (uniform points, steps below 2^53) and the general one store the
    same bytes; a step past 2^53 takes the general path and keeps every digit."""
    curves = [[[0, 1.5], [1, None], [2, float("nan")], [3, float("inf")]],        # a None: the nested conversion
              [[0, 1.5, 10.0], [1, None, None], [2, float("nan"), 12.5]],
              [[0, 1.5, 10.0], [1, 2.5, 11.0], [2, float("nan"), 12.5]]]        # none: the flat one
    for curve in curves:
        table = series.uniform_table(curve)
        assert table is not None and series._pack_uniform(curve, table) == series._pack_any(curve)
    big = [[2**53 + 1, 1.0], [2**63 - 1, 2.0]]
    assert series.uniform_table(big) is None
    # mixed widths never make a table, even where their items add up to a whole number of rows
    assert series.uniform_table([[0, 1.0, 5.0], [1, 2.0], [2, 3.0, 6.0, 7.0]]) is None
    assert series.uniform_table([[0, 1.0, 5.0], [1, 2.0]]) is None
    assert [p[0] for p in series.unpack(*series.pack(big)[1:])] == [2**53 + 1, 2**63 - 1]
