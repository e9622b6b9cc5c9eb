"""The run query language (kb.query) compiled to SQLAlchemy over Run and its RunField rows.

`compile_where`/`compile_sort` turn an expression or sort spec into SQLAlchemy clauses over
Run (user values always travel as bound parameters), and `apply_query` adds both to a select
in the joined form the planners do best with (what `KnowledgeBase.runs` uses). The clauses
keep kb.query's semantics on SQLite and Postgres alike: two-valued (never SQL NULL), typed,
strings in code-point order (`codepoint`); tests hold them to `kb.query.evaluate`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from sqlalchemy import (Float, Integer, Numeric, Select, String, Text, and_, case, false, func, literal,
                        not_, or_, select, true)
from sqlalchemy import text as sql_text
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import aliased
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.sql.sqltypes import NullType

from kb.field_terms import RUNTERM, field_term
from kb.fields import canonical
from kb.models import TEXT_INDEXED, Run, RunField
from kb.query import (COLUMNS, OPS, ORDERING, And, Compare, Exists, In, Literal, Node, Not, Or, _as_time,
                      _literal_type, parse, parse_sort, render)


# ---- SQL ----------------------------------------------------------------------------------

_RF = RunField.__table__.c      # Core columns for the subqueries: an ORM select compiles ~2x slower


class codepoint(FunctionElement):
    """Text in code-point order: COLLATE "C" on Postgres; SQLite's default BINARY already is."""
    inherit_cache = True
    name = "codepoint"
    type = Text()


@compiles(codepoint)
def _codepoint_default(element, compiler, **kw):
    return compiler.process(element.clauses, **kw)


@compiles(codepoint, "postgresql")
def _codepoint_postgres(element, compiler, **kw):
    return f'{compiler.process(element.clauses, **kw)} COLLATE "C"'


class short_text(FunctionElement):
    """True of a string column's value that Postgres's (key, vtype, text) index holds (at most
    TEXT_INDEXED bytes, kb.models), written beside an equality with a value that short: the
    planner uses a partial index only when the query's own conditions imply its predicate.
    SQLite's index holds every string: `IS NOT NULL`, which the equality implies anyway."""
    inherit_cache = True
    name = "short_text"
    type = NullType()       # as `driving`: no `= 1` after it on SQLite


@compiles(short_text)
def _short_text_default(element, compiler, **kw):
    return f"{compiler.process(element.clauses, **kw)} IS NOT NULL"


@compiles(short_text, "postgresql")
def _short_text_postgres(element, compiler, **kw):
    return f"octet_length({compiler.process(element.clauses, **kw)}) <= {TEXT_INDEXED}"


def _indexed(s: str) -> bool:
    return len(s.encode("utf-8", "surrogatepass")) <= TEXT_INDEXED


class driving(FunctionElement):
    """A test the plan should start from: SQLite's planner is told it is rare (likelihood), so it
    drives from that test's index range and probes the other keys' rows by primary key; without
    statistics it would pick a range (`< 3.6`) over an equality whatever their sizes. Postgres
    plans from its own statistics: the test as written."""
    inherit_cache = True
    name = "driving"
    type = NullType()       # not Boolean: SQLite's dialect would compare a boolean function with 1


@compiles(driving)
def _driving_default(element, compiler, **kw):
    return compiler.process(element.clauses, **kw)


@compiles(driving, "sqlite")
def _driving_sqlite(element, compiler, **kw):
    return f"likelihood({compiler.process(element.clauses, **kw)}, 0.000001)"


class unordered(FunctionElement):
    """The same value, hidden from index order: ORDER BY on it cannot be served by walking an
    index, so a filtered, sorted query finds all matches and sorts them (cost: the matches)
    instead of walking the sort key's index from the best end and testing each run (cost:
    wherever the first match sits). SQLite's unary `+`; on Postgres `|| ''` for text, `+ 0`
    for numbers."""
    inherit_cache = True
    name = "unordered"

    def __init__(self, expr):
        super().__init__(expr)
        self.type = expr.type


@compiles(unordered)
def _unordered_default(element, compiler, **kw):
    return f"+{compiler.process(element.clauses, **kw)}"


