"""The --where / --sort language: hand-written cases, SQL vs the reference evaluator on random
records and expressions (SQLite, and Postgres when KB_TEST_DATABASE_URL is set), sorting vs
Python's sort, the joined form `apply_query` vs both, and the errors a person sees.

    KB_TEST_DATABASE_URL=postgresql://postgres@127.0.0.1/test pytest tests/test_query.py -q
"""
from __future__ import annotations

import math
import random
import re
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, insert, select
from sqlalchemy import text as sql_text
from sqlmodel import Session

from kb.errors import QueryError
from kb.field_terms import RUNTERM, TERM_NAMESPACES
from kb.fields import NAMESPACES, canonical, field_rows, lookup, typed
from kb.models import Run, RunField
from kb.query import COLUMNS, And, Compare, Exists, In, Not, Or, evaluate, parse, parse_sort, render
from kb.query_sql import apply_query, choose_driver, compile_sort, compile_where, top_ids

T0 = datetime(2024, 5, 1, tzinfo=timezone.utc)
RUN_COLUMNS = ("id", "project", "name", "status", "parent", "source_kind", "source_uri", "lr", "batch_size",
               "params", "tokens", "flops", "started_at", "ended_at", "ingested_at")
DEFAULTS = {"source_kind": "native", "source_uri": "", "ingested_at": T0}


def complete(records: list[dict]) -> list[dict]:
    """The record as its row reads back: the columns the database fills in are in the dict too."""
    return [{**DEFAULTS, **r} for r in records]


def store(engine, records: list[dict]) -> None:
    """Run rows plus their RunField rows, the way the ingest path writes them."""
    with Session(engine) as s:
        for r in records:
            json_cols = {ns: r.get(ns, [] if ns == "tags" else {})
                         for ns in ("config", "summary", "scale", "stats", "tags") if _json_safe(r.get(ns))}
            s.add(Run(**{c: r[c] for c in RUN_COLUMNS if c in r}, hypothesis=r.get("hypothesis"), **json_cols))
        s.commit()
    rows = [row for r in records for row in field_rows(r["id"], {ns: r[ns] for ns in NAMESPACES if ns in r})]
    if rows:
        with engine.begin() as conn:
            conn.execute(insert(RunField.__table__), rows)


def _json_safe(v) -> bool:
    """NaN is no JSON (Postgres refuses it); such a record keeps it in RunField only."""
    return v is not None and "nan" not in repr(v) and "inf" not in repr(v)


def query(engine, expr) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(select(Run.id).where(compile_where(expr))).scalars())


def expected(records, expr) -> set[str]:
    node = parse(expr) if isinstance(expr, str) else expr
    return {r["id"] for r in records if evaluate(node, r)}


# ---- hand-written cases -------------------------------------------------------------------

HAND = complete([
    {"id": "r1", "project": "a", "name": "baseline", "status": "completed", "lr": 3e-4, "params": 124_000_000,
     "config": {"optim": {"lr": 3e-4, "name": "adamw"}, "layers": [1, 2, 4], "flag": True},
     "summary": {"val/loss": 3.2, "val loss": 3.3}, "tags": ["baseline", "ablation:norm"],
     "started_at": T0, "parent": None},
    {"id": "r2", "project": "b", "name": "hot", "status": "diverged", "lr": 3e-3,
     "config": {"optim": {"lr": 3e-3, "name": "adamw"}, "flag": 1, "note": None},
     "summary": {"val/loss": 9.9}, "failure": {"kind": "diverged", "step": 1200},
     "started_at": T0 + timedelta(days=3), "parent": "r1"},
    {"id": "r3", "project": "c", "name": "it's a 'quote'", "status": "completed",
     "config": {"optim": {"name": "sgd"}, "Optim": {"x": 1}}, "summary": {"val/loss": 3.6}},
    {"id": "r4", "project": "a", "name": "str-lr", "status": "failed",
     "config": {"optim": {"lr": "3e-4"}, "opt": 1, "path": "C:\\tmp", "flag": False},
     "summary": {"val/loss": float("nan"), "train/loss": float("inf")}},
])


@pytest.fixture
def hand(engine):
    store(engine, HAND)
    return engine


