"""Property tests (hypothesis) for the query language and --sort, on SQLite and Postgres.

The property (issue 7): every query a person can type either returns exactly the runs a small
reference written here returns (over the fields of a fixed set of runs ingested through the
real path), or is refused as a QueryError (exit 2 at the CLI), never another exception. Every
backend is held to the same reference, so SQLite and Postgres return the same ids. Queries
come from the grammar (rendered here with random spellings: quoting, escapes, keyword case,
spacing, redundant parentheses), from valid queries with a few characters changed, and from
junk text; sort specs from key lists with random directions, with and without a filter and a
limit.

    pytest tests/test_fuzz_query.py -q                           # sized for CI
    KB_FUZZ_EXAMPLES=10000 pytest tests/test_fuzz_query.py -q    # or: pytest --long
"""
from __future__ import annotations

import json
import operator
import random
import re

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kb.errors import QueryError
from kb.query import MAX_SORT_KEYS, evaluate, parse
from tests.fuzzing import examples

FUZZ = dict(deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                   HealthCheck.data_too_large])

# ---- the runs: edge values under odd keys, none of them a name the vocabulary knows -------------

VALUES = [0, 1, -1, 2, 2.5, -0.0, 1e-3, 3e-4, 2**53, 2**53 + 1, 2**63 - 1, -2**63, 1e300, -1e300, 5e-324,
          True, False, None, "", "a", "A", "b", "ab", "it's", 'q"', "a\\b", "\\", "é", "ß", "☃", "10", "NaN",
          " a", "a ", "'", "Ω≈ç"]
CONFIG_PATHS = [("a",), ("b",), ("opt", "rate"), ("opt", "kind"), ("a.b",), ("sp ace",), ('q"',), ("",), ("ü",),
                ("nest", "x", "y"), ("flag",)]
SUMMARY_KEYS = ["m1", "m 2", "x/y"]
COLUMNS = ("id", "project", "name", "status")          # the run columns these records set
TAGS = ["baseline", "x", "Baseline", "ablation:norm"]


def make_records(seed: int = 7, n: int = 14) -> list[dict]:
    rnd = random.Random(seed)
    records = []
    for i in range(n):
        config: dict = {}
        for path in rnd.sample(CONFIG_PATHS, rnd.randint(2, len(CONFIG_PATHS))):
            node = config
            for seg in path[:-1]:
                node = node.setdefault(seg, {})
            node[path[-1]] = rnd.choice(VALUES)
        if rnd.random() < 0.4:
            config["list"] = [rnd.choice(VALUES) for _ in range(rnd.randint(0, 3))]
        if rnd.random() < 0.2:
            config["empty"] = rnd.choice([{}, []])
        records.append({
            "id": f"run-{i:02d}", "project": rnd.choice(["a", "b", "B"]), "name": rnd.choice(["x", "it's", "Z", "é"]),
            "status": rnd.choice(["completed", "failed", "diverged"]), "config": config,
            "summary": {k: rnd.choice([v for v in VALUES if not isinstance(v, (str, bool)) and v is not None])
                        for k in rnd.sample(SUMMARY_KEYS, rnd.randint(0, 3))},
            "tags": rnd.sample(TAGS, rnd.randint(0, 3)),
        })
    return records


RECORDS = make_records()
IDS = sorted(r["id"] for r in RECORDS)
def fields(record: dict) -> dict:
    """A record as queries see it: tags are a set, `tags.<tag>` (true when the run has it)."""
    return {**record, "tags": {t: True for t in record["tags"]}}