@compiles(unordered, "postgresql")
def _unordered_postgres(element, compiler, **kw):
    inner = compiler.process(element.clauses, **kw)
    if isinstance(element.type, String):
        return f"({inner} || '')"
    if isinstance(element.type, (Float, Integer, Numeric)):
        return f"({inner} + 0)"
    return inner            # times: no index on a non-null time column to walk


class parenthesised(FunctionElement):
    """A condition in parentheses that SQLAlchemy keeps (it flattens a nested and_/or_ and its
    Grouping away)."""
    inherit_cache = True
    name = "parenthesised"
    type = NullType()       # as `driving`: no `= 1` after it on SQLite


@compiles(parenthesised)
def _parenthesised(element, compiler, **kw):
    return f"({compiler.process(element.clauses, **kw)})"


class standalone(FunctionElement):
    """A top-level `IN (SELECT ...)` test kept as one: Postgres turns each such test of a
    top-level `and` into a semi-join and searches join orders over all of them (64 took 1.5 s
    to plan, 200 over a minute); `IS TRUE` (a no-op: the test is never NULL) leaves it a hashed
    subplan, run once and probed per run. SQLite plans each one alone already."""
    inherit_cache = True
    name = "standalone"
    type = NullType()


@compiles(standalone)
def _standalone_default(element, compiler, **kw):
    return compiler.process(element.clauses, **kw)


@compiles(standalone, "postgresql")
def _standalone_postgres(element, compiler, **kw):
    return f"({compiler.process(element.clauses, **kw)}) IS TRUE"


FAN_IN = 8      # items per parenthesised group of a long `and`/`or`


def _balanced(join, clauses: list) -> ColumnElement[bool]:
    """and_/or_ over clauses as a tree of parenthesised groups: SQLite parses `a OR b OR c ...`
    left-deep and refuses a tree deeper than 1,000, so a thousand terms take depth 8 * log8(n)."""
    while len(clauses) > FAN_IN:
        clauses = [parenthesised(join(*clauses[i:i + FAN_IN])) for i in range(0, len(clauses), FAN_IN)]
    return join(*clauses)


def compile_where(expr: str | Node) -> ColumnElement[bool]:
    """A boolean clause over Run for `select(Run).where(...)`; it never yields SQL NULL."""
    items = _conjuncts(parse(expr) if isinstance(expr, str) else expr)
    clauses = [_sql(n) for n in items]
    # the top-level subqueries past the first few stay standalone (as in `apply_query`)
    subqueries = [i for i, n in enumerate(items) if isinstance(n, (Compare, In, Exists)) and n.key[0] not in COLUMNS]
    for i in subqueries[MAX_JOINED_KEYS:]:
        clauses[i] = standalone(clauses[i])
    return _balanced(and_, clauses)


def _sql(node: Node) -> ColumnElement[bool]:
    if isinstance(node, Or):
        return _balanced(or_, [_sql(n) for n in node.items])
    if isinstance(node, And):
        return _balanced(and_, [_sql(n) for n in node.items])
    if isinstance(node, Not):
        return not_(_sql(node.expr))
    if node.key[0] in COLUMNS:
        column = _column(node.key[0])
        if isinstance(node, Exists):
            return column.is_not(None) if _nullable(node.key[0]) else true()
        if isinstance(node, In):
            return _column_in(node.key[0], node.values)
        return _column_compare(node.key[0], node.op, node.value)
    key = canonical(node.key)
    if isinstance(node, Exists):
        # a prefix match by code-point range ('k.' <= key < 'k/'), not LIKE: SQLite's LIKE
        # ignores ASCII case, so `config.Optim exists` would match config.optim.lr
        under = and_(codepoint(_RF.key) >= key + ".", codepoint(_RF.key) < key + "/")
        return Run.id.in_(select(_RF.run_id).where(or_(_RF.key == key, under)))
    # IN (subquery) keeps the logic two-valued (run_id is never NULL) and uses the (key, vtype, ...) indexes
    return Run.id.in_(select(_RF.run_id).where(_RF.key == key, _field_cond(node, _RF)))


def _field_cond(node: Compare | In, f, drive: bool = False) -> ColumnElement[bool]:
    """The test node puts on one RunField row; f is its columns (_RF) or an alias of RunField.
    `drive` marks the value test as the one the plan starts from (`driving`)."""
    mark = driving if drive else _same
    if isinstance(node, In):
        return _field_in(node.values, f, mark)
    return _field_compare(node.op, node.value, f, mark)