@pytest.mark.parametrize("expr, ids", [
    ("config.optim.lr > 1e-3 or status = 'diverged'", {"r2"}),
    ("config.optim.lr > 1e-4 and status = 'completed'", {"r1"}),
    ('summary."val/loss" < 3.5', {"r1"}),
    ("summary.val/loss < 3.5", {"r1"}),                       # bare segment, same canonical key
    ('summary."val loss" >= 3.3', {"r1"}),
    ("not config.optim.lr exists", {"r3"}),
    ("config.optim.lr exists", {"r1", "r2", "r4"}),
    ("config.optim exists", {"r1", "r2", "r3", "r4"}),        # a prefix of some leaf
    ("config.opt exists", {"r4"}),                            # segment boundary: not config.optim.*
    ("config.Optim exists", {"r3"}),                          # case-sensitive, unlike SQLite's LIKE
    ("summary exists", {"r1", "r2", "r3", "r4"}),
    ("failure.kind = 'diverged'", {"r2"}),
    ("project in ('a','b')", {"r1", "r2", "r4"}),
    ("project not in ('a','b')", {"r3"}),
    ("name = 'it''s a ''quote'''", {"r3"}),
    ("name = 'it\\'s a \\'quote\\''", {"r3"}),
    ("config.path = 'C:\\tmp'", {"r4"}),                     # a lone backslash is itself
    ("config.path = 'C:\\\\tmp'", {"r4"}),
    # and binds tighter than or
    ("status = 'diverged' or status = 'completed' and project = 'c'", {"r2", "r3"}),
    ("(status = 'diverged' or status = 'completed') and project = 'c'", {"r3"}),
    ("NOT config.optim.lr EXISTS", {"r3"}),
    ("project IN ('c') Or status = 'failed'", {"r3", "r4"}),
    ("config.flag = TRUE", {"r1"}),
    # typed: a number never equals a string or a bool
    ("config.optim.lr = 3e-4", {"r1"}),
    ("config.optim.lr = '3e-4'", {"r4"}),
    ("config.flag = 1", {"r2"}),
    ("config.flag = false", {"r4"}),
    ("config.flag != true", {"r4"}),
    ("config.note = null", {"r2"}),
    ("config.note != null", set()),                          # null has one value: != never holds
    ("not config.note = null", {"r1", "r3", "r4"}),
    # a missing key makes every comparison false, and not negates that
    ("config.optim.lr != 3e-4", {"r2"}),
    ("not (config.optim.lr = 3e-4)", {"r2", "r3", "r4"}),
    ("config.optim.lr < 'z'", {"r4"}),
    ("config.layers.2 = 4 and config.layers.0 == 1", {"r1"}),
    ("tags.0 = 'baseline'", {"r1"}),
    ("summary.val/loss = 'NaN'", {"r4"}),                      # NaN is kept as the string 'NaN'
    ("summary.val/loss > 0", {"r1", "r2", "r3"}),
    ("summary.train/loss = 'Infinity'", {"r4"}),
    # Run columns, with the same typed rules
    ("lr >= 1e-3", {"r2"}),
    ("params > 1e8", {"r1"}),
    ("lr = 'x'", set()),
    ("status = 1", set()),
    ("parent = 'r1'", {"r2"}),
    ("not parent = 'r1'", {"r1", "r3", "r4"}),
    ("parent != 'zzz'", {"r2"}),
    ("parent exists", {"r2"}),
    ("not started_at exists", {"r3", "r4"}),
    ("started_at > '2024-05-02'", {"r2"}),
    ("started_at <= '2024-05-01T00:00:00Z'", {"r1"}),
    ("started_at = '2024-05-01T02:00:00+02:00'", {"r1"}),
    ("started_at = 3", set()),
    ("source_kind = 'native' and ingested_at = '2024-05-01'", {"r1", "r2", "r3", "r4"}),
    ("id in ('r1', 'r4', 'nope')", {"r1", "r4"}),
])
def test_hand_written(hand, expr, ids):
    assert query(hand, expr) == ids
    assert expected(HAND, expr) == ids        # the reference evaluator agrees


def test_injection_is_just_a_string(hand):
    assert query(hand, "status = 'x''; drop table run; --'") == set()
    assert query(hand, "summary.\"x'; drop table run; --\" exists or name = '\\'; delete from run; --'") == set()
    with hand.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Run)).scalar() == len(HAND)


def test_not_is_two_valued_over_missing_columns(hand):
    everyone = {r["id"] for r in HAND}
    for expr in ["lr > 1e-3", "parent = 'r1'", "config.optim.lr < 1", "started_at > '2024-01-01'"]:
        assert query(hand, expr) | query(hand, f"not ({expr})") == everyone
        assert not query(hand, expr) & query(hand, f"not ({expr})")


# ---- property: SQL == reference evaluator -----------------------------------------------

KEY_POOL = [("optim", "lr"), ("optim", "name"), ("model", "n_layer"), ("model", "d_model"), ("flag",),
            ("layers",), ("a.b",), ('q"uote',), ("sp ace",), ("Optim",), ("ünï",), ("data", "mix")]
VALUES = [0, 1, -1, 2, 3, 12, 2**53 + 1, 3e-4, 1e-3, 0.5, -0.0, 2.5, -7.25, 1e300, "adam", "sgd", "", "it's",
          "a\\b", "Adam", "é", "10", "z", "ab", True, False, None, "3e-4", "✓"]
SUMMARY_KEYS = ["val/loss", "train/loss", "val loss", "acc"]
TIMES = [T0, T0 + timedelta(hours=5), T0 - timedelta(days=40)]