@pytest.fixture
def store(kb, tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    report = kb.ingest(path, index=False)
    assert report.added == len(RECORDS) and not report.failed, report.failed
    for r in RECORDS:                      # what the reference reads is what was stored
        got = kb.run(r["id"])
        assert (got.config, got.summary, got.tags, got.project, got.name, got.status) == \
            (r["config"], r["summary"], r["tags"], r["project"], r["name"], r["status"])
    return kb


# ---- the reference: a run's fields, typed comparisons, two-valued logic --------------------------

MISSING = object()
OPS = {"=": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
       ">=": operator.ge}


def value_at(run: dict, key: tuple):
    if key[0] in COLUMNS:
        return run[key[0]] if len(key) == 1 else MISSING
    node = run.get(key[0], MISSING)
    for seg in key[1:]:
        if isinstance(node, dict) and seg in node:
            node = node[seg]
        elif isinstance(node, list) and seg.isascii() and seg.isdigit() and seg == str(int(seg)) \
                and int(seg) < len(node):
            node = node[int(seg)]
        else:
            return MISSING
    return node


def has_leaf(v) -> bool:
    if isinstance(v, dict):
        return any(has_leaf(x) for x in v.values())
    if isinstance(v, list):
        return any(has_leaf(x) for x in v)
    return True


def holds(run: dict, key: tuple, op: str, lit) -> bool:
    v = value_at(run, key)
    if v is MISSING or isinstance(v, (dict, list)):
        return False
    if lit is None:
        return op == "=" and v is None
    if isinstance(lit, bool):
        return isinstance(v, bool) and OPS[op](v, lit)
    if isinstance(lit, str):
        return isinstance(v, str) and OPS[op](v, lit)
    return isinstance(v, (int, float)) and not isinstance(v, bool) and OPS[op](float(v), float(lit))


def reference(node, run: dict) -> bool:
    kind = node[0]
    if kind == "and":
        return all(reference(n, run) for n in node[1])
    if kind == "or":
        return any(reference(n, run) for n in node[1])
    if kind == "not":
        return not reference(node[1], run)
    if kind == "exists":
        v = value_at(run, node[1])
        return (v is not MISSING and has_leaf(v)) != node[2]
    if kind == "in":
        return any(holds(run, node[1], "=", lit) for lit in node[3]) != node[2]
    return holds(run, node[1], node[2], node[3])


def matching(node) -> list[str]:
    return sorted(r["id"] for r in RECORDS if reference(node, fields(r)))


# ---- queries from the grammar, spelled every way the language allows ------------------------------

BARE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_/\-]*")
KEY_POOL = sorted({("config",) + p[:i] for p in CONFIG_PATHS for i in range(1, len(p) + 1)}
                  | {("config", "list"), ("config", "list", "0"), ("config", "list", "2"), ("config", "empty"),
                     ("config", "nope"), ("config",), ("config", "a", "b"), ("summary",), ("tags",),
                     ("tags", "0"), ("tags", "nope")} | {("tags", t) for t in TAGS}
                  | {("summary", k) for k in SUMMARY_KEYS}) + [(c,) for c in COLUMNS]
LITERALS = st.one_of(st.sampled_from(VALUES), st.sampled_from(IDS + ["a", "b", "B", "x", "completed", "failed"]),
                     st.integers(-3, 3), st.floats(allow_nan=False, allow_infinity=False),
                     st.integers(-2**70, 2**70), st.text(st.characters(exclude_characters="\x00",
                                                                       exclude_categories=["Cs"]), max_size=4))
ORDERING = ["<", "<=", ">", ">="]


def held_at(key: tuple) -> list:
    """The values some run holds at key, so that comparisons often hit."""
    found = {repr(v): v for r in RECORDS if (v := value_at(fields(r), key)) is not MISSING
             and not isinstance(v, (dict, list))}
    return [found[k] for k in sorted(found)]


@st.composite
def predicates(draw):
    key = draw(st.sampled_from(KEY_POOL))
    held = held_at(key)
    literals = st.one_of(LITERALS, *[st.sampled_from(held)] * 2) if held else LITERALS
    kind = draw(st.sampled_from(["cmp", "cmp", "cmp", "in", "exists"]))
    if kind == "exists":
        return ("exists", key, draw(st.booleans()))
    if kind == "in":
        return ("in", key, draw(st.booleans()), tuple(draw(st.lists(literals, min_size=1, max_size=4))))
    lit = draw(literals)
    ops = ["=", "!="] + ([] if lit is None or isinstance(lit, bool) else ORDERING)
    return ("cmp", key, draw(st.sampled_from(ops)), lit)