def _same(cond):
    return cond


def _field_compare(op: str, lit: Literal, f, mark=_same) -> ColumnElement[bool]:
    if lit is None:
        return mark(f.vtype == "z") if op == "=" else false()
    if isinstance(lit, bool):
        return and_(f.vtype == "b", mark(OPS[op](f.num, 1.0 if lit else 0.0)))
    if isinstance(lit, str):
        text = codepoint(f.text) if op in ORDERING else f.text
        if op == "=" and _indexed(lit):
            return and_(f.vtype == "s", mark(text == lit), short_text(f.text))
        return and_(f.vtype == "s", mark(OPS[op](text, lit)))
    return and_(f.vtype == "n", mark(OPS[op](f.num, float(lit))))


def _field_in(values: tuple[Literal, ...], f, mark=_same) -> ColumnElement[bool]:
    nums = [float(v) for v in values if _literal_type(v) == "n"]
    strs = [v for v in values if isinstance(v, str)]
    bools = [1.0 if v else 0.0 for v in values if isinstance(v, bool)]
    conds = []
    if nums:
        conds.append(and_(f.vtype == "n", mark(f.num.in_(nums))))
    short = [v for v in strs if _indexed(v)]
    if short:
        conds.append(and_(f.vtype == "s", mark(f.text.in_(short)), short_text(f.text)))
    if len(short) < len(strs):
        conds.append(and_(f.vtype == "s", mark(f.text.in_([v for v in strs if not _indexed(v)]))))
    if bools:
        conds.append(and_(f.vtype == "b", mark(f.num.in_(bools))))
    if None in values:
        conds.append(mark(f.vtype == "z"))
    return or_(*conds)


def _column(name: str):
    return getattr(Run, COLUMNS[name][0])


def _nullable(name: str) -> bool:
    return Run.__table__.c[COLUMNS[name][0]].nullable


def _column_compare(name: str, op: str, lit: Literal) -> ColumnElement[bool]:
    column, kind = _column(name), COLUMNS[name][1]
    if kind == "n" and _literal_type(lit) == "n":
        cond = OPS[op](column, float(lit))
    elif kind == "s" and isinstance(lit, str):
        cond = OPS[op](codepoint(column) if op in ORDERING else column, lit)
    elif kind == "t" and isinstance(lit, str):
        cond = OPS[op](column, _time_param(name, lit))
    else:
        return false()                    # a literal of another type never matches
    return and_(column.is_not(None), cond) if _nullable(name) else cond


def _column_in(name: str, values: tuple[Literal, ...]) -> ColumnElement[bool]:
    """One IN list of the values of the column's type (hundreds of ids are one list, not an `or`)."""
    column, kind = _column(name), COLUMNS[name][1]
    if kind == "n":
        params = [float(v) for v in values if _literal_type(v) == "n"]
    elif kind == "s":
        params = [v for v in values if isinstance(v, str)]
    else:
        params = [_time_param(name, v) for v in values if isinstance(v, str)]
    if not params:
        return false()
    cond = column.in_(params)
    return and_(column.is_not(None), cond) if _nullable(name) else cond


def _time_param(name: str, lit: str):
    """An ISO-8601 literal bound the way the column stores times: aware for timezone-aware
    types, naive UTC otherwise."""
    t = _as_time(lit)
    aware = getattr(Run.__table__.c[COLUMNS[name][0]].type, "timezone", False)
    return t if aware else t.replace(tzinfo=None)


def compile_sort(spec: str) -> list:
    """ORDER BY clauses for a sort spec; runs missing the key sort last either way, ties by id.

    A RunField key orders numbers first, then strings, then bools (false < true); the
    direction applies within a type. These clauses stand alone (a RunField key reads its row
    through correlated subqueries); `apply_query` gives the same order through one join.
    """
    clauses: list = []
    for key, desc in parse_sort(spec):
        if key[0] in COLUMNS:
            clauses += _column_sort(key[0], desc)
        else:
            k = canonical(key)

            def field(attr):
                return select(attr).where(RunField.run_id == Run.id, RunField.key == k).scalar_subquery()

            clauses += _field_sort(field(RunField.vtype), field(RunField.num), field(RunField.text), desc)
    return clauses + [codepoint(Run.id).asc()]


