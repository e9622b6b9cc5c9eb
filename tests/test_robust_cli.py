"""The CLI's error discipline, through the real `kb` console script: every failure exits 2 (bad input
or usage) or 1 (runtime) with one line on stderr, a traceback only with --verbose. Also arguments
that are not UTF-8 (finding 11), a damaged vector index (finding 9) and a read-only knowledge base
(finding 10: a shared, mounted KB_HOME, made read-only for real, see `read_only`)."""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

KB = shutil.which("kb") or str(Path(sys.executable).parent / "kb")
RUNS = [
    {"id": "lr-3e-3", "project": "p", "name": "lr 3e-3", "status": "diverged", "config": {"optim": {"lr": 3e-3}},
     "metrics": {"train/loss": [[0, 10.0], [100, 6.0], [200, "NaN"]]}, "notes": "loss exploded to NaN after warmup"},
    {"id": "lr-3e-4", "project": "p", "name": "lr 3e-4", "config": {"optim": {"lr": 3e-4}},
     "metrics": {"train/loss": [[0, 10.0], [100, 5.0], [200, 4.0]]}, "notes": "stable baseline, smooth curve"},
]


def kb_cli(env, *args, prefix=(), timeout=300):
    return subprocess.run([*prefix, KB, *args], capture_output=True, env=env, timeout=timeout)


def err_lines(proc) -> list[str]:
    return proc.stderr.decode("utf-8", "replace").splitlines()


def assert_fails(proc, code: int, *words: str):
    """Exit `code`, exactly one line on stderr, no traceback, and the line says what went wrong."""
    lines = err_lines(proc)
    assert proc.returncode == code, (proc.returncode, lines)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.fixture
def env(tmp_path, database_url):
    """SQLite in KB_HOME itself (the embedded default), so a read-only home holds the database too."""
    e = dict(os.environ, KB_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1")
    e.pop("KB_DATABASE_URL", None)
    if not database_url.startswith("sqlite"):
        e["KB_DATABASE_URL"] = database_url
    return e


@pytest.fixture
def runs_file(tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RUNS))
    return path


# ---- usage and bad input: exit 2 ------------------------------------------------------------

NOT_UTF8 = b"\xff\xfebad"


@pytest.mark.parametrize("args", [
    [b"show", NOT_UTF8],
    [b"runs", b"--where", b"name = '" + NOT_UTF8 + b"'"],
    [b"runs", b"--sort", NOT_UTF8],
    [b"ingest", NOT_UTF8],
    [b"ingest", b"x.jsonl", b"--project", NOT_UTF8],
    [b"search", NOT_UTF8],
    [b"search", b"loss", b"--where", NOT_UTF8],
    [b"ask", NOT_UTF8],
    [b"--home", NOT_UTF8, b"runs"],
    [b"track", b"--", b"echo", NOT_UTF8],
    [b"reindex", NOT_UTF8],
], ids=lambda a: " ".join(x.decode("utf-8", "replace") for x in a))
def test_arguments_that_are_not_utf8_are_refused_by_position(tmp_path, args):
    proc = subprocess.run([KB.encode(), *args], capture_output=True, timeout=60,
                          env=dict(os.environ, KB_HOME=str(tmp_path / "home")))
    position = next(i for i, a in enumerate(args, start=1) if NOT_UTF8 in a)
    assert_fails(proc, 2, f"argument {position} is not valid UTF-8", r"\xff\xfe")
    assert not (tmp_path / "home").exists()           # refused before anything was opened


def test_a_kb_setting_that_is_not_utf8_is_refused(tmp_path):
    env = {**os.environ, "KB_HOME": os.fsdecode(str(tmp_path).encode() + b"/\xff")}
    assert_fails(kb_cli(env, "runs"), 2, "KB_HOME is not valid UTF-8")