def random_records(seed: int = 20240501, n: int = 36) -> list[dict]:
    rnd = random.Random(seed)

    def value(depth: int = 0):
        roll = rnd.random()
        if roll < 0.1 and depth < 2:
            return [value(depth + 1) for _ in range(rnd.randint(0, 3))]
        if roll < 0.18 and depth < 2:
            return {rnd.choice(["x", "y", "0"]): value(depth + 1) for _ in range(rnd.randint(0, 2))}
        return rnd.choice(VALUES)

    records = []
    for i in range(n):
        config: dict = {}
        for path in rnd.sample(KEY_POOL, rnd.randint(0, 7)):
            node = config
            for seg in path[:-1]:
                node = node.setdefault(seg, {}) if isinstance(node.get(seg, {}), dict) else {}
            node[path[-1]] = value()
        records.append({
            "id": f"run-{i:02d}", "project": rnd.choice(["a", "b", "B", "gpt-small"]),
            "name": rnd.choice(["", "x", "it's", "Z"]), "status": rnd.choice(["completed", "failed", "diverged"]),
            "parent": rnd.choice([None, None, "run-00", "run-01"]),
            "lr": rnd.choice([None, 3e-4, 1e-3, 0.0]), "params": rnd.choice([None, 0, 10**6, 124_000_000]),
            "started_at": rnd.choice([None] + TIMES), "hypothesis": rnd.choice([None, "h1"]),
            "ended_at": rnd.choice([None] + TIMES), "ingested_at": rnd.choice(TIMES),
            "source_kind": rnd.choice(["native", "mlflow"]), "source_uri": rnd.choice(["", "file:///x"]),
            "tokens": rnd.choice([None, 2.5e9]), "flops": rnd.choice([None, 1.9e18, 0.0]),
            "batch_size": rnd.choice([None, 32, 512]),
            "config": config,
            "summary": {k: rnd.choice(VALUES) for k in rnd.sample(SUMMARY_KEYS, rnd.randint(0, 3))},
            "scale": {k: rnd.choice([10**6, 10**9, 2.5e9]) for k in rnd.sample(["params", "tokens"], rnd.randint(0, 2))},
            "tags": rnd.sample(["baseline", "ablation:norm", "x", "Baseline"], rnd.randint(0, 3)),
        })
    return complete(records)


RECORDS = random_records()
FIELD_KEYS = sorted({("config",) + p[:i] for p in KEY_POOL for i in range(1, len(p) + 1)}
                    | {("config", "layers", "0"), ("config", "layers", "1"), ("config", "flag", "x"),
                       ("config", "op"), ("config",), ("summary",), ("tags",), ("tags", "0"), ("tags", "1"),
                       ("scale", "params"), ("scale", "tokens"), ("stats", "nope")}
                    | {("summary", k) for k in SUMMARY_KEYS})
ALL_KEYS = FIELD_KEYS + [(c,) for c in COLUMNS]
ISO = ["2024-05-01", "2024-05-01T05:00:00Z", "2024-05-01T00:00:00+02:00", "2024-03-22T00:00:00", "2030-01-01"]

numbers = st.one_of(st.sampled_from([float(v) for v in VALUES if type(v) in (int, float)]),
                    st.integers(-3, 13).map(float),
                    st.floats(allow_nan=False, allow_infinity=False))
strings = st.one_of(st.sampled_from([v for v in VALUES if isinstance(v, str)] + ["a", "b", "h1", "run-00", "x"]),
                    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=4))
scalars = st.one_of(numbers, strings, st.booleans(), st.none())


def present(key) -> list:
    """Literals equal to values some record holds at key, so comparisons hit."""
    out = []
    for r in RECORDS:
        found, v = lookup(r, key) if key[0] not in COLUMNS else (r.get(key[0]) is not None, r.get(key[0]))
        if isinstance(v, datetime):
            out.append(v.isoformat())
        elif found and (v is None or isinstance(v, (str, bool))):
            out.append(v)
        elif found and isinstance(v, (int, float)) and math.isfinite(v):
            out.append(float(v))
    return sorted(set(out), key=repr)


def literal_for(key) -> st.SearchStrategy:
    held = [st.sampled_from(present(key))] * 2 if present(key) else []
    if COLUMNS.get(key[0], ("", ""))[1] == "t":         # time columns take ISO strings (or never match)
        return st.one_of(*held, st.sampled_from(ISO), numbers)
    return st.one_of(*held, scalars)


@st.composite
def predicates(draw, keys=st.sampled_from(ALL_KEYS)):
    key = draw(keys)
    kind = draw(st.sampled_from(["cmp", "cmp", "cmp", "in", "exists"]))
    if kind == "exists":
        return Exists(key)
    if kind == "in":
        return In(key, tuple(draw(st.lists(literal_for(key), min_size=1, max_size=4))))
    value = draw(literal_for(key))
    ops = ["=", "!="] if value is None or isinstance(value, bool) else ["=", "!=", "<", "<=", ">", ">="]
    return Compare(key, draw(st.sampled_from(ops)), value)


expressions = st.recursive(
    predicates(),
    lambda inner: st.one_of(inner.map(Not),
                            st.lists(inner, min_size=2, max_size=3).map(lambda xs: And(tuple(xs))),
                            st.lists(inner, min_size=2, max_size=3).map(lambda xs: Or(tuple(xs)))),
    max_leaves=6)


@pytest.fixture
def populated(engine):
    store(engine, RECORDS)
    return engine


def test_random_records_hit_the_shared_keys():
    """The fixed record set is varied enough for the property test to mean something."""
    hits = [sum(evaluate(parse(f"{k} exists"), r) for r in RECORDS) for k in ("config.optim.lr", "config.flag")]
    assert all(0 < h < len(RECORDS) for h in hits)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(node=expressions)