def _direct(e, desc: bool):
    return e.desc() if desc else e.asc()


def _column_sort(name: str, desc: bool, hide=_same) -> list:
    column = _column(name)
    value = _direct(codepoint(hide(column)) if COLUMNS[name][1] == "s" else hide(column), desc)
    # a nullable column's order starts with a CASE, which no index serves anyway
    return [case((column.is_(None), 1), else_=0), value] if _nullable(name) else [value]


def _field_sort(vtype, num, text, desc: bool, pinned: str | None = None, hide=_same) -> list:
    """Order by one RunField row's (vtype, num, text); `pinned` when every row has that vtype.
    `hide` (`unordered`) keeps a pinned order off the index; the unpinned one starts with a CASE."""
    if pinned in ("n", "b"):                  # bools are 0/1 in num
        return [_direct(hide(num), desc)]
    if pinned == "s":
        return [_direct(codepoint(hide(text)), desc)]
    return [case({"n": 0, "s": 1, "b": 2}, value=vtype, else_=3),      # missing: 3, last
            _direct(num, desc),                                         # numbers; bools as 0/1
            _direct(codepoint(text), desc)]


# ---- the planner-friendly query -------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    joins: tuple            # (alias of RunField, ON clause, outer?)
    filters: tuple          # WHERE clauses
    order: tuple            # ORDER BY clauses, empty without a sort
    base: object = None     # top_ids: the driving test's alias (or runterm), the query's FROM
    anchor: object = None   # top_ids: base's run id


@dataclass(frozen=True)
class _Items:
    """A where clause's top-level `and` items by how the plan takes them (nodes, no SQL yet)."""
    tests: tuple            # (canonical key, test nodes) per joined key, in join order
    more: tuple             # the same for the keys past MAX_JOINED_KEYS: a subquery each
    exists: tuple           # `exists` on RunField keys: a subquery each
    other: tuple            # `or`, `not`, run column tests


def apply_query(stmt: Select, where: str | Node | None = None, sort: str | None = None,
                driver: int | None = None) -> Select:
    """stmt (a select over Run) filtered by `where` and ordered by `sort`, shaped for the planner.

    Same rows and order as `.where(compile_where(where)).order_by(*compile_sort(sort))`, but
    each top-level `and` item that tests a RunField key (a comparison or `in`; the first
    MAX_JOINED_KEYS keys) becomes an inner join to that key's row, and each RunField sort key a
    join to its row (outer unless a filter already joins it). A run has at most one row per key
    ((key, run_id) is the primary key), so joins never duplicate a run. The plan starts from
    one joined test's index range (`driver`: its index among the joined tests, as
    `choose_driver` picks it; by default the first equality) and probes the other keys' rows by
    primary key, so its cost is the size of that range and never depends on where the matching
    runs sit in the sort order: a sort key that anything else filters is kept off its index
    (`unordered`); only when the sort key's own tests are the whole filter (every run the walk
    meets is a match) does the order come straight from its (key, vtype, num) index, stopping
    at the LIMIT. Each joined test is also asked once of the whole table (an uncorrelated
    EXISTS), so a value no run has ends the query at once. Keys past MAX_JOINED_KEYS, `or`,
    `not`, `exists` and column tests compile as in `compile_where`.
    """
    # a Node is cached by its text: 1.0 == True, so equal-looking nodes can differ
    plan = _plan(where if where is None or isinstance(where, str) else render(where), sort, driver)
    for target, on, outer in plan.joins:
        stmt = stmt.join(target, on, isouter=outer)
    if plan.filters:
        stmt = stmt.where(_balanced(and_, list(plan.filters)))
    return stmt.order_by(*plan.order) if plan.order else stmt


DRIVER_COUNT_CAP = 256      # index entries counted per test to pick the smallest; past this, all are big


