"""The run query language behind `kb runs --where EXPR --sort KEY` and `KnowledgeBase.runs(where=...)`.

    config.optim.lr > 1e-3 and status = 'diverged'
    summary."val/loss" < 3.5 or not config.optim.lr exists
    project in ('a', 'b')                      -- sort: '-summary.val/loss', 'params desc'

Grammar (keywords case-insensitive):

    expr := and ('or' and)*          and := not ('and' not)*        not := 'not' not | atom
    atom := '(' expr ')' | key op literal | key ['not'] 'in' '(' literal (',' literal)* ')'
          | key ['not'] 'exists'
    op   := = | == | != | < | <= | > | >=
    literal := number | 'single-quoted string' ('' or \\' inside) | true | false | null

A key is a dotted path whose first segment is a namespace (config, summary, ...) read from
the typed `RunField` rows, or a Run column. Segments are bare words or double-quoted
(`summary."val loss"`), the spelling of kb.fields.canonical.

Semantics are two-valued and typed, the same on SQLite and Postgres: a comparison holds only
when the value exists, has the literal's type (a number is never a bool) and compares true;
so a missing key makes every comparison false and `not (a = 1)` is true for runs without a.
Strings order by code point. `exists` is true for a leaf or a prefix of one.

`parse` gives the AST, `compile_where`/`compile_sort` turn it into SQLAlchemy clauses over
Run (user values always travel as bound parameters), `apply_query` adds both to a select in
the joined form the planners do best with (what `KnowledgeBase.runs` uses), and `evaluate` is
the pure-Python reference the SQL is tested against.
"""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from typing import Any, Union

from sqlalchemy import Select, Text, and_, case, exists, false, not_, or_, select, true
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import aliased
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import FunctionElement

from kb.errors import QueryError
from kb.fields import BARE, NAMESPACES, canonical, leaves, lookup, typed
from kb.models import Run, RunField

# query name -> (Run attribute, kind): s string, n number, t time (compared with ISO-8601 strings)
COLUMNS: dict[str, tuple[str, str]] = {
    "id": ("id", "s"), "project": ("project", "s"), "name": ("name", "s"),
    "status": ("status", "s"), "parent": ("parent", "s"), "source_kind": ("source_kind", "s"),
    "source_uri": ("source_uri", "s"), "hypothesis": ("hypothesis_id", "s"),
    "lr": ("lr", "n"), "batch_size": ("batch_size", "n"), "params": ("params", "n"),
    "tokens": ("tokens", "n"), "flops": ("flops", "n"),
    "started_at": ("started_at", "t"), "ended_at": ("ended_at", "t"), "ingested_at": ("ingested_at", "t"),
}
KEYWORDS = {"and", "or", "not", "in", "exists", "true", "false", "null", "asc", "desc"}
OPS = {"=": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
       ">": operator.gt, ">=": operator.ge}
ORDERING = {"<", "<=", ">", ">="}
MAX_DEPTH = 64          # nesting deeper than any person writes; keeps recursion far from Python's limit

Literal = Union[float, str, bool, None]
Path = tuple[str, ...]


# ---- AST ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Compare:
    key: Path
    op: str                  # one of OPS; '==' is normalised to '='
    value: Literal           # numbers are floats: everything is compared as a double


@dataclass(frozen=True)
class In:
    key: Path
    values: tuple[Literal, ...]


@dataclass(frozen=True)
class Exists:
    key: Path


@dataclass(frozen=True)
class Not:
    expr: "Node"


@dataclass(frozen=True)
class And:
    items: tuple["Node", ...]


@dataclass(frozen=True)
class Or:
    items: tuple["Node", ...]


Node = Union[Compare, In, Exists, Not, And, Or]


# ---- tokens -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Token:
    kind: str                # key, kw, num, str, op, ( ) , -, end
    value: Any
    pos: int
    end: int
    quoted: bool = False     # a key with a double-quoted segment (someone's string literal?)


NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
BARE_AT = re.compile(BARE.pattern.removesuffix(r"\Z"))   # the same words fields.quote leaves bare
OP_AT = re.compile(r"==|!=|<=|>=|=|<|>")
WORD_CHAR = re.compile(r"[A-Za-z0-9_]")