@pytest.mark.parametrize("args, words", [
    (["ingest"], ["Missing argument"]),
    (["ingest", "x.jsonl", "--format", "bogus"], ["unknown format 'bogus'"]),
    (["ingest", "x.jsonl", "--map", "nonsense"], ["--map", "COLUMN=KEY"]),
    (["runs", "--limit", "x"], ["--limit"]),
    (["runs", "--limit", "0"], ["--limit"]),
    (["runs", "--bogus"], ["No such option"]),
    (["search", "loss", "--limit", "-5"], ["--limit"]),
    (["search", "loss", "--kind", "table"], ["--kind"]),
    (["reindex", "extra"], ["unexpected extra argument"]),
    (["ask", "  "], ["question"]),
    (["track"], ["Missing argument"]),
    (["watch", "/nonexistent-folder"], ["does not exist"]),
    (["bogus"], ["No such command"]),
    (["--database-url", "bogus://x", "runs"], ["database URL", "bogus"]),
])
def test_usage_errors_exit_2_with_one_line(tmp_path, args, words):
    env = dict(os.environ, KB_HOME=str(tmp_path / "home"))
    assert_fails(kb_cli(env, *args), 2, *words)


@pytest.mark.slow
def test_bad_input_exits_2_with_one_line(env, tmp_path, runs_file):
    assert kb_cli(env, "ingest", str(runs_file), "--no-index").returncode == 0
    assert_fails(kb_cli(env, "show", "no-such-run"), 2, "no run 'no-such-run'")
    assert_fails(kb_cli(env, "ingest", str(tmp_path / "missing.jsonl")), 2, "missing.jsonl")
    assert_fails(kb_cli(env, "ingest", "/dev/null"), 2, "/dev/null")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(RUNS[0] | {"id": "other", "status": "exploded"}) + "\n")
    assert_fails(kb_cli(env, "ingest", str(bad), "--no-index"), 2, "bad.jsonl:1", "status")
    # a query error shows the query and a caret under the column below its one error line
    for args in (["runs", "--where", "((("], ["runs", "--sort", "nope"], ["search", "x", "--where", "lr >"]):
        proc = kb_cli(env, *args)
        lines = err_lines(proc)
        assert proc.returncode == 2 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr.decode()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any folder: unreadable folders cannot exist for it")
def test_unreadable_folder_is_an_input_error(env, tmp_path, runs_file):
    folder = tmp_path / "locked"
    folder.mkdir()
    shutil.copy(runs_file, folder / "runs.jsonl")
    folder.chmod(0)
    try:
        proc = kb_cli(env, "ingest", str(folder))
    finally:
        folder.chmod(0o755)
    assert proc.returncode == 2 and "locked" in proc.stderr.decode() and "Traceback" not in proc.stderr.decode()


# ---- runtime failures: exit 1 ---------------------------------------------------------------

@pytest.mark.slow
def test_runtime_failures_exit_1_with_one_line_and_a_traceback_only_with_verbose(tmp_path):
    env = dict(os.environ, KB_HOME=str(tmp_path / "home"),
               KB_DATABASE_URL="postgresql://nobody@127.0.0.1:1/none")       # nothing listens on port 1
    assert_fails(kb_cli(env, "runs"), 1, "database", "127.0.0.1")
    verbose = kb_cli(env, "--verbose", "runs")
    assert verbose.returncode == 1 and b"Traceback" in verbose.stderr
    assert err_lines(verbose)[-1].startswith("error: database")
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("")
    assert_fails(kb_cli(dict(os.environ, KB_HOME=str(a_file)), "runs"), 1, "not-a-folder")


@pytest.mark.slow
def test_damaged_index_cli(env, tmp_path, runs_file):
    """Finding 9 through the CLI: search exits 1 naming `kb reindex`; ingest commits and warns in one
    line (exit 0); reindex rebuilds; search works again."""
    assert kb_cli(env, "ingest", str(runs_file)).returncode == 0
    shard = Path(env["KB_HOME"]) / "qdrant" / "kb"
    for p in (shard / "segments").rglob("status.dat"):
        p.write_bytes(b"")                              # qdrant-edge panics in Rust on these
    assert_fails(kb_cli(env, "search", "NaN loss"), 1, "kb reindex")
    late = tmp_path / "late.jsonl"
    late.write_text(json.dumps({"id": "late", "project": "p", "config": {"optim": {"lr": 1e-3}},
                                "notes": "tokenizer bug"}) + "\n")
    proc = kb_cli(env, "ingest", str(late))
    lines = err_lines(proc)
    assert proc.returncode == 0 and len(lines) == 1 and lines[0].startswith("warning: ") and "kb reindex" in lines[0]
    assert json.loads(kb_cli(env, "show", "late", "--json").stdout)["id"] == "late"
    proc = kb_cli(env, "reindex", "--json")
    # the 3 runs, the diverged run's failure, and the lr ablation the late run joined
    assert proc.returncode == 0 and json.loads(proc.stdout) == {"indexed": 5}, proc.stderr
    hits = json.loads(kb_cli(env, "search", "tokenizer bug", "--json").stdout)
    assert hits[0]["id"] == "late" and len(hits) == 3