def test_sizes(conn, where: str | Node | None) -> tuple[int, ...] | None:
    """Each joined test's matching rows, counted up to DRIVER_COUNT_CAP in one round trip; None
    without tests, and on Postgres, which plans from its own statistics (and counted a string
    test's rows through a bitmap of every match: 20 ms at 100,000 runs)."""
    if where is None or conn.dialect.name != "sqlite":
        return None
    counts = _sizes(where if isinstance(where, str) else render(where))
    return tuple(conn.execute(counts).one()) if counts is not None else None


def choose_driver(conn, where: str | Node | None, sizes: tuple[int, ...] | None = None) -> int | None:
    """The joined test with the fewest matching rows (`test_sizes`, counted here unless given),
    for `apply_query(..., driver=)`; None when there is nothing to choose or the database plans
    from its own statistics (Postgres)."""
    sizes = test_sizes(conn, where) if sizes is None else sizes
    if not sizes or len(sizes) < 2:
        return None
    text = where if isinstance(where, str) else render(where)
    default = _default_driver(_items(text).tests)
    # the smallest range; a tie (all past the cap) keeps the default's preference for equality
    return min(range(len(sizes)), key=lambda i: (sizes[i], i != default, i))


@lru_cache(maxsize=256)
def _sizes(where: str) -> Select | None:
    tests = _items(where).tests
    if not tests:
        return None
    return select(*(select(func.count()).select_from(
        select(literal(1)).where(_balanced(and_, [_RF.key == k, *(_field_cond(n, _RF) for n in nodes)]))
        .limit(DRIVER_COUNT_CAP).subquery()).scalar_subquery() for k, nodes in tests))


WALK_BUDGET = 500       # sort-key rows a walk reads before it leaves the query to the driven plan


def walk_ids(conn, where: str | Node | None, sort: str, limit: int,
             sizes: tuple[int, ...] | None = None, terms: bool = False) -> list[str] | None:
    """The ids of the first `limit` runs in `apply_query`'s order, found by walking the sort key's
    numbers in order through its (key, vtype, num) index and probing each run's tests by primary
    key, at most WALK_BUDGET runs; None when the walk does not apply or did not find `limit`.

    For a filter that every test matches broadly (`norm = 'rmsnorm'`, half the runs), the driven
    plan reads every match to sort them, while ~limit / selectivity steps of the walk find the
    first few. The walk is a prefix of the whole order (numbers sort before any other value, ties
    by run id), so what it finds is the answer; the budget bounds what a walk that finds too
    little costs (matches far down the order) before `top_ids` answers as it always did. A test
    with fewer than DRIVER_COUNT_CAP rows (`sizes`, `test_sizes`: SQLite's, counted here unless
    given) skips the walk; Postgres has no counts (`test_sizes`) and walks first unless its
    statistics say the runs' terms match too few for a walk to find `limit` (`terms`,
    `term_share`): a walk that misses costs ~4-8 ms there."""
    if where is None:
        return None
    text = where if isinstance(where, str) else render(where)
    walk = _walk(text, sort, limit)
    if walk is None:
        return None
    sizes = test_sizes(conn, text) if sizes is None else sizes
    if sizes and min(sizes) < DRIVER_COUNT_CAP:
        return None
    share = term_share(conn, text) if terms else None
    if share is not None and share * WALK_BUDGET < limit / 2:
        return None
    ids = list(conn.execute(walk).scalars())
    return ids if len(ids) == limit else None


def term_share(conn, where: str) -> float | None:
    """Postgres's estimate of the share of runs that hold the terms of where's equalities (from
    its statistics of the terms' frequencies: off by ~10% where its RunField estimates of the
    same tests were off 40x), or None without a term plan or before runterm's first ANALYZE.
    One EXPLAIN; whether runterm has statistics is asked once per connection until it has.

    Walking on a wrong guess costs a miss, skipping it a read of every match, so without
    statistics this says nothing (the default estimate says any filter matches one run)."""
    explain = _term_explain(where, conn.dialect)
    if explain is None:
        return None
    if not conn.info.get(_STATS_SEEN):
        if conn.execute(_TERM_STATS).scalar() is None:
            return None
        conn.info[_STATS_SEEN] = True
    plan = conn.exec_driver_sql(*explain).scalar_one()
    matching, every = (p["Plan Rows"] for p in (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]["Plans"])
    return matching / every if every else None


