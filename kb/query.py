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
the typed `RunField` rows, or a Run column, or one bare name the vocabulary knows
(`val/loss`, `eval_loss` -> summary.val/loss; `seq_len` -> hparams.seq_len; kb.vocab). Segments are bare words or double-quoted
(`summary."val loss"`), the spelling of kb.fields.canonical.

Semantics are two-valued and typed, the same on SQLite and Postgres: a comparison holds only
when the value exists, has the literal's type (a number is never a bool) and compares true;
so a missing key makes every comparison false and `not (a = 1)` is true for runs without a.
Strings order by code point. `exists` is true for a leaf or a prefix of one.

`parse` gives the AST, `parse_sort` a sort spec's keys, `render` text that parses back to an
AST, and `evaluate` is the pure-Python reference the SQL of kb.query_sql is tested against.
"""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Union

from kb import vocab
from kb.errors import QueryError
from kb.fields import BARE, NAMESPACES, canonical, leaves, lookup, typed


# query name -> (Run attribute, kind): s string, n number, t time (compared with ISO-8601 strings)
COLUMNS: dict[str, tuple[str, str]] = {
    "id": ("id", "s"), "project": ("project", "s"), "name": ("name", "s"),
    "status": ("status", "s"), "parent": ("parent", "s"), "source_kind": ("source_kind", "s"),
    "source_uri": ("source_uri", "s"), "hypothesis": ("hypothesis", "s"),
    "lr": ("lr", "n"), "batch_size": ("batch_size", "n"), "params": ("params", "n"),
    "tokens": ("tokens", "n"), "flops": ("flops", "n"),
    "started_at": ("started_at", "t"), "ended_at": ("ended_at", "t"), "ingested_at": ("ingested_at", "t"),
}
KEYWORDS = {"and", "or", "not", "in", "exists", "true", "false", "null", "asc", "desc"}
OPS = {"=": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
       ">": operator.gt, ">=": operator.ge}
ORDERING = {"<", "<=", ">", ">="}
# Limits, the same on every database (README, "The query language"). Past them a query is bad
# input, never a database error: SQLite refuses an expression tree deeper than 1,000 and a join
# of more than 64 tables, and SQLite 3.40 crashes on a join ordered by 64 or more terms.
MAX_DEPTH = 64          # nesting deeper than any person writes; keeps recursion far from Python's limit
MAX_TERMS = 2000        # comparisons, `exists` and `in` values: hundreds of ids in one `in` list fit
MAX_SORT_KEYS = 16      # a sort key is up to 3 ORDER BY terms: 16 keep a sorted join under 64
MAX_CHARS = 100_000     # query text; 2,000 uuids in an `in` list take 88,000

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


def vocabulary_key(name: str) -> Path | None:
    """A bare canonical name or alias, as the key it stands for: a metric is its canonical
    summary (`eval_loss` -> summary.val/loss, which every run answers to whatever its source
    called it), a hyperparameter its promoted column or `hparams.<canonical>`."""
    if (scale := vocab.scale_name(name)) is not None:
        return (scale,) if scale in COLUMNS else ("scale", scale)
    if (hp := vocab.hparam_name(name)) is not None:
        return (hp,) if hp in COLUMNS else ("hparams", hp)
    if (metric := vocab.metric_name(name)) is not None:
        return ("summary", metric)
    return None


EXCERPT = 72            # characters of the query shown around an error's column


def _fail(text: str, pos: int, message: str) -> QueryError:
    """The message, then the query (a window of it when long) with a caret under the column."""
    start = max(0, min(pos - EXCERPT // 2, len(text) - EXCERPT))
    shown = "".join(_shown(c) for c in text[start:start + EXCERPT])
    lead, tail = ("..." if start else ""), ("..." if start + EXCERPT < len(text) else "")
    caret = " " * (len(lead) + pos - start) + "^"
    return QueryError(f"{message} at column {pos + 1}\n  {lead}{shown}{tail}\n  {caret}")


def _shown(c: str) -> str:
    # one cell per character, so the caret stays under its column (and a stray byte prints)
    return c if c.isprintable() else " " if c.isspace() else "?"


UNENCODABLE = re.compile(r"[\x00\ud800-\udfff]")


def _check_text(text: str) -> None:
    """Refuse a query past MAX_CHARS, and what no stored key or value holds and no database takes
    as a parameter: NUL (Postgres text refuses it) and lone surrogates (no UTF-8 spelling; how
    Python passes on an argument's invalid UTF-8 bytes)."""
    if len(text) > MAX_CHARS:
        raise QueryError(f"the query is {len(text):,} characters long; at most {MAX_CHARS:,} are allowed")
    if m := UNENCODABLE.search(text):
        cp = ord(m.group())
        what = ("a NUL character (U+0000); no key or string in a query can hold one" if cp == 0 else
                f"invalid UTF-8 (byte 0x{cp - 0xDC00:02x})" if 0xDC80 <= cp <= 0xDCFF else
                f"a lone surrogate (U+{cp:04X}), which is not text")
        raise _fail(text, m.start(), what)


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
        if not isinstance(text, str):
            raise QueryError(f"a query is text, not {type(text).__name__}")
        _check_text(text)
        self.text, self.tokens, self.at, self.depth, self.terms = text, tokenize(text), 0, 0, 0

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
        word = self.text[tok.pos:tok.end]
        got = "end of input" if tok.kind == "end" else repr(word if len(word) <= 40 else word[:37] + "...")
        return _fail(self.text, tok.pos, f"expected {expected}, got {got}{hint}")

    def nest(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _fail(self.text, self.tok.pos, f"expression nests deeper than {MAX_DEPTH}")

    def count(self, tok: Token) -> None:
        self.terms += 1
        if self.terms > MAX_TERMS:
            raise _fail(self.text, tok.pos, f"the query has more than {MAX_TERMS:,} terms (each comparison, "
                        f"'exists' and value in an 'in' list is one)")

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
        self.count(self.tok)
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
        if len(path) == 1 and (resolved := vocabulary_key(head)):
            return resolved
        raise _fail(self.text, tok.pos, f"unknown key {head!r}; a key starts with a namespace "
                    f"({', '.join(NAMESPACES)}), is a column ({', '.join(COLUMNS)}) or a metric or "
                    f"hyperparameter the vocabulary knows (val/loss, train/loss, seq_len, ...)")

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
            except OverflowError:     # in UTC before year 1 or after 9999, which no stored time is
                raise _fail(self.text, tok.pos, f"{key[0]} takes a time within years 1-9999 in UTC") from None
        return value

    def literals(self, key: Path) -> tuple[Literal, ...]:
        if self.tok.kind != "(":
            raise self.fail("'(' after 'in'")
        self.take()
        values = [self.literal(key, "=")]       # the key counted as the first value's term
        while self.tok.kind == ",":
            self.take()
            self.count(self.tok)
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
        if len(out) == MAX_SORT_KEYS:
            raise _fail(spec, p.tok.pos, f"more than {MAX_SORT_KEYS} sort keys")
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
        vtype, num, text = typed(v)       # the writer's typing, so NaN reads as the string 'NaN'
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