expressions = st.recursive(
    predicates(),
    lambda inner: st.one_of(inner.map(lambda n: ("not", n)),
                            st.lists(inner, min_size=2, max_size=3).map(lambda xs: ("and", tuple(xs))),
                            st.lists(inner, min_size=2, max_size=3).map(lambda xs: ("or", tuple(xs)))),
    max_leaves=7)


def spell_key(key: tuple, rnd: random.Random) -> str:
    def seg(s: str) -> str:
        if BARE.fullmatch(s) and rnd.random() < 0.85:
            return s
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return ".".join(seg(s) for s in key)


def spell_literal(lit, rnd: random.Random) -> str:
    if lit is None or isinstance(lit, bool):
        word = {None: "null", True: "true", False: "false"}[lit]
        return rnd.choice([word, word.upper(), word.capitalize()])
    if isinstance(lit, str):
        out = []
        for i, c in enumerate(lit):
            if c == "'":
                out.append(rnd.choice(["''", "\\'"]))
            elif c == "\\":               # a backslash is itself unless a quote or backslash follows
                follows = lit[i + 1:i + 2]
                out.append("\\\\" if follows in ("'", "\\", "") or rnd.random() < 0.5 else "\\")
            else:
                out.append(c)
        return "'" + "".join(out) + "'"
    if isinstance(lit, int):
        return str(lit) if rnd.random() < 0.7 else f"{lit}e0"
    return repr(float(lit))


def spell(node, rnd: random.Random) -> str:
    def kw(word: str) -> str:
        return rnd.choice([word, word.upper(), word.capitalize()])

    def gap() -> str:
        return rnd.choice([" ", " ", "  ", "\t", "\n "])

    def operand(n) -> str:
        text = spell(n, rnd)
        return f"({text})" if n[0] in ("and", "or") or rnd.random() < 0.1 else text

    kind = node[0]
    if kind in ("and", "or"):
        return (gap() + kw(kind) + gap()).join(operand(n) for n in node[1])
    if kind == "not":
        return kw("not") + gap() + operand(node[1])
    key = spell_key(node[1], rnd)
    if kind == "exists":
        return key + gap() + (kw("not") + gap() if node[2] else "") + kw("exists")
    if kind == "in":
        items = ("," + gap()).join(spell_literal(v, rnd) for v in node[3])
        return f"{key}{gap()}{kw('not') + gap() if node[2] else ''}{kw('in')}{gap()}({items})"
    op = "==" if node[2] == "=" and rnd.random() < 0.2 else node[2]
    return key + rnd.choice(["", " "]) + op + rnd.choice(["", " "]) + spell_literal(node[3], rnd)


def run_query(kb, where, sort=None, limit=None) -> list[str] | None:
    """The ids the store returns, or None for a QueryError; anything else fails the test."""
    try:
        return [r.id for r in kb.runs(where=where, sort=sort, limit=limit)]
    except QueryError as exc:
        assert str(exc).strip(), where
        return None


@settings(max_examples=examples(200), **FUZZ)
@given(node=expressions, seed=st.integers(0, 2**32))
def test_queries_from_the_grammar_match_the_reference(store, node, seed):
    text = spell(node, random.Random(seed))
    assert sorted(run_query(store, text)) == matching(node), text


# ---- junk: valid queries with characters changed, and random text -----------------------------------

JUNK = list("()'\",.=!<>-+ \\eE0123456789_/") + ["\x00", "\ud800", "\udcff", "\u2028", "é", "\t", "and ", " or ",
                                                    "not ", " in ", " exists", "null", "true", "config.", "summary.",
                                                    "id", "1e999", "-", "''", '"', "((", "))"]
junk_piece = st.sampled_from(JUNK) | st.characters()


@st.composite
def mutated(draw):
    text = spell(draw(expressions), random.Random(draw(st.integers(0, 2**32))))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(text)))
        how = draw(st.sampled_from(["insert", "delete", "cut", "repeat"]))
        if how == "insert":
            text = text[:at] + draw(junk_piece) + text[at:]
        elif how == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 4)):]
        elif how == "cut":
            text = text[:at]
        else:
            text = text[:at] + text[max(0, at - 8):at] + text[at:]
    return text