_STATS_SEEN = "kb_runterm_has_statistics"
_TERM_STATS = sql_text("SELECT 1 FROM pg_stats WHERE schemaname = current_schema() AND tablename = 'runterm' "
                       "AND attname = 'terms'")


@lru_cache(maxsize=256)
def _term_explain(where: str, dialect) -> tuple[str, dict] | None:
    """EXPLAIN of the terms' search beside a scan of every run (its estimate: the table's rows),
    compiled once per query text for the connection's driver."""
    termed = _termed(_items(where).tests)
    if termed is None:
        return None
    t = RUNTERM.c
    both = select(t.run_id).where(*_term_filters(*termed[:2])).union_all(select(t.run_id))
    compiled = both.compile(dialect=dialect)
    return f"EXPLAIN (FORMAT JSON) {compiled}", compiled.params


@lru_cache(maxsize=256)
def _walk(where: str, sort: str, limit: int) -> Select | None:
    items = _items(where)
    sort_keys = parse_sort(sort)
    if len(sort_keys) != 1 or items.more or items.exists or items.other or not items.tests or limit > WALK_BUDGET:
        return None
    key, desc = sort_keys[0]
    if key[0] in COLUMNS or canonical(key) in dict(items.tests):
        return None
    w = _alias(len(items.tests))
    order = (_direct(w.num, desc), codepoint(w.run_id).asc())
    walked = (select(w.run_id, w.num).where(w.key == canonical(key), w.vtype == "n")
              .order_by(*order).limit(WALK_BUDGET).subquery("walked"))
    # each test a probe of the walked run's row by primary key: as a join, or an EXISTS Postgres
    # may turn into a hashed subplan, it would read every match first, the cost the walk avoids
    # (Postgres neither pulls up nor hashes an EXISTS with an OFFSET). The row is fetched by
    # (key, run_id) alone behind a second OFFSET and tested outside it: with the value test
    # beside it, Postgres probed through the (key, vtype, num) index instead, reading every run
    # with that value per walked run (at 10,000 runs, 923 index entries x 500 steps: 35 ms)
    probes = [standalone(select(literal(1)).select_from(row).where(
        _balanced(and_, [_field_cond(n, row.c) for n in nodes])).offset(0).exists())
        for i, (k, nodes) in enumerate(items.tests)
        for f in [_alias(i)]
        for row in [select(f.vtype, f.num, f.text).where(f.run_id == walked.c.run_id, f.key == k)
                    .correlate(walked).offset(0).subquery(f"probe{i + 1}")]]
    return (select(walked.c.run_id).where(_balanced(and_, probes))
            .order_by(_direct(walked.c.num, desc), codepoint(walked.c.run_id).asc()).limit(limit))


def _default_driver(tests: tuple) -> int:
    """Without counts: the first test with an equality (`=`, `in`), else the first."""
    for i, (_, nodes) in enumerate(tests):
        if any(isinstance(n, In) or n.op == "=" for n in nodes):
            return i
    return 0


def top_ids(where: str | Node | None, sort: str, limit: int, driver: int | None = None,
            terms: bool = False) -> Select | None:
    """The ids of the first `limit` runs in `apply_query`'s order, read from RunField rows alone,
    or None when the query needs the run table (a column test or sort, `or`, `not`, `exists`).

    The driving test's rows are the base and every other key is probed from them: joining the
    run table as well cost a probe per candidate run, about a third of the query, for rows
    that only the final few need (`KnowledgeBase.runs` fetches those by id). With `terms`
    (Postgres: kb.field_terms), equalities on TERM_MIN_KEYS keys or more are answered by the
    runs' terms instead, and only the other tests and the sort keys are probed."""
    return _top_ids(where if where is None or isinstance(where, str) else render(where), sort, limit, driver, terms)


@lru_cache(maxsize=256)
def _top_ids(where: str | None, sort: str, limit: int, driver: int | None, terms: bool) -> Select | None:
    # the statement object is cached too: SQLAlchemy keeps its cache key on it
    plan = _plan(where, sort, driver, True, terms)
    if plan is None:
        return None
    stmt = select(plan.anchor).select_from(plan.base)
    for target, on, outer in plan.joins:
        stmt = stmt.join(target, on, isouter=outer)
    return stmt.where(_balanced(and_, list(plan.filters))).order_by(*plan.order).limit(limit)


