"""Two `kb serve` replicas behind one database answer alike: runs written through either are
listed, shown and answered the same by both, on SQLite and on Postgres.

A team runs the replicas against a Qdrant server; none can run here, so the two share one
KB_HOME and its embedded index (one holds it and indexes what both queue; the other searches a
copy of it), which is the closest this machine gets. The Qdrant-server client path itself is
tested in tests/test_vectors.py.

    pytest tests/test_replicas.py -q
"""
from __future__ import annotations

import os

import httpx
import pytest

from tests.test_concurrency_ways import start_server

QUESTIONS = ("Which run had the lowest val/loss?", "How many runs diverged?",
             "Which learning rate gave the lowest val/loss?")


def record(replica: str, i: int) -> dict:
    lr = (1e-4, 3e-4, 1e-3, 3e-3)[i % 4]
    final = round(3.2 - 0.05 * (i % 4) + 0.01 * i, 4)
    curve = [[0, 9.0], [100, final]] if lr < 3e-3 else [[0, 9.0], [50, "NaN"]]
    return {"id": f"{replica}-{i:02d}", "project": "replicas", "config": {"optim": {"lr": lr}, "seed": i},
            "metrics": {"val/loss": curve}}


@pytest.mark.slow
def test_two_replicas_answer_alike(tmp_path, database_url, engine):
    env = dict(os.environ, KB_HOME=str(tmp_path / "home"), KB_DATABASE_URL=database_url, HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS="1")
    env.pop("KB_API_TOKENS", None)
    servers = []
    try:
        for _ in range(2):
            servers.append(start_server(env))
        urls = [url for _, url in servers]
        for name, url in zip("ab", urls):
            posted = httpx.post(f"{url}/api/runs", json=[record(name, i) for i in range(12)], timeout=120)
            assert posted.status_code == 201, posted.text
            assert posted.json()["added"] == 12

        def view(url: str) -> dict:
            listed = httpx.get(f"{url}/api/runs", params={"project": "replicas", "sort": "summary.val/loss"},
                               timeout=60).json()
            shown = {r["id"]: httpx.get(f"{url}/api/runs/{r['id']}", params={"points": "true"}, timeout=60).json()
                     for r in listed}
            for s in shown.values():
                s.pop("ingested_at", None)
            answers = [httpx.post(f"{url}/api/ask", json={"question": q}, timeout=300).json() for q in QUESTIONS]
            return {"listed": [r["id"] for r in listed], "shown": shown, "answers": answers}

        first, second = view(urls[0]), view(urls[1])
        assert len(first["listed"]) == 24
        assert first == second
        assert any(a["citations"] and a["sql"] for a in first["answers"]), first["answers"]
    finally:
        for server, _ in servers:
            server.terminate()
            server.wait(timeout=60)
