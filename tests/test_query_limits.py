"""The query language at its limits (issue 7, findings 6 and 7), on SQLite and Postgres.

Big queries once ended in a database error (SQLite: `id in` 999 ids "Expression tree is too
large", an `and` of 64 keys "at most 64 tables in a join", ~1,000 `or` terms) or a segfault
(`--sort` with 21 keys: SQLite 3.40 crashes on a join ordered by 64 or more terms). Now the
realistic sizes work and every documented limit (kb.query: MAX_TERMS, MAX_SORT_KEYS,
MAX_CHARS, MAX_DEPTH) is refused as bad input, the same on both databases.

    KB_TEST_DATABASE_URL=postgresql://postgres@127.0.0.1/test pytest tests/test_query_limits.py -q
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sqlalchemy import select

from kb.errors import QueryError
from kb.models import Run
from kb.query import MAX_CHARS, MAX_DEPTH, MAX_SORT_KEYS, MAX_TERMS
from kb.query_sql import apply_query, compile_sort, compile_where, top_ids

KB = shutil.which("kb") or str(Path(sys.executable).parent / "kb")
N, KEYS = 24, 70          # runs r00..r23; config.k<j> = i + j, so `config.k<j> >= j + 5` means i >= 5


def record(i: int) -> dict:
    return {"id": f"r{i:02d}", "project": "p" if i % 2 else "q", "name": f"run {i}", "status": "completed",
            "config": {**{f"k{j}": i + j for j in range(KEYS)}, "group": i % 3, "word": f"w{i % 4}",
                       'q"uote': i, "it's": "a'b", "a.b": {"c": i}, "": i, "ключ": "значение",
                       "tiny": 5e-324 if i == 0 else 1.0, "big": 2**53 + 1 if i == 1 else 0},
            "summary": {"m": i / 10},
            "started_at": {0: "0001-01-01T00:00:00+00:00", 1: "9999-12-31T23:59:59+00:00"}.get(i, "2024-05-01T00:00:00")}


@pytest.fixture
def runs(kb, tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(record(i)) + "\n" for i in range(N)))
    report = kb.ingest(path, index=False)
    assert report.added == N and not report.failed, report.failed
    return kb


@pytest.fixture
def cli(runs, settings, database_url) -> dict:
    """The environment for `kb` in a subprocess, on the same store."""
    return dict(os.environ, KB_HOME=str(settings.home), KB_DATABASE_URL=database_url)


def kb_cli(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([KB, *args], capture_output=True, text=True, env=env, timeout=300)


def ids(kb, where=None, sort=None, limit=None) -> list[str]:
    return [r.id for r in kb.runs(where=where, sort=sort, limit=limit)]


def cli_ids(env, *args) -> list[str]:
    proc = kb_cli(env, "runs", *args, "--json")
    assert proc.returncode == 0, (args, proc.returncode, proc.stderr[-500:])
    return [r["id"] for r in json.loads(proc.stdout)]


def everyone(pred) -> set[str]:
    return {f"r{i:02d}" for i in range(N) if pred(i)}


# ---- finding 6: big queries work -------------------------------------------------------------

def test_in_list_of_999_ids(runs):
    listed = [f"r{i:02d}" for i in range(0, N, 2)] + [f"x{i}" for i in range(999 - len(range(0, N, 2)))]
    where = f"id in ({', '.join(repr(i) for i in listed)})"
    assert set(ids(runs, where)) == everyone(lambda i: i % 2 == 0)
    assert set(ids(runs, f"not {where}")) == everyone(lambda i: i % 2)
    assert ids(runs, where, sort="-config.k0", limit=2) == ["r22", "r20"]
    # a column `in` mixing types: only the column's type can match
    assert ids(runs, "id in (1, true, null, 'r03')") == ["r03"]


def test_and_of_64_distinct_keys(runs):
    where = " and ".join(f"config.k{j} >= {j + 5}" for j in range(64))
    assert set(ids(runs, where)) == everyone(lambda i: i >= 5)
    assert ids(runs, where, sort="config.k3", limit=3) == ["r05", "r06", "r07"]
    assert ids(runs, where + " and config.k69 < 80 and project = 'p'", sort="-config.k1") == ["r09", "r07", "r05"]
    # past the joined keys, tests on one key still meet on its one row
    where = " and ".join(f"config.k{j} >= {j + 5}" for j in range(20)) + " and config.k19 <= 30 and config.k19 != 25"
    assert set(ids(runs, where)) == everyone(lambda i: 5 <= i <= 11 and i != 6)


def test_and_of_many_exists_and_keys_no_run_has(runs):
    assert len(ids(runs, " and ".join(f"config.k{j} exists" for j in range(KEYS)))) == N
    assert ids(runs, " and ".join(f"config.nope{j} exists" for j in range(300))) == []
    assert len(ids(runs, " and ".join(f"not config.nope{j} exists" for j in range(300)))) == N


def test_compile_where_takes_big_queries_too(runs):
    """`kb search --where` filters through compile_where, without the joined plan."""
    def where(q):
        with runs.engine.connect() as conn:
            return set(conn.execute(select(Run.id).where(compile_where(q))).scalars())
    assert where(" and ".join(f"config.k{j} exists" for j in range(KEYS)) + " and config.k3 > 10") == \
        everyone(lambda i: i > 7)
    assert where(" and ".join(f"config.k{j} >= {j + 5}" for j in range(64))) == everyone(lambda i: i >= 5)
    assert where(f"id in ({', '.join(repr(f'r{i:02d}') for i in range(999))})") == everyone(lambda i: True)
    assert where(" or ".join(f"config.k{j % KEYS} = {j % KEYS + j // KEYS}" for j in range(1000))) == \
        everyone(lambda i: i <= 14)


def test_or_of_1000_terms(runs):
    # config.k<j%70> = j%70 + j//70 holds for run i = j//70: runs 0..14 across 1,000 terms
    where = " or ".join(f"config.k{j % KEYS} = {j % KEYS + j // KEYS}" for j in range(1000))
    assert set(ids(runs, where)) == everyone(lambda i: i <= 14)
    assert set(ids(runs, f"status = 'completed' and ({where})")) == everyone(lambda i: i <= 14)


def test_2000_terms_work_and_one_more_is_refused(runs):
    terms = [f"config.k{j % KEYS} != {-1 - j}" for j in range(MAX_TERMS - 2)]      # true of every run
    assert ids(runs, " and ".join(terms + ["config.k0 in (3, 4)"])) == ["r03", "r04"]    # 2,000: an in value is one
    assert len(ids(runs, " and ".join(terms + ["config.k0 exists"]))) == N
    with pytest.raises(QueryError, match="more than 2,000 terms"):
        runs.runs(where=" and ".join(terms + ["config.k0 in (3, 4, 5)"]))
    with pytest.raises(QueryError, match="more than 2,000 terms"):
        runs.runs(where=f"id in ({', '.join(['1'] * (MAX_TERMS + 1))})")


@pytest.mark.slow
def test_sort_by_16_keys(cli):
    """In a subprocess: a sort SQLite cannot take would crash it (finding 7), not fail."""
    spec = "config.group, -config.k0, " + ", ".join(f"config.k{j} desc" for j in range(1, MAX_SORT_KEYS - 1))
    want = sorted((f"r{i:02d}" for i in range(N)), key=lambda r: (int(r[1:]) % 3, -int(r[1:])))
    assert cli_ids(cli, "--sort", spec) == want
    assert cli_ids(cli, "--where", "config.k1 > 3", "--sort", spec, "--limit", "4") == \
        [r for r in want if int(r[1:]) >= 3][:4]
    assert cli_ids(cli, "--where", "config.k1 > 3 and config.word = 'w1'", "--sort", spec, "--limit", "2") == \
        ["r21", "r09"]


@pytest.mark.parametrize("n", [MAX_SORT_KEYS + 1, 21, 64])
def test_more_sort_keys_are_refused(n):
    """Refused while the SQL is built (no database needed: running it could crash SQLite)."""
    spec = ", ".join(f"config.k{j}" for j in range(n))
    for build in (lambda: compile_sort(spec), lambda: apply_query(select(Run.id), "config.k0 > 1", spec),
                  lambda: top_ids("config.k0 > 1", spec, 3)):
        with pytest.raises(QueryError, match=f"more than {MAX_SORT_KEYS} sort keys"):
            build()


# ---- what else a query can hold ---------------------------------------------------------------

@pytest.mark.parametrize("where, want", [
    ('config."q\\"uote" = 3', {"r03"}),
    ("config.\"it's\" = 'a''b'", set(range(N))),
    ("config.\"it's\" = 'a\\'b'", set(range(N))),
    ('config."a.b".c = 7', {"r07"}),
    ('config."a.b" exists and not config.a exists', set(range(N))),
    ('config."" = 4', {"r04"}),
    ("config.\"ключ\" = 'значение'", set(range(N))),
    ("config.tiny < 1e-300", {"r00"}),                       # a subnormal double, both databases
    ("config.tiny = 5e-324", {"r00"}),
    ("config.big = 9007199254740993", {"r01"}),              # compared as doubles: 2**53 + 1 is 2**53
    ("config.big > " + "9" * 300, set()),                    # a 300-digit integer is a finite double
    ("config.k0 > -" + "9" * 300, set(range(N))),
    ("config.k0 > 1e308 or config.k0 < -1.7976931348623157e308", set()),
    ("config.k0 = 1e-400", {"r00"}),                         # underflows to 0
    ("started_at < '0002-01-01'", {0}),                      # times at the calendar's edges
    ("started_at >= '9999-12-31T23:59:59'", {1}),
    ("started_at = '9999-12-31T18:59:59-05:00'", {1}),
    ("started_at = '0001-01-01T00:30:00+00:30'", {0}),
    ("started_at > '9999-12-31T23:59:59-05:00'", "within years 1-9999 in UTC"),
    ("started_at in ('2024-05-01', '0001-01-01T00:00:00+01:00')", "within years 1-9999 in UTC"),
    ("CONFIG.k0 = 1", "unknown key 'CONFIG'"),
    ("config.k0 = 1e999", "number out of range"),
    ("config.k0 = " + "9" * 400, "number out of range"),
    ("config.k0 = 'a\x00b'", "NUL character"),
    ('config."a\x00" exists', "NUL character"),
    ("config.k0 = '\ud800'", "lone surrogate (U+D800)"),
    ("config.k0 = '\udcff'", "invalid UTF-8 (byte 0xff)"),  # how Python passes on an argument's bad bytes
    ("(" * (MAX_DEPTH + 1) + "config.k0 = 1" + ")" * (MAX_DEPTH + 1), f"nests deeper than {MAX_DEPTH}"),
    ("not " * (MAX_DEPTH + 1) + "config.k0 = 1", f"nests deeper than {MAX_DEPTH}"),
    ("not " * 20_000 + "config.k0 = 1", "nests deeper"),
    ("config.k0 = '" + "x" * MAX_CHARS + "'", "at most 100,000"),
])
def test_odd_queries_work_or_are_refused(runs, where, want):
    if isinstance(want, str):
        with pytest.raises(QueryError, match=re.escape(want)):
            runs.runs(where=where)
    else:
        assert set(ids(runs, where)) == {i if isinstance(i, str) else f"r{i:02d}" for i in want}


def test_deepest_nesting_allowed_works(runs):
    where = "(" * (MAX_DEPTH - 1) + "not " + "config.k0 = 1" + ")" * (MAX_DEPTH - 1)
    assert len(ids(runs, where)) == N - 1


def test_long_strings_and_errors_in_long_queries(runs):
    long = "x" * 40_000
    assert ids(runs, f"config.word = '{long}' or config.word < '{long}'") == ids(runs)   # 'w..' < 'x...'
    prefix = " and ".join(["config.k0 = 1"] * 1000)
    with pytest.raises(QueryError) as err:
        runs.runs(where=prefix + " and bogus = 1")
    first, excerpt, caret = str(err.value).splitlines()
    assert first.startswith("unknown key 'bogus'") and f"column {len(prefix) + 6}" in first
    assert len(excerpt) < 100 and excerpt[caret.index("^"):].startswith("bogus")   # a window, caret on it


# ---- through the command line: exit codes, one line, never a crash ----------------------------

@pytest.mark.slow
def test_cli_big_queries_and_the_sort_that_crashed_sqlite(cli):
    """A subprocess each, so a segfault (SQLite on a join ordered by 64+ terms) fails the test."""
    ok = [
        ("--where", "id in (" + ", ".join(f"'r{i:02d}'" for i in range(999)) + ")"),
        ("--where", " and ".join(f"config.k{j} >= {j + 5}" for j in range(64))),
        ("--where", " or ".join(f"config.k{j % KEYS} = {j}" for j in range(1000))),
        # the largest sort a query may ask for, every key of mixed type: 3 ORDER BY terms each
        ("--where", "config.k0 >= 0", "--sort", ", ".join(f"-config.k{j}" for j in range(MAX_SORT_KEYS)),
         "--limit", "3"),
        ("--sort", "config.word, " + ", ".join(f"config.k{j}" for j in range(MAX_SORT_KEYS - 1))),
    ]
    for args in ok:
        proc = kb_cli(cli, "runs", *args, "--json")
        assert proc.returncode == 0, (args[:2], proc.returncode, proc.stderr[-500:])
        assert json.loads(proc.stdout)
    refused = [
        (("--sort", ", ".join(f"config.k{j}" for j in range(21))), "more than 16 sort keys"),
        (("--sort", ", ".join(f"config.k{j}" for j in range(64))), "more than 16 sort keys"),
        (("--where", " or ".join(f"config.k{j % KEYS} = {j}" for j in range(2001))), "more than 2,000 terms"),
        (("--where", "config.k0 = 1e999"), "number out of range"),
    ]
    for args, words in refused:
        proc = kb_cli(cli, "runs", *args)
        assert proc.returncode == 2, (args[:2], proc.returncode, proc.stderr[-500:])
        first = proc.stderr.splitlines()[0]
        assert first.startswith("error: ") and words in first and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_cli_refuses_a_bad_query_before_opening_the_store(tmp_path):
    env = dict(os.environ, KB_HOME=str(tmp_path / "home"))
    env.pop("KB_DATABASE_URL", None)
    for args, words in [(("runs", "--where", "config.x =", "--project", "p"), "at column 11"),
                        (("runs", "--sort", ", ".join(["config.x"] * 17)), "more than 16 sort keys"),
                        (("search", "loss", "--where", "config.x = 1e999"), "number out of range"),
                        (("runs", "--limit", str(2**63)), "--limit")]:
        proc = kb_cli(env, *args)
        assert proc.returncode == 2 and words in proc.stderr.splitlines()[0], (args, proc.stderr)
        assert not (tmp_path / "home").exists()