def test_sql_matches_reference_evaluator(populated, node):
    text = render(node)
    assert parse(text) == node and repr(parse(text)) == repr(node)    # repr tells 1.0 from True
    assert query(populated, text) == expected(RECORDS, node), text


NO_NUL = st.characters(codec="utf-8", exclude_characters="\x00")


@settings(max_examples=200, deadline=None)
@given(node=st.recursive(
    st.builds(lambda segs, v, op: Compare(("config",) + tuple(segs), op, v),
              st.lists(st.text(NO_NUL, max_size=4), min_size=1, max_size=3),     # no text holds NUL
              st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.text(NO_NUL), st.booleans(), st.none()),
              st.sampled_from(["=", "!="])),
    lambda inner: st.one_of(inner.map(Not), st.lists(inner, min_size=2, max_size=3).map(lambda xs: Or(tuple(xs))),
                            st.lists(inner, min_size=2, max_size=3).map(lambda xs: And(tuple(xs)))),
    max_leaves=5))
def test_render_parse_round_trip_with_arbitrary_text(node):
    assert repr(parse(render(node))) == repr(node)


# ---- sorting ------------------------------------------------------------------------------

def python_order(records, key, desc) -> list[str]:
    """Numbers, then strings, then bools; missing last in both directions; ties by id."""
    def typed_value(r):
        if key[0] in COLUMNS:
            v = r.get(key[0])
            return None if v is None else (0, v)
        found, v = lookup(r, key)
        if not found or isinstance(v, (dict, list)):
            return None
        vtype, num, text = typed(v)
        return {"n": (0, num), "s": (1, text), "b": (2, num), "z": None}[vtype]

    ordered = sorted(records, key=lambda r: r["id"])
    present = [(typed_value(r), r["id"]) for r in ordered if typed_value(r) is not None]
    missing = [r["id"] for r in ordered if typed_value(r) is None]
    out = []
    for rank in (0, 1, 2):                                   # the type rank never flips
        group = [(tv[1], i) for tv, i in present if tv[0] == rank]
        group.sort(key=lambda p: p[0], reverse=desc)         # stable: ids stay ascending within ties
        out += [i for _, i in group]
    return out + missing


def sql_order(engine, spec) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(select(Run.id).order_by(*compile_sort(spec))).scalars())


def test_sort_matches_python(populated):
    for key in ALL_KEYS:
        spec = render(Exists(key)).removesuffix(" exists")
        for text, desc in [(spec, False), ("-" + spec, True), (spec + " DESC", True), (spec + " asc", False)]:
            assert sql_order(populated, text) == python_order(RECORDS, key, desc), text


def test_sort_hand(hand):
    assert sql_order(hand, '-summary."val/loss"') == ["r2", "r3", "r1", "r4"]    # 'NaN' is a string: after numbers
    assert sql_order(hand, "lr") == ["r1", "r2", "r3", "r4"]
    assert sql_order(hand, "lr desc") == ["r2", "r1", "r3", "r4"]               # missing last both ways
    assert sql_order(hand, "project, -name") == ["r4", "r1", "r2", "r3"]
    with hand.connect() as conn:
        rows = conn.execute(select(Run.id).where(compile_where("project = 'a'"))
                            .order_by(*compile_sort("-started_at"))).scalars().all()
    assert rows == ["r1", "r4"]


# ---- apply_query: filters and sort keys as joins ------------------------------------------

def joined_order(engine, where, sort, driver=None) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(apply_query(select(Run.id), where, sort, driver=driver)).scalars())


def first_ids(engine, where, sort, limit, driver=None) -> list[str] | None:
    """top_ids' answer (RunField rows alone), or None where the query needs the run table."""
    stmt = top_ids(where, sort, limit, driver)
    if stmt is None:
        return None
    with engine.connect() as conn:
        return list(conn.execute(stmt).scalars())


def term_ids(engine, where, sort, limit) -> list[str] | None:
    """top_ids' answer from Postgres's run terms, or None where the terms do not answer it."""
    plan = top_ids(where, sort, limit, terms=True)
    if not from_terms(plan):
        return None
    with engine.connect() as conn:
        return list(conn.execute(plan).scalars())


def from_terms(stmt) -> bool:
    return stmt is not None and re.search(r"\bFROM\s+(\w+)", str(stmt)).group(1) == RUNTERM.name


def drivers(where) -> range:
    """Every joined test's index: whichever the plan starts from, the answer is the same."""
    if where is None:
        return range(0)
    node, items = parse(where), []
    stack = [node]
    while stack:                              # the items of the top-level `and`, flattened
        n = stack.pop()
        if isinstance(n, And):
            stack.extend(n.items)
        else:
            items.append(n)
    return range(len({canonical(i.key) for i in items if isinstance(i, (Compare, In)) and i.key[0] not in COLUMNS}))