def _fail(text: str, pos: int, message: str) -> QueryError:
    col = pos + 1
    return QueryError(f"{message} at column {col}\n  {text}\n  {' ' * pos}^")


def tokenize(text: str) -> list[Token]:
    tokens, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif c in "(),":
            tokens.append(Token(c, c, i, i + 1))
            i += 1
        elif c in "=!<>":
            m = OP_AT.match(text, i)
            if not m:
                raise _fail(text, i, "expected an operator (=, !=, <, <=, >, >=)")
            tokens.append(Token("op", "=" if m.group() == "==" else m.group(), i, m.end()))
            i = m.end()
        elif c == "'":
            value, end = _string(text, i)
            tokens.append(Token("str", value, i, end))
            i = end
        elif m := NUMBER.match(text, i):
            if m.end() < n and WORD_CHAR.match(text, m.end()):
                raise _fail(text, i, "expected a number")
            value = float(m.group())
            if not math.isfinite(value):
                raise _fail(text, i, "number out of range")
            tokens.append(Token("num", value, i, m.end()))
            i = m.end()
        elif c == "-":
            tokens.append(Token("-", c, i, i + 1))
            i += 1
        elif c == '"' or BARE_AT.match(text, i):
            tokens.append(_key(text, i))
            i = tokens[-1].end
        else:
            raise _fail(text, i, f"unexpected character {c!r}")
    tokens.append(Token("end", None, n, n))
    return tokens


def _string(text: str, start: int) -> tuple[str, int]:
    """A single-quoted literal: '' or \\' is a quote, \\\\ a backslash, any other backslash itself."""
    out, i = [], start + 1
    while i < len(text):
        c = text[i]
        if c == "'":
            if text.startswith("''", i):
                out.append("'")
                i += 2
                continue
            return "".join(out), i + 1
        if c == "\\" and i + 1 < len(text) and text[i + 1] in "'\\":
            out.append(text[i + 1])
            i += 2
            continue
        out.append(c)
        i += 1
    raise _fail(text, start, "unterminated string (strings end with ')")


def _key(text: str, start: int) -> Token:
    """segment ('.' segment)*, each bare or double-quoted with backslash escapes."""
    segments, i, quoted = [], start, False
    while True:
        if i < len(text) and text[i] == '"':
            quoted, buf, j = True, [], i + 1
            while j < len(text) and text[j] != '"':
                if text[j] == "\\" and j + 1 < len(text):
                    j += 1
                buf.append(text[j])
                j += 1
            if j >= len(text):
                raise _fail(text, i, 'unterminated quoted key segment (it ends with ")')
            segments.append("".join(buf))
            i = j + 1
        elif m := BARE_AT.match(text, i):
            segments.append(m.group())
            i = m.end()
        else:
            raise _fail(text, i, "expected a key segment after '.'")
        if i < len(text) and text[i] == ".":
            i += 1
            continue
        break
    if len(segments) == 1 and not quoted and segments[0].lower() in KEYWORDS:
        return Token("kw", segments[0].lower(), start, i)
    return Token("key", tuple(segments), start, i, quoted)


# ---- parser -------------------------------------------------------------------------------