@lru_cache(maxsize=256)
def _plan(where: str | None, sort: str | None, driver: int | None, runless: bool = False,
          terms: bool = False) -> _Plan | None:
    # cached by text: parsing and building the clauses cost more than the indexed query itself;
    # the clauses are immutable and bind their values as parameters, so sharing them is safe
    items = _items(where)
    sort_keys = parse_sort(sort) if sort else []
    if runless and (items.more or items.exists or items.other or not items.tests or not sort_keys
                    or any(key[0] in COLUMNS for key, _ in sort_keys)):
        return None
    termed = _termed(items.tests) if runless and terms else None
    if termed is not None:
        return _term_plan(*termed, sort_keys)
    tests = dict(items.tests)
    filters = [_sql(n) for n in items.other]
    # one subquery per key past the joined ones: a run has one row per key
    subqueries = [_sql(n) for n in items.exists] + [Run.id.in_(select(_RF.run_id).where(
        _balanced(and_, [_RF.key == k, *(_field_cond(n, _RF) for n in nodes)]))) for k, nodes in items.more]
    room = max(0, MAX_JOINED_KEYS - len(tests))      # what a planner joins: the keys, then subqueries
    filters += subqueries[:room] + [standalone(q) for q in subqueries[room:]]
    first = sort_keys[0][0] if sort_keys else None
    first = first[0] if first and first[0] in COLUMNS else (canonical(first) if first else None)
    # walking the first sort key's index visits only matches when nothing but its own tests filter
    walk = not filters and all(k == first for k in tests)
    hide = _same if walk else unordered
    if driver is None:
        driver = _default_driver(items.tests) if tests else None
    aliases = {k: _alias(i) for i, k in enumerate(tests)}
    base = aliases[list(tests)[driver]] if runless else None
    anchor = base.run_id if runless else Run.id      # what every joined row is the row of
    joins, rows = [], {}                             # canonical key -> (alias, pinned vtype)
    for i, (k, nodes) in enumerate(tests.items()):
        f = aliases[k]
        cond = _balanced(and_, [f.key == k, *(_field_cond(n, f, i == driver and not walk) for n in nodes)])
        if f is base:
            filters.append(cond)
        else:
            joins.append((f, and_(f.run_id == anchor, cond), False))
        # the same tests on any run, implied by the join: uncorrelated, so evaluated once before
        # the join; a value no run has (an lr never tried) then ends the query at once
        # (SELECT key, not *: the (key, vtype, num) index then answers it alone)
        filters.append(select(_RF.key).where(
            _balanced(and_, [_RF.key == k, *(_field_cond(n, _RF) for n in nodes)])).exists())
        types = set.intersection(*({_literal_type(v) for v in _literals(n)} for n in nodes))
        rows[k] = f, (types.pop() if len(types) == 1 else None)
    order = _order(sort_keys, rows, joins, anchor, hide)
    return _Plan(tuple(joins), tuple(filters), tuple(order), base, anchor if runless else None)


def _order(sort_keys: list, rows: dict, joins: list, anchor, hide) -> list:
    """ORDER BY clauses for the sort keys over the plan's joined rows (canonical key -> (alias,
    pinned vtype)); a sort key no test joined gets an outer join, appended to `joins`."""
    order: list = []
    for j, (key, desc) in enumerate(sort_keys):
        h = hide if j == 0 else _same                # the first term decides whether an index can serve
        if key[0] in COLUMNS:
            order += _column_sort(key[0], desc, h)
            continue
        k = canonical(key)
        if k not in rows:
            f = _alias(len(rows))                    # after the tests' aliases, one per new key
            joins.append((f, and_(f.run_id == anchor, f.key == k), True))
            rows[k] = f, None
        f, pinned = rows[k]
        order += _field_sort(f.vtype, f.num, f.text, desc, pinned, h)
    if order:
        order.append(codepoint(anchor).asc())
    return order


TERM_MIN_KEYS = 2       # keys with an equality before the terms answer them: one key's range is as good


