"""The run query language (kb.query) compiled to SQLAlchemy over Run and its RunField rows.

`compile_where`/`compile_sort` turn an expression or sort spec into SQLAlchemy clauses over
Run (user values always travel as bound parameters), and `apply_query` adds both to a select
in the joined form the planners do best with (what `KnowledgeBase.runs` uses). The clauses
keep kb.query's semantics on SQLite and Postgres alike: two-valued (never SQL NULL), typed,
strings in code-point order (`codepoint`); tests hold them to `kb.query.evaluate`.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from sqlalchemy import Select, Text, and_, case, exists, false, not_, or_, select, true
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import aliased
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import FunctionElement

from kb.fields import canonical
from kb.models import Run, RunField
from kb.query import (COLUMNS, OPS, ORDERING, And, Compare, Exists, In, Literal, Node, Not, Or, _as_time,
                      _literal_type, parse, parse_sort, render)


# ---- SQL ----------------------------------------------------------------------------------

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


def compile_where(expr: str | Node) -> ColumnElement[bool]:
    """A boolean clause over Run for `select(Run).where(...)`; it never yields SQL NULL."""
    return _sql(parse(expr) if isinstance(expr, str) else expr)


def _sql(node: Node) -> ColumnElement[bool]:
    if isinstance(node, Or):
        return or_(*map(_sql, node.items))
    if isinstance(node, And):
        return and_(*map(_sql, node.items))
    if isinstance(node, Not):
        return not_(_sql(node.expr))
    if node.key[0] in COLUMNS:
        column = _column(node.key[0])
        if isinstance(node, Exists):
            return column.is_not(None) if _nullable(node.key[0]) else true()
        if isinstance(node, In):
            return or_(*(_column_compare(node.key[0], "=", v) for v in node.values))
        return _column_compare(node.key[0], node.op, node.value)
    key = canonical(node.key)
    if isinstance(node, Exists):
        # a prefix match by code-point range ('k.' <= key < 'k/'), not LIKE: SQLite's LIKE
        # ignores ASCII case, so `config.Optim exists` would match config.optim.lr
        under = and_(codepoint(RunField.key) >= key + ".", codepoint(RunField.key) < key + "/")
        return Run.id.in_(select(RunField.run_id).where(or_(RunField.key == key, under)))
    # IN (subquery) keeps the logic two-valued (run_id is never NULL) and uses the (key, vtype, ...) indexes
    return Run.id.in_(select(RunField.run_id).where(RunField.key == key, _field_cond(node, RunField)))


def _field_cond(node: Compare | In, f) -> ColumnElement[bool]:
    """The test node puts on one RunField row; f is RunField or an alias of it."""
    if isinstance(node, In):
        return _field_in(node.values, f)
    return _field_compare(node.op, node.value, f)


def _field_compare(op: str, lit: Literal, f) -> ColumnElement[bool]:
    if lit is None:
        return f.vtype == "z" if op == "=" else false()
    if isinstance(lit, bool):
        return and_(f.vtype == "b", OPS[op](f.num, 1.0 if lit else 0.0))
    if isinstance(lit, str):
        text = codepoint(f.text) if op in ORDERING else f.text
        return and_(f.vtype == "s", OPS[op](text, lit))
    return and_(f.vtype == "n", OPS[op](f.num, float(lit)))


def _field_in(values: tuple[Literal, ...], f) -> ColumnElement[bool]:
    nums = [float(v) for v in values if _literal_type(v) == "n"]
    strs = [v for v in values if isinstance(v, str)]
    bools = [1.0 if v else 0.0 for v in values if isinstance(v, bool)]
    conds = []
    if nums:
        conds.append(and_(f.vtype == "n", f.num.in_(nums)))
    if strs:
        conds.append(and_(f.vtype == "s", f.text.in_(strs)))
    if bools:
        conds.append(and_(f.vtype == "b", f.num.in_(bools)))
    if None in values:
        conds.append(f.vtype == "z")
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
        t = _as_time(lit)
        # bind the way the column stores times: aware for timezone-aware types, naive UTC otherwise
        aware = getattr(Run.__table__.c[COLUMNS[name][0]].type, "timezone", False)
        cond = OPS[op](column, t if aware else t.replace(tzinfo=None))
    else:
        return false()                    # a literal of another type never matches
    return and_(column.is_not(None), cond) if _nullable(name) else cond


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


def _column_sort(name: str, desc: bool) -> list:
    column = _column(name)
    value = _direct(codepoint(column) if COLUMNS[name][1] == "s" else column, desc)
    return [case((column.is_(None), 1), else_=0), value] if _nullable(name) else [value]


def _field_sort(vtype, num, text, desc: bool, pinned: str | None = None) -> list:
    """Order by one RunField row's (vtype, num, text); `pinned` when every row has that vtype."""
    if pinned in ("n", "b"):                  # bools are 0/1 in num
        return [_direct(num, desc)]
    if pinned == "s":
        return [_direct(codepoint(text), desc)]
    return [case({"n": 0, "s": 1, "b": 2}, value=vtype, else_=3),      # missing: 3, last
            _direct(num, desc),                                         # numbers; bools as 0/1
            _direct(codepoint(text), desc)]