class _Parser:
    def __init__(self, text: str):
        self.text, self.tokens, self.at, self.depth = text, tokenize(text), 0, 0

    @property
    def tok(self) -> Token:
        return self.tokens[self.at]

    def take(self) -> Token:
        tok = self.tok
        self.at += 1
        return tok

    def is_kw(self, *words: str) -> bool:
        return self.tok.kind == "kw" and self.tok.value in words

    def fail(self, expected: str, tok: Token | None = None, hint: str = "") -> QueryError:
        tok = tok or self.tok
        got = "end of input" if tok.kind == "end" else repr(self.text[tok.pos:tok.end])
        return _fail(self.text, tok.pos, f"expected {expected}, got {got}{hint}")

    def nest(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _fail(self.text, self.tok.pos, f"expression nests deeper than {MAX_DEPTH}")

    def expr(self) -> Node:
        items = [self.conj()]
        while self.is_kw("or"):
            self.take()
            items.append(self.conj())
        return items[0] if len(items) == 1 else Or(tuple(items))

    def conj(self) -> Node:
        items = [self.neg()]
        while self.is_kw("and"):
            self.take()
            items.append(self.neg())
        return items[0] if len(items) == 1 else And(tuple(items))

    def neg(self) -> Node:
        if self.is_kw("not"):
            self.take()
            self.nest()
            node = Not(self.neg())
            self.depth -= 1
            return node
        return self.atom()

    def atom(self) -> Node:
        if self.tok.kind == "(":
            self.take()
            self.nest()
            node = self.expr()
            self.depth -= 1
            if self.tok.kind != ")":
                raise self.fail("'and', 'or' or ')'")
            self.take()
            return node
        if self.tok.kind != "key":
            raise self.fail("a key, 'not' or '('")
        key = self.key()
        if self.tok.kind == "op":
            op = self.take().value
            return Compare(key, op, self.literal(key, op))
        negate = self.is_kw("not")
        if negate:
            self.take()
        if self.is_kw("exists"):
            self.take()
            node: Node = Exists(key)
        elif self.is_kw("in"):
            self.take()
            node = In(key, self.literals(key))
        else:
            raise self.fail("'in' or 'exists'" if negate else
                            f"an operator (=, !=, <, <=, >, >=), 'in', 'exists' or 'not' after {canonical(key)}")
        return Not(node) if negate else node

    def key(self) -> Path:
        tok = self.take()
        path, head = tok.value, tok.value[0]
        if head in NAMESPACES:
            return path
        if head in COLUMNS:
            if len(path) > 1:
                raise _fail(self.text, tok.pos, f"{head} is a run column and has no fields")
            return path
        raise _fail(self.text, tok.pos, f"unknown key {head!r}; a key starts with a namespace "
                    f"({', '.join(NAMESPACES)}) or a column ({', '.join(COLUMNS)})")

    def literal(self, key: Path, op: str) -> Literal:
        tok = self.tok
        if tok.kind in ("num", "str"):
            value = self.take().value
        elif self.is_kw("true", "false", "null"):
            value = {"true": True, "false": False, "null": None}[self.take().value]
            if op in ORDERING:
                raise _fail(self.text, tok.pos, f"{tok.value} can only be compared with = or !=")
        else:
            hint = " (string literals take single quotes: 'text')" if tok.kind == "key" and tok.quoted else ""
            raise self.fail("a value (a number, a 'string', true, false or null)", hint=hint)
        if isinstance(value, str) and COLUMNS.get(key[0], ("", ""))[1] == "t":
            try:
                _as_time(value)
            except ValueError:
                raise _fail(self.text, tok.pos, f"{key[0]} takes an ISO-8601 time like '2024-05-01T12:00'") from None
        return value

    def literals(self, key: Path) -> tuple[Literal, ...]:
        if self.tok.kind != "(":
            raise self.fail("'(' after 'in'")
        self.take()
        values = [self.literal(key, "=")]
        while self.tok.kind == ",":
            self.take()
            values.append(self.literal(key, "="))
        if self.tok.kind != ")":
            raise self.fail("',' or ')'")
        self.take()
        return tuple(values)


def parse(expr: str) -> Node:
    """The AST of a --where expression; QueryError (with the column) when it does not parse."""
    p = _Parser(expr)
    if p.tok.kind == "end":
        raise p.fail("an expression")
    node = p.expr()
    if p.tok.kind != "end":
        raise p.fail("'and', 'or' or end of input")
    return node


def parse_sort(spec: str) -> list[tuple[Path, bool]]:
    """[(key, descending)] from 'key', '-key', 'key desc', 'key asc', comma-separated."""
    p, out = _Parser(spec), []
    while True:
        desc = p.tok.kind == "-"
        if desc:
            p.take()
        if p.tok.kind != "key":
            raise p.fail("a key to sort by")
        key = p.key()
        if p.is_kw("asc", "desc"):
            if desc:
                raise p.fail("',' or end of input (use either '-' or asc/desc)")
            desc = p.take().value == "desc"
        out.append((key, desc))
        if p.tok.kind == "end":
            return out
        if p.tok.kind != ",":
            raise p.fail("'asc', 'desc', ',' or end of input")
        p.take()


def render(node: Node) -> str:
    """Text that parses back to the same AST; compound operands are parenthesised."""
    def operand(n: Node) -> str:
        return f"({render(n)})" if isinstance(n, (And, Or)) else render(n)

    if isinstance(node, Or):
        return " or ".join(operand(n) for n in node.items)
    if isinstance(node, And):
        return " and ".join(operand(n) for n in node.items)
    if isinstance(node, Not):
        return "not " + operand(node.expr)
    if isinstance(node, Exists):
        return f"{canonical(node.key)} exists"
    if isinstance(node, In):
        return f"{canonical(node.key)} in ({', '.join(map(_render_literal, node.values))})"
    return f"{canonical(node.key)} {node.op} {_render_literal(node.value)}"


def _render_literal(v: Literal) -> str:
    if v is None or isinstance(v, bool):
        return {None: "null", True: "true", False: "false"}[v]
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "''") + "'"
    return repr(float(v))