@st.composite
def filtered_sorts(draw):
    """A sort key and a where clause whose top-level `and` often tests that same key (the case
    where a filter pins the key's type and the order comes straight from its index)."""
    key = draw(st.sampled_from(ALL_KEYS))
    parts = draw(st.lists(st.one_of(predicates(st.just(key)), expressions), max_size=3))
    node = None if not parts else parts[0] if len(parts) == 1 else And(tuple(parts))
    return node, key, draw(st.booleans())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=filtered_sorts())
def test_apply_query_matches_reference(populated, case):
    node, key, desc = case
    spec = ("-" if desc else "") + render(Exists(key)).removesuffix(" exists")
    keep = {r["id"] for r in RECORDS if node is None or evaluate(node, r)}
    want = [i for i in python_order(RECORDS, key, desc) if i in keep]
    text = None if node is None else render(node)
    assert joined_order(populated, text, spec) == want, (text, spec)
    if node is not None:                                      # a Node works as its text does
        assert joined_order(populated, node, spec) == want, (text, spec)
        assert set(joined_order(populated, node, None)) == keep, text
    for driver in drivers(text):
        assert joined_order(populated, text, spec, driver) == want, (text, spec, driver)
        assert first_ids(populated, text, spec, 3, driver) in (None, want[:3]), (text, spec, driver)
    assert first_ids(populated, text, spec, 3) in (None, want[:3]), (text, spec)
    with populated.connect() as conn:
        chosen = choose_driver(conn, text)
    assert chosen is None or chosen in drivers(text)


def test_apply_query_hand(hand):
    assert joined_order(hand, None, '-summary."val/loss"') == ["r2", "r3", "r1", "r4"]
    assert joined_order(hand, "summary.val/loss > 0", "-summary.val/loss") == ["r2", "r3", "r1"]
    assert joined_order(hand, "summary.val/loss >= 'A'", "summary.val/loss") == ["r4"]       # 'NaN'
    assert joined_order(hand, "(project = 'a' and config.optim exists) and lr > 0", "-started_at") == ["r1"]
    assert joined_order(hand, "config.flag in (1, true)", "config.flag") == ["r2", "r1"]          # mixed types
    assert joined_order(hand, "config.flag in (1, true) and config.flag != 2", "-config.flag") == ["r2"]
    assert joined_order(hand, "config.optim.lr > 0 and config.optim.lr < 1e-3", "config.optim.lr") == ["r1"]
    assert joined_order(hand, "config.optim.lr = 'x' and config.optim.lr = 3e-4", "config.optim.lr") == []
    assert set(joined_order(hand, "status = 'completed' and not summary.val/loss < 3.5", None)) == {"r3"}
    # a cached plan must not mistake true for 1.0 (they are equal, and hash alike, in Python)
    assert joined_order(hand, Compare(("config", "flag"), "=", True), "id") == ["r1"]
    assert joined_order(hand, Compare(("config", "flag"), "=", 1.0), "id") == ["r2"]


BENCH = "config.optim.lr = 0.0003 and summary.val_loss < 3.6"


def test_apply_query_joins_instead_of_subqueries():
    """Each tested key is one inner join and the sort key reuses its filter's join; a sort key
    that something else filters is kept off its index (+), so the plan starts from a filter;
    an unfiltered sort key is one outer join."""
    sql = str(apply_query(select(Run.id), BENCH, "summary.val_loss").compile())
    assert sql.count("JOIN runfield AS") == 2 and "LEFT OUTER" not in sql
    assert "IN (SELECT" not in sql and "CASE" not in sql
    assert sql.count("EXISTS (SELECT") == 2                 # each joined test, asked once of the table
    assert "ORDER BY +rf2.num ASC, run.id ASC" in sql
    sql = str(apply_query(select(Run.id), "config.optim.lr = 0.0003", "-summary.val_loss").compile())
    assert sql.count("LEFT OUTER JOIN runfield AS") == 1 and sql.count("JOIN runfield AS") == 2
    assert "CASE rf2.vtype" in sql and "rf2.num DESC" in sql
    sql = str(apply_query(select(Run.id), "config.x = 1 or config.y = 2", "lr").compile())
    assert "JOIN" not in sql and sql.count("IN (SELECT") == 2
    # the sort key's own tests alone: every run the index walk meets is a match, so it walks
    sql = str(apply_query(select(Run.id), "summary.val_loss < 3.6", "summary.val_loss").compile())
    assert "ORDER BY rf1.num ASC, run.id ASC" in sql


def sqlite_plan(conn, stmt) -> list[str]:
    sql = str(stmt.compile(conn, compile_kwargs={"literal_binds": True}))
    return [row[3] for row in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql)]