# ---- a read-only knowledge base (finding 10) -----------------------------------------------

def read_only(folder: Path):
    """How to run a command with `folder` read-only for real. Root ignores permission bits, so as
    root the folder is bind-mounted read-only over itself in a private mount namespace (what a
    shared knowledge base on a read-only mount is); otherwise the permission bits are cleared."""
    if os.geteuid() != 0:
        subprocess.run(["chmod", "-R", "a-w", str(folder)], check=True)
        return (), lambda: subprocess.run(["chmod", "-R", "u+w", str(folder)], check=True)
    probe = subprocess.run(["unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0"', str(folder)],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"running as root without mount namespaces: {probe.stderr.decode().strip()}")
    return ("unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0" && shift && exec "$@"',
            str(folder), "--"), lambda: None


@pytest.mark.slow
def test_read_only_home_serves_reads_and_refuses_writes(env, tmp_path, runs_file):
    home = Path(env["KB_HOME"])
    assert kb_cli(env, "ingest", str(runs_file)).returncode == 0
    before = json.loads(kb_cli(env, "show", "lr-3e-3", "--json", "--points").stdout)
    prefix, restore = read_only(home)
    try:
        proc = kb_cli(env, "runs", "--json", prefix=prefix)
        assert proc.returncode == 0, proc.stderr
        assert {r["id"] for r in json.loads(proc.stdout)} == {"lr-3e-3", "lr-3e-4"}
        proc = kb_cli(env, "show", "lr-3e-3", "--json", "--points", prefix=prefix)
        assert proc.returncode == 0 and json.loads(proc.stdout) == before, proc.stderr
        proc = kb_cli(env, "search", "which run blew up with NaN loss?", "--json", prefix=prefix)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)[0]["id"] == "lr-3e-3"
        late = tmp_path / "late.jsonl"
        late.write_text(json.dumps({"id": "late", "config": {"x": 1}}) + "\n")
        proc = kb_cli(env, "ingest", str(late), prefix=prefix)
        if "KB_DATABASE_URL" not in env:
            assert_fails(proc, 1, "read-only")
        else:        # SQL elsewhere takes the run; only the index, in the read-only home, waits
            assert proc.returncode == 0 and "read-only" in err_lines(proc)[0], proc.stderr
        assert_fails(kb_cli(env, "reindex", prefix=prefix), 1, "read-only")
    finally:
        restore()


@pytest.mark.slow
def test_read_only_sqlite_with_a_live_writer_reads_its_wal(env, runs_file, database_url):
    """A writer still has changes in kb.sqlite-wal (not checkpointed); a reader of the read-only
    folder sees them through the writer's -shm."""
    if not database_url.startswith("sqlite"):
        pytest.skip("a SQLite file's WAL")
    home = Path(env["KB_HOME"])
    assert kb_cli(env, "ingest", str(runs_file), "--no-index").returncode == 0
    writer = sqlite3.connect(home / "kb.sqlite")
    try:
        writer.execute("PRAGMA wal_autocheckpoint=0")
        writer.execute("UPDATE run SET name = 'renamed by the writer' WHERE id = 'lr-3e-4'")
        writer.commit()
        assert (home / "kb.sqlite-wal").stat().st_size > 0
        prefix, restore = read_only(home)
        try:
            proc = kb_cli(env, "show", "lr-3e-4", "--json", prefix=prefix)
        finally:
            restore()
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["name"] == "renamed by the writer"
    finally:
        writer.close()