# ---- the planner-friendly query -------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    joins: tuple            # (alias of RunField, ON clause, outer?)
    filters: tuple          # WHERE clauses
    order: tuple            # ORDER BY clauses, empty without a sort


def apply_query(stmt: Select, where: str | Node | None = None, sort: str | None = None) -> Select:
    """stmt (a select over Run) filtered by `where` and ordered by `sort`, shaped for the planner.

    Same rows and order as `.where(compile_where(where)).order_by(*compile_sort(sort))`, but
    each top-level `and` item that tests a RunField key (a comparison or `in`) becomes an inner
    join to that key's row, and each RunField sort key a join to its row (outer unless a filter
    already joins it). A run has at most one row per key ((run_id, key) is the primary key), so
    joins never duplicate a run; they let the planner start from whichever index range it
    thinks smallest and probe the other keys by primary key, instead of materialising every
    IN list. When the filters pin the sort key's type (`summary.val_loss < 3.6` makes it a
    number) the order is the (key, vtype, num) index's own, so a LIMIT stops the walk after
    the first matches. Each joined test is also asked once of the whole table (an uncorrelated
    EXISTS), so a value no run has ends the query before any walk. `or`, `not`, `exists` and
    column tests compile as in `compile_where`.
    """
    # a Node is cached by its text: 1.0 == True, so equal-looking nodes can differ
    plan = _plan(where if where is None or isinstance(where, str) else render(where), sort)
    for target, on, outer in plan.joins:
        stmt = stmt.join(target, on, isouter=outer)
    if plan.filters:
        stmt = stmt.where(*plan.filters)
    return stmt.order_by(*plan.order) if plan.order else stmt


@lru_cache(maxsize=256)
def _plan(where: str | None, sort: str | None) -> _Plan:
    # cached by text: parsing and building the clauses cost more than the indexed query itself;
    # the clauses are immutable and bind their values as parameters, so sharing them is safe
    items = _conjuncts(parse(where)) if where else []
    tests: dict[str, list[Compare | In]] = {}        # canonical key -> the tests on its row
    filters = []
    for item in items:
        if isinstance(item, (Compare, In)) and item.key[0] not in COLUMNS:
            tests.setdefault(canonical(item.key), []).append(item)
        else:
            filters.append(_sql(item))
    joins, rows = [], {}                             # canonical key -> (alias, pinned vtype)
    for k, nodes in tests.items():
        f = _alias(len(joins))
        joins.append((f, and_(f.run_id == Run.id, f.key == k, *(_field_cond(n, f) for n in nodes)), False))
        # the same tests on any run, implied by the join: uncorrelated, so evaluated once before
        # the loop; a value no run has (an lr never tried) then ends the query at once instead
        # of after a walk of the whole sort key's index probing for it
        filters.append(exists().where(RunField.key == k, *(_field_cond(n, RunField) for n in nodes)))
        types = set.intersection(*({_literal_type(v) for v in _literals(n)} for n in nodes))
        rows[k] = f, (types.pop() if len(types) == 1 else None)
    order: list = []
    for key, desc in parse_sort(sort) if sort else ():
        if key[0] in COLUMNS:
            order += _column_sort(key[0], desc)
            continue
        k = canonical(key)
        if k not in rows:
            f = _alias(len(joins))
            joins.append((f, and_(f.run_id == Run.id, f.key == k), True))
            rows[k] = f, None
        f, pinned = rows[k]
        order += _field_sort(f.vtype, f.num, f.text, desc, pinned)
    if order:
        order.append(codepoint(Run.id).asc())
    return _Plan(tuple(joins), tuple(filters), tuple(order))


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