def test_sqlite_starts_from_the_filter_not_the_sort_order(engine):
    """The best run at one lr: the plan starts from that lr's (key, vtype, num) range and probes
    each run's val_loss by primary key, then sorts the matches; its cost is the lr's runs, never
    how far down the loss order they sit. With no other filter the sort key's index is walked
    and the LIMIT stops it; a value no run has is found out once, up front (the EXISTS)."""
    if engine.dialect.name != "sqlite":
        pytest.skip("SQLite's EXPLAIN QUERY PLAN")
    with engine.connect() as conn:
        for stmt in (apply_query(select(Run.id), BENCH, "summary.val_loss").limit(1),
                     top_ids(BENCH, "summary.val_loss", 1)):
            plan = sqlite_plan(conn, stmt)
            assert "ix_runfield_key_num (key=? AND vtype=? AND num=?)" in plan[0], plan
            assert any("USING PRIMARY KEY (key=? AND run_id=?)" in step for step in plan), plan
            assert "num<?" not in " ".join(p for p in plan if not p.startswith("SEARCH runfield ")), plan
            assert not any("LIST SUBQUERY" in step or "CORRELATED" in step for step in plan)
        # a range that is the smaller side drives instead, when counts say so
        plan = sqlite_plan(conn, top_ids(BENCH, "summary.val_loss", 1, driver=1))
        assert "ix_runfield_key_num (key=? AND vtype=? AND num<?)" in plan[0], plan
        plan = sqlite_plan(conn, apply_query(select(Run.id), "summary.val_loss < 3.6", "summary.val_loss").limit(1))
        assert "num<?" in plan[0] and "USE TEMP B-TREE FOR ORDER BY" not in plan


def test_driver_is_the_smaller_range(engine):
    """choose_driver counts each joined test's rows (capped) and starts from the smallest."""
    records = complete([{"id": f"r{i}", "project": "p", "name": "", "status": "completed",
                         "config": {"opt": "adam", "lr": 0.1 * (i % 4)}, "summary": {"loss": float(i)}}
                        for i in range(40)])
    store(engine, records)
    with engine.connect() as conn:
        if engine.dialect.name != "sqlite":
            assert choose_driver(conn, "config.opt = 'adam' and summary.loss < 2") is None
            return
        assert choose_driver(conn, "config.opt = 'adam' and summary.loss < 2") == 1       # 2 rows, not 40
        assert choose_driver(conn, "config.lr = 0.1 and summary.loss < 30") == 0           # 10, not 30
        assert choose_driver(conn, "summary.loss < 2") is None                             # nothing to choose
    assert joined_order(engine, "config.opt = 'adam' and summary.loss < 2", "-summary.loss", 1) == ["r1", "r0"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=filtered_sorts(), limit=st.sampled_from([1, 3]), project=st.sampled_from([None, "a"]))
def test_knowledge_base_runs_gives_the_first_of_the_order(kb, case, limit, project):
    """KnowledgeBase.runs, whichever way it reads (ids from RunField alone, or the joined
    statement when the query needs the run table), returns the first runs of the order."""
    if not kb.runs(limit=1):
        store(kb.engine, RECORDS)
    node, key, desc = case
    spec = ("-" if desc else "") + render(Exists(key)).removesuffix(" exists")
    keep = {r["id"] for r in RECORDS if (node is None or evaluate(node, r)) and project in (None, r["project"])}
    want = [i for i in python_order(RECORDS, key, desc) if i in keep]
    text = None if node is None else render(node)
    assert [r.id for r in kb.runs(where=text, sort=spec, limit=limit, project=project)] == want[:limit], (text, spec)


TERM_KEYS = [k for k in FIELD_KEYS if k[0] in TERM_NAMESPACES and len(k) > 1]


@st.composite
def equality_filters(draw):
    """Equalities and `in` lists on two to four keys that get terms (Postgres's term plan), now
    and then one more test of any kind; a sort key and direction."""
    tests = []
    for key in draw(st.lists(st.sampled_from(TERM_KEYS), min_size=2, max_size=4, unique=True)):
        if draw(st.booleans()):
            tests.append(Compare(key, "=", draw(literal_for(key))))
        else:
            tests.append(In(key, tuple(draw(st.lists(literal_for(key), min_size=1, max_size=3)))))
    extra = draw(st.integers(0, 3)) == 0
    if extra:
        tests.append(draw(predicates()))
    return And(tuple(tests)), draw(st.sampled_from(ALL_KEYS)), draw(st.booleans()), extra


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=equality_filters())
def test_postgres_term_plan_matches_reference(populated, case):
    """On Postgres, equalities on several keys are answered from the runs' terms (kb.field_terms):
    the first runs of the reference order, values of every type and spelling included."""
    if populated.dialect.name != "postgresql":
        pytest.skip("the term index is Postgres's")
    node, key, desc, extra = case
    spec = ("-" if desc else "") + render(Exists(key)).removesuffix(" exists")
    keep = {r["id"] for r in RECORDS if evaluate(node, r)}
    want = [i for i in python_order(RECORDS, key, desc) if i in keep]
    for limit in (1, 3, 50):
        got = term_ids(populated, render(node), spec, limit)
        assert got in (None, want[:limit]), (render(node), spec)
        # nothing but the equalities and a field to sort by: the terms answer, every time
        assert got is not None or extra or key[0] in COLUMNS, (render(node), spec)