def checkable(text: str):
    """The parsed query when the reference here can judge it: keys under config, summary, tags
    or the four columns these runs set (others, like ablations.*, are derived by ingest)."""
    node = parse(text)
    stack, keys = [node], []
    while stack:
        n = stack.pop()
        if hasattr(n, "items"):
            stack.extend(n.items)
        elif hasattr(n, "expr"):
            stack.append(n.expr)
        else:
            keys.append(n.key)
    return node if all(k[0] in ("config", "summary", "tags") + COLUMNS for k in keys) else None


@settings(max_examples=examples(250), **FUZZ)
@given(text=mutated() | st.lists(junk_piece, max_size=12).map("".join))
def test_junk_is_refused_or_answered_right(store, text):
    got = run_query(store, text)
    if not text:                              # no filter at all
        assert sorted(got) == IDS
        return
    if got is None:
        with pytest.raises(QueryError):       # refused by the parser itself, not by the database
            parse(text)
        return
    node = checkable(text)
    if node is not None:
        assert sorted(got) == sorted(r["id"] for r in RECORDS if evaluate(node, fields(r))), text


# ---- sort specs ----------------------------------------------------------------------------------------

class Desc:
    """A value that sorts the other way round."""

    def __init__(self, v):
        self.v = v

    def __lt__(self, other):
        return other.v < self.v

    def __eq__(self, other):
        return self.v == other.v


def sort_value(run: dict, key: tuple, desc: bool) -> tuple:
    """Numbers, then strings, then booleans (false < true); null, containers and missing last,
    in either direction."""
    v = value_at(run, key)
    if v is MISSING or v is None or isinstance(v, (dict, list)):
        return (1, 0, 0)
    rank, v = (2, int(v)) if isinstance(v, bool) else (1, v) if isinstance(v, str) else (0, float(v))
    return (0, rank, Desc(v) if desc else v)


def reference_order(keys: list[tuple[tuple, bool]], node=None) -> list[str]:
    runs = sorted((fields(r) for r in RECORDS if node is None or reference(node, fields(r))), key=lambda r: r["id"])
    for key, desc in reversed(keys):          # stable: earlier keys decide, ties fall to later ones, then id
        runs.sort(key=lambda r: sort_value(r, key, desc))
    return [r["id"] for r in runs]


@st.composite
def sorts(draw):
    keys = draw(st.lists(st.tuples(st.sampled_from(KEY_POOL), st.booleans()), min_size=1,
                         max_size=MAX_SORT_KEYS + 3))
    rnd = random.Random(draw(st.integers(0, 2**32)))
    spelled = []
    for key, desc in keys:
        name = spell_key(key, rnd)
        spelled.append(rnd.choice([f"-{name}", f"{name} desc", f"{name} DESC"]) if desc else
                       rnd.choice([name, f"{name} asc", f"{name} Asc"]))
    # a filter on the first key (its type pinned, or its index walked), with another, any filter, or none
    first = keys[0][0]
    held = [v for v in held_at(first) if v is not None and not isinstance(v, bool)]
    on_first = st.tuples(st.sampled_from(ORDERING), st.one_of(LITERALS, *[st.sampled_from(held)] * bool(held))) \
        .filter(lambda t: t[1] is not None and not isinstance(t[1], bool)).map(lambda t: ("cmp", first, *t))
    where = draw(st.one_of(st.none(), expressions, on_first,
                           st.tuples(on_first, predicates()).map(lambda t: ("and", t))))
    return keys, ("," + rnd.choice(["", " "])).join(spelled), where, draw(st.sampled_from([None, 1, 3]))


@settings(max_examples=examples(150), **FUZZ)
@given(case=sorts(), seed=st.integers(0, 2**32))
def test_sorts_match_the_reference(store, case, seed):
    keys, spec, node, limit = case
    where = None if node is None else spell(node, random.Random(seed))
    got = run_query(store, where, spec, limit)
    if len(keys) > MAX_SORT_KEYS:
        assert got is None, spec            # refused: more keys than a sorted join may take
        with pytest.raises(QueryError, match="sort keys"):
            store.runs(sort=spec)
        return
    want = reference_order(keys, node)
    assert got == (want if limit is None else want[:limit]), (where, spec, limit)