def _termed(tests: tuple) -> tuple | None:
    """(terms every match holds, term lists of which a match holds one, the tests left to probe
    per key) when equalities on TERM_MIN_KEYS keys or more have terms (kb.field_terms), else None."""
    every: list[str] = []
    some: list[list[str]] = []
    rest: dict[str, tuple] = {}
    keys = 0
    for k, nodes in tests:
        left = []
        for node in nodes:
            spelled = _terms(k, node)
            if spelled is None:
                left.append(node)
            elif isinstance(node, In):
                some.append(spelled)
            else:
                every += spelled
        keys += len(left) < len(nodes)
        if left:
            rest[k] = tuple(left)
    return (tuple(every), tuple(map(tuple, some)), tuple(rest.items())) if keys >= TERM_MIN_KEYS else None


def _terms(key: str, node: Compare | In) -> list[str] | None:
    """The terms of the rows an equality or `in` matches (the test holds exactly when the run
    has one of them), or None when it is not one or a value has no term."""
    if isinstance(node, Compare) and node.op != "=":
        return None
    out = [field_term(key, *_typed_literal(v)) for v in _literals(node)]
    return None if not out or None in out else out


def _typed_literal(v: Literal) -> tuple[str, float | None, str | None]:
    """(vtype, num, text) of the RunField row an equality with v matches (as _field_compare)."""
    if v is None:
        return "z", None, None
    if isinstance(v, bool):
        return "b", 1.0 if v else 0.0, None
    if isinstance(v, str):
        return "s", None, v
    return "n", float(v), None


def _term_filters(every: tuple, some: tuple) -> list:
    """The runs that hold every term of `every` and one of each list in `some`."""
    t = RUNTERM.c
    return ([t.terms.contains(list(every))] if every else []) + [t.terms.overlap(list(terms)) for terms in some]


def _term_plan(every: tuple, some: tuple, rest: tuple, sort_keys: list) -> _Plan:
    """top_ids' plan from the runs' terms: the GIN index finds the runs that hold every term of
    `every` and one of each list in `some`; each run found probes the tests left (`rest`) and
    its sort keys by primary key. Its cost is the number of matches, however many runs each
    equality alone matches."""
    t = RUNTERM.c
    filters = _term_filters(every, some)
    joins, rows = [], {}
    for i, (k, nodes) in enumerate(rest):
        f = _alias(i)
        joins.append((f, and_(f.run_id == t.run_id, f.key == k, *(_field_cond(n, f) for n in nodes)), False))
        rows[k] = f, None
    order = _order(sort_keys, rows, joins, t.run_id, unordered)
    return _Plan(tuple(joins), tuple(filters), tuple(order), RUNTERM, t.run_id)


@lru_cache(maxsize=256)
def _items(where: str | None) -> _Items:
    tests: dict[str, list[Compare | In]] = {}        # canonical key -> the tests on its row
    more: dict[str, list[Compare | In]] = {}
    exists, other = [], []
    for item in _conjuncts(parse(where)) if where else []:
        if isinstance(item, (Compare, In)) and item.key[0] not in COLUMNS:
            k = canonical(item.key)
            (tests if k in tests or len(tests) < MAX_JOINED_KEYS else more).setdefault(k, []).append(item)
        elif isinstance(item, Exists) and item.key[0] not in COLUMNS:
            exists.append(item)
        else:
            other.append(item)
    return _Items(tuple((k, tuple(v)) for k, v in tests.items()), tuple((k, tuple(v)) for k, v in more.items()),
                  tuple(exists), tuple(other))


# keys joined for their tests (and, past them, the subqueries a planner may join): with the
# sort keys' joins (kb.query.MAX_SORT_KEYS) far under SQLite's 64 tables, and as many as
# Postgres reorders (join_collapse_limit); a plan over more keys is no better for it
MAX_JOINED_KEYS = 8


@lru_cache(maxsize=None)
def _alias(i: int):
    """The i-th join's RunField alias, the same object every time: a fresh alias costs ~0.2 ms
    on first use of each column, more than the whole cached query."""
    return aliased(RunField, name=f"rf{i + 1}")


def _conjuncts(node: Node) -> list[Node]:
    """The items of a top-level `and`, nested ones (`(a and b) and c`) flattened."""
    return [i for item in node.items for i in _conjuncts(item)] if isinstance(node, And) else [node]


def _literals(node: Compare | In) -> tuple[Literal, ...]:
    return node.values if isinstance(node, In) else (node.value,)