def test_postgres_answers_several_equalities_from_the_terms(kb):
    """Which queries the terms answer, and that KnowledgeBase.runs does on Postgres: matches
    with every value spelling (-0 as 0, an int as its float, bools, null), a test left to probe,
    an `in` list; a walk skipped once ANALYZE says the terms match few runs."""
    from kb.query_sql import term_share, walk_ids
    records = [{"id": f"r{i:03d}", "project": "p",
                "config": {"lr": [1e-3, 3e-3, 0.0, -0.0][i % 4], "norm": ["rms", "layer"][i % 2],
                           "wd": [None, True, 2**53 + 1][i % 3], "seed": i % 5},
                "summary": {"loss": round(3 + (i * 37 % 101) / 100, 2)}} for i in range(120)]
    store(kb.engine, complete(records))
    cases = ["config.lr = 0 and config.norm = 'rms'", "config.lr = -0.0 and config.wd = null",
             "config.wd = true and config.norm in ('layer', 'x')", "config.wd = 9007199254740993 and config.seed = 3",
             "config.lr = 0.003 and config.norm = 'layer' and summary.loss < 3.5",
             "config.lr in (0.001, 0.003) and config.seed in (1, 2) and config.wd = true"]
    postgres = kb.engine.dialect.name == "postgresql"
    for where in cases:
        keep = {r["id"] for r in records if evaluate(parse(where), r)}
        for spec in ("summary.loss", "-summary.loss", "config.seed"):
            want = [i for i in python_order(records, parse_sort(spec)[0][0], spec[0] == "-") if i in keep]
            assert [r.id for r in kb.runs(where=where, sort=spec, limit=10)] == want[:10], (where, spec)
            if postgres:
                assert term_ids(kb.engine, where, spec, 10) == want[:10], (where, spec)
    assert not from_terms(top_ids("config.lr = 0.003 and config.seed > 1", "summary.loss", 5, terms=True))
    assert all(from_terms(top_ids(where, "summary.loss", 5, terms=True)) for where in cases)
    if not postgres:
        return
    with kb.engine.begin() as conn:
        conn.execute(sql_text("ANALYZE runterm"))
    with kb.engine.connect() as conn:
        assert term_share(conn, "config.norm = 'rms' and config.seed = 1") == pytest.approx(0.1, abs=0.05)
        assert walk_ids(conn, "config.wd = true and config.seed = 1", "summary.loss", 20, terms=True) is None
        assert term_share(conn, "config.norm = 'rms' and config.lr in (0.001, 0.003, 0)") > 0.25
        assert len(walk_ids(conn, "config.norm = 'rms' and config.lr in (0.001, 0.003, 0)", "summary.loss", 5,
                            terms=True)) == 5


def test_parse_sort():
    assert parse_sort('-summary."val/loss"') == [(("summary", "val/loss"), True)]
    assert parse_sort("params DESC, name") == [(("params",), True), (("name",), False)]


# ---- errors -------------------------------------------------------------------------------

@pytest.mark.parametrize("expr, words", [
    ("metrics.loss < 3", ["unknown key 'metrics'", "config", "summary", "status"]),
    ("config.x ~ 1", ["unexpected character '~'", "column 10"]),
    ("Status = 'a'", ["unknown key 'Status'"]),                # keys are case-sensitive, keywords are not
    ("status = 'diverged", ["unterminated string", "column 10"]),
    ("status = 'a' status", ["expected 'and', 'or' or end of input", "'status'", "column 14"]),
    ("(status = 'a'", ["expected 'and', 'or' or ')'", "end of input"]),
    ("status =", ["expected a value", "end of input"]),
    ('status = "diverged"', ["single quotes"]),
    ("config.x", ["expected an operator", "after config.x"]),
    ("config.x not = 1", ["expected 'in' or 'exists'"]),
    ("config.x in 1", ["expected '(' after 'in'"]),
    ("config.x in (1 2)", ["expected ',' or ')'"]),
    ("config.x > null", ["null can only be compared with = or !="]),
    ("status.x = 'a'", ["status is a run column"]),
    ("config. = 1", ["expected a key segment"]),
    ('config."x = 1', ["unterminated quoted key segment"]),
    ("started_at > 'yesterday'", ["ISO-8601"]),
    ("config.x = 1e999", ["out of range"]),
    ("config.x = 12abc", ["expected a number"]),
    ("and status = 'a'", ["expected a key, 'not' or '('", "column 1"]),
    ("", ["expected an expression"]),
    ("(" * 100 + "status = 'a'" + ")" * 100, ["nests deeper"]),
])
def test_errors(expr, words):
    with pytest.raises(QueryError) as err:
        compile_where(expr)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("spec, words", [
    ("nope", ["unknown key 'nope'"]),
    ("-status desc", ["either '-' or asc/desc"]),
    ("status sideways", ["expected 'asc', 'desc', ',' or end of input"]),
    ("", ["a key to sort by"]),
])
def test_sort_errors(spec, words):
    with pytest.raises(QueryError) as err:
        compile_sort(spec)
    for w in words:
        assert w in str(err.value)


def test_error_points_at_the_column():
    with pytest.raises(QueryError) as err:
        parse("config.lr > 1 and  bogus = 2")
    lines = str(err.value).splitlines()
    assert "column 20" in lines[0] and lines[2].index("^") - 2 == 19


