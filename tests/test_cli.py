"""The `kb` command through its real entry point (a subprocess of the installed console script)."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

KB = shutil.which("kb") or str(Path(sys.executable).parent / "kb")


def kb_cli(env, *args, check=True):
    proc = subprocess.run([KB, *args], capture_output=True, text=True, env=env, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"kb {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def env(tmp_path, database_url):
    e = dict(os.environ, KB_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1")
    e["KB_DATABASE_URL"] = database_url
    return e


def history(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        lr = rng.choice([1e-4, 3e-4, 6e-4, 1e-3, 2e-3, 3e-3])
        status = rng.choice(["completed"] * 8 + ["diverged", "failed"])
        rec = {"id": f"r{i:03d}", "project": rng.choice(["a", "b"]), "name": f"run-{i}", "status": status,
               "config": {"optim": {"lr": lr}, "model": {"n_layer": rng.choice([4, 8])}},
               "metrics": {"train/loss": [[s, 10.0 / (1 + s) + rng.random() * 0.01] for s in range(0, 50, 10)]}}
        if rng.random() < 0.1:
            del rec["config"]["optim"]            # some runs lack the key: they must not match
        out.append(rec)
    return out


def test_ingest_500_twice_then_query(env, tmp_path):
    records = history(500)
    path = tmp_path / "h.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    first = json.loads(kb_cli(env, "ingest", str(path), "--no-index", "--json").stdout)
    second = json.loads(kb_cli(env, "ingest", str(path), "--no-index", "--json").stdout)
    assert first == {"added": 500, "updated": 0, "unchanged": 0, "failed": [], "skipped": []}
    assert second == {"added": 0, "updated": 0, "unchanged": 500, "failed": [], "skipped": []}
    out = kb_cli(env, "runs", "--where", "config.optim.lr > 1e-3 or status = 'diverged'", "--json").stdout
    got = {r["id"] for r in json.loads(out)}
    want = {r["id"] for r in records
            if r["config"].get("optim", {}).get("lr", 0) > 1e-3 or r["status"] == "diverged"}
    assert got == want and 0 < len(got) < 500
    listed = json.loads(kb_cli(env, "runs", "--sort", "-config.optim.lr", "--limit", "3", "--json").stdout)
    assert [r["config"]["optim"]["lr"] for r in listed] == [3e-3] * 3
    assert set(listed[0]) >= {"id", "project", "name", "status", "config", "scale", "summary", "tags"}


def test_malformed_record_exits_2_and_names_file_line_field(env, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"id": "ok", "config": {"a": 1}}) + "\n"
                    + json.dumps({"id": "bad", "config": {"a": 1}, "scale": {"params": "lots"}}) + "\n")
    proc = kb_cli(env, "ingest", str(path), "--no-index", "--json", check=False)
    assert proc.returncode == 2
    report = json.loads(proc.stdout)
    assert report["added"] == 1 and report["failed"][0]["line"] == 2
    assert f"{path}:2: scale.params:" in proc.stderr
    shown = kb_cli(env, "show", "bad", check=False)
    assert shown.returncode == 2 and "no run 'bad'" in shown.stderr


def test_show_json_and_bad_query(env, tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"id": "x", "config": {"optim": {"lr": 3e-3}},
                                "metrics": {"train/loss": [[0, 9.0], [10, float("nan")]]}}) + "\n")
    kb_cli(env, "ingest", str(path), "--no-index")
    shown = json.loads(kb_cli(env, "show", "x", "--json", "--points").stdout)
    assert shown["status"] == "diverged" and shown["failures"][0]["kind"] == "diverged"
    assert shown["metrics"]["train/loss"] == [[0, 9.0], [10, "NaN"]]      # NaN kept apart from null
    bad = kb_cli(env, "runs", "--where", "config.optim.lr >", check=False)
    assert bad.returncode == 2 and "expected" in bad.stderr
    unknown = kb_cli(env, "ingest", str(tmp_path / "missing.bin"), check=False)
    assert unknown.returncode == 2 and "missing.bin" in unknown.stderr


def test_help_is_quick_to_import():
    """`kb --help` must not import the heavy libraries (torch, sentence-transformers, mlflow)."""
    code = ("import sys; from kb.cli import main; main(['--help']); "
            "heavy = [m for m in ('torch', 'sentence_transformers', 'mlflow', 'sqlmodel', 'qdrant_client') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_a_walk_of_real_logs_accounts_for_every_file(env, tmp_path):
    """Real training logs (tests/data/logs) mixed with files that are not runs and one log that
    cannot be read: each file is added, failed or skipped, none disappears, projects come from
    the first folder level, and a failure makes the exit code 2."""
    root = tmp_path / "logs"
    shutil.copytree(Path(__file__).parent / "data" / "logs", root)
    (root / "loss.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 32)
    (root / "speedrun" / "ckpt.pt").write_bytes(b"\0" * 32)
    (root / "speedrun" / "slurm-41.out").write_text("srun: job 41 queued and waiting for resources\n")
    files = sorted(p for p in root.rglob("*") if p.is_file())
    proc = kb_cli(env, "ingest", str(root), "--no-index", "--json", check=False)
    assert proc.returncode == 2, proc.stderr
    report = json.loads(proc.stdout)
    assert [f["source"] for f in report["failed"]] == [str(root / "speedrun" / "slurm-41.out")]
    assert {s["source"]: s["reason"] for s in report["skipped"]} == {
        str(root / "loss.png"): "image", str(root / "speedrun" / "ckpt.pt"): "checkpoint or tensor file"}
    runs = json.loads(kb_cli(env, "runs", "--json").stdout)
    notes = 1                                       # the folder's README.md is a note
    read = {r["source"]["uri"] for r in runs}
    assert len(read) + notes + len(report["failed"]) + len(report["skipped"]) == len(files)
    assert report["added"] >= len(runs) + notes
    by_name = {r["name"]: r for r in runs}
    assert by_name["gpt2_medium"]["project"] == "gpt2_medium"              # llm.c main.log, named by its folder
    assert by_name["081087e4-affa-4df9-8b5e-b2aea5b5f688"]["project"] == "speedrun"
    assert by_name["nanogpt_shakespeare_char"]["project"] == "default"     # at the top: nothing to infer
    human = kb_cli(env, "ingest", str(root), "--no-index", check=False)
    assert "skipped 2 (not runs; --show-skipped lists them)" in human.stdout
    listed = kb_cli(env, "ingest", str(root), "--no-index", "--show-skipped", "--project", "p", check=False)
    assert f"skipped: {root / 'loss.png'}: image" in listed.stdout
    assert {r["project"] for r in json.loads(kb_cli(env, "runs", "--json").stdout)} == {"p"}   # --project wins