def _as_time(v: datetime | str) -> datetime:
    """Aware UTC; naive times (how the store keeps them) are taken as UTC."""
    t = datetime.fromisoformat(v) if isinstance(v, str) else v
    return t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t.astimezone(timezone.utc)


# ---- reference evaluator ------------------------------------------------------------------

def evaluate(node: Node, run: dict) -> bool:
    """Whether a run, as a plain dict ({"id", "status", "config": {...}, ...}), matches node."""
    if isinstance(node, Or):
        return any(evaluate(n, run) for n in node.items)
    if isinstance(node, And):
        return all(evaluate(n, run) for n in node.items)
    if isinstance(node, Not):
        return not evaluate(node.expr, run)
    if isinstance(node, Exists):
        return _exists(run, node.key)
    if isinstance(node, In):
        return any(_holds(_typed_value(run, node.key), "=", v) for v in node.values)
    return _holds(_typed_value(run, node.key), node.op, node.value)


def _column_value(run: dict, name: str) -> Any:
    if name == "hypothesis":
        return run.get("hypothesis", run.get("hypothesis_id"))
    return run.get(name)


def _exists(run: dict, key: Path) -> bool:
    if key[0] in COLUMNS:
        return _column_value(run, key[0]) is not None
    found, value = lookup(run, key)
    if isinstance(value, (dict, list)):
        return any(True for _ in leaves(value))
    return found


def _typed_value(run: dict, key: Path) -> tuple[str, Any] | None:
    """(vtype, value) where vtype is n, s, b, z or t (a time column); None when missing."""
    if key[0] in COLUMNS:
        kind, v = COLUMNS[key[0]][1], _column_value(run, key[0])
        if kind == "n" and isinstance(v, (int, float)) and not isinstance(v, bool):
            return "n", float(v)
        if kind == "s" and isinstance(v, str):
            return "s", v
        if kind == "t" and isinstance(v, (datetime, str)):
            return "t", _as_time(v)
        return None
    found, v = lookup(run, key)
    if not found:
        return None
    try:
        vtype, num, text = typed(v)       # the writer's typing, so NaN reads as the string 'nan'
    except TypeError:                     # a dict or list: a prefix, not a value
        return None
    return vtype, {"n": num, "s": text, "b": num == 1.0, "z": None}[vtype]


def _literal_type(v: Literal) -> str:
    return "z" if v is None else "b" if isinstance(v, bool) else "s" if isinstance(v, str) else "n"


def _holds(value: tuple[str, Any] | None, op: str, lit: Literal) -> bool:
    if value is None:
        return False
    vtype, v = value
    if vtype == "t" and isinstance(lit, str):
        return OPS[op](v, _as_time(lit))
    if vtype != _literal_type(lit):
        return False
    if vtype == "z":
        return op == "="                  # null has one value: = holds, != never does
    return OPS[op](v, float(lit) if vtype == "n" else lit)


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