def test_sql_carries_values_as_parameters_and_orders_by_code_point():
    from sqlalchemy.dialects import postgresql, sqlite
    expr = "status < 'b' or summary.\"x'; drop\" > 'y''; drop table run; --'"
    for dialect, collate in [(postgresql.dialect(), True), (sqlite.dialect(), False)]:
        sql = str(select(Run.id).where(compile_where(expr)).order_by(*compile_sort("-name"))
                  .compile(dialect=dialect))
        assert "drop" not in sql
        assert ('COLLATE "C"' in sql) == collate        # Postgres' default collation is not code-point order


def broad_records(n: int = 700) -> list[dict]:
    """Runs where every test matches hundreds (past DRIVER_COUNT_CAP): the sort-order walk's case.
    Losses tie often (two decimals), some are NaN or text, some runs have none."""
    rng = random.Random(7)
    out = []
    for i in range(n):
        loss = round(rng.uniform(2.0, 4.0), 2)
        r = {"id": f"w{i:04d}", "project": "p", "config": {"norm": rng.choice(["rms", "layer"]),
                                                           "lr": rng.choice([1e-3, 3e-3])}}
        if i % 50 == 7:
            r["summary"] = {"loss": "NaN"}
        elif i % 40 != 3:
            r["summary"] = {"loss": loss}
        if i >= n - 300:
            r["config"]["late"] = True          # broad, but only at the end of the loss order
            r.setdefault("summary", {})["loss"] = 10 + i / 1000
        out.append(r)
    return out


@pytest.mark.parametrize("budget", [500, 30])
def test_the_sort_order_walk_gives_the_first_of_the_order(kb, budget, monkeypatch):
    """KnowledgeBase.runs walks the sort key's index for broad filters (and hands over to the
    driven plan when its budget runs out): the answer is the reference's either way."""
    import kb.query_sql as qs
    monkeypatch.setattr(qs, "WALK_BUDGET", budget)
    qs._walk.cache_clear()
    records = broad_records()
    store(kb.engine, complete(records))
    walked = 0
    for where in ["config.norm = 'rms'", "config.norm = 'rms' and config.lr = 0.003", "config.lr in (0.001)",
                  "config.late = true", "config.norm = 'layer' and config.late = true"]:
        for key, desc in [(("summary", "loss"), False), (("summary", "loss"), True)]:
            spec = ("-" if desc else "") + "summary.loss"
            keep = {r["id"] for r in records if evaluate(parse(where), r)}
            want = [i for i in python_order(records, key, desc) if i in keep]
            for limit in (1, 5, 20):
                assert [r.id for r in kb.runs(where=where, sort=spec, limit=limit)] == want[:limit], (where, spec)
                with kb.engine.connect() as conn:
                    walked += qs.walk_ids(conn, where, spec, limit) is not None
    qs._walk.cache_clear()
    assert walked > (20 if budget == 500 else 0)         # the walk answered, not only the fallback


def test_string_values_long_and_short_are_found_alike(kb):
    """Postgres's (key, vtype, text) index holds values of at most TEXT_INDEXED bytes (migration
    0016); an equality with a value on either side of that finds its runs, in an `in` list too."""
    from kb.models import TEXT_INDEXED
    long = "x" * (TEXT_INDEXED - 1) + "é"           # one byte past the limit, in UTF-8
    edge = "y" * TEXT_INDEXED
    kb.ingest_records([{"id": f"s{i}", "project": "p", "config": {"mix": v}}
                       for i, v in enumerate(["web", long, edge, "web", long[:-1]])], index=False)

    def ids(where):
        return sorted(r.id for r in kb.runs(where=where))
    assert ids("config.mix = 'web'") == ["s0", "s3"]
    assert ids(f"config.mix = '{long}'") == ["s1"]
    assert ids(f"config.mix = '{edge}'") == ["s2"]
    assert ids(f"config.mix in ('web', '{long}')") == ["s0", "s1", "s3"]
    assert ids(f"config.mix in ('{long}', '{long[:-1]}')") == ["s1", "s4"]
    assert ids(f"config.mix != '{long}'") == ["s0", "s2", "s3", "s4"]


def test_postgres_string_equality_can_use_the_short_text_index(kb):
    """A query's string equality implies the partial index's predicate, so the planner may use
    it: with every other way to the rows gone (in a transaction rolled back), it does."""
    if kb.engine.dialect.name != "postgresql":
        pytest.skip("Postgres's partial btree; SQLite's index holds every string")
    from sqlalchemy import text
    kb.ingest_records([{"id": f"s{i}", "project": "p", "config": {"mix": "web" if i % 2 else "code"}}
                       for i in range(20)], index=False)
    with kb.engine.connect() as conn:
        conn.execute(text("ALTER TABLE runfield DROP CONSTRAINT runfield_pkey"))
        conn.execute(text("DROP INDEX ix_runfield_key_num"))
        conn.execute(text("DROP INDEX ix_runfield_run_id"))
        conn.execute(text("SET LOCAL enable_seqscan = off"))
        for where in ("config.mix = 'web'", "config.mix in ('web', 'math')"):
            sql = str(apply_query(select(Run.id), where).compile(conn, compile_kwargs={"literal_binds": True}))
            plan = "\n".join(conn.exec_driver_sql("EXPLAIN " + sql).scalars())
            assert "ix_runfield_key_short_text" in plan, plan
        conn.rollback()
