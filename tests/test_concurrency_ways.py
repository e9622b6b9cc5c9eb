"""Eight writers at once through every way in, into one project, on SQLite and Postgres: two
`kb ingest` processes, two processes tracking runs with the Python hook (`k.track`), two clients
POSTing to /api/runs and two scripts logging through MLflow's own client to the
MLflow-compatible endpoint, the last four against one real `kb serve`. The run count is exact,
no run is stored twice, the project's ablations equal a recomputation from scratch, and no
client saw a 5xx or a traceback.

    pytest tests/test_concurrency_ways.py -q
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from tests.test_concurrency import ablation_state, recomputed

KB = str(Path(sys.executable).parent / "kb")
PER_WRITER = 24
PROJECT = "ways"
WIDTHS, LRS = (256, 512), (1e-4, 3e-4, 1e-3)


def config(i: int) -> dict:
    """Writer-independent configurations, so runs of every way in share ablations."""
    return {"model": {"d_model": WIDTHS[i % 2]}, "optim": {"lr": LRS[(i // 2) % 3]}, "seed": i // 6}


def loss(i: int) -> float:
    return round(3.0 + 0.1 * (i % 2) - 0.05 * ((i // 2) % 3) + 0.01 * (i // 6), 4)


def native(way: str, i: int) -> dict:
    return {"id": f"{way}-{i:03d}", "project": PROJECT, "config": config(i),
            "metrics": {"val/loss": [[0, 9.0], [100, loss(i)]]}}


TRACK = """
import json, sys
from kb.api import KnowledgeBase
way, n = sys.argv[1], int(sys.argv[2])
k = KnowledgeBase.open()
configs = json.loads(sys.argv[3])
for i in range(n):
    with k.track(project="ways", config=configs[i], name=f"{way}-{i:03d}") as run:
        run.log({"val/loss": 9.0}, step=0)
        run.log({"val/loss": configs[i]["_loss"]}, step=100)
k.close()
"""

MLFLOW = """
import json, sys
import mlflow
way, n = sys.argv[1], int(sys.argv[2])
configs = json.loads(sys.argv[3])
mlflow.set_experiment("ways")          # the test made it: see test_eight_writers_through_four_ways_in
for i in range(n):
    with mlflow.start_run(run_name=f"{way}-{i:03d}"):
        c = configs[i]
        mlflow.log_params({"model.d_model": c["model"]["d_model"], "optim.lr": c["optim"]["lr"], "seed": c["seed"]})
        mlflow.log_metric("val/loss", 9.0, step=0)
        mlflow.log_metric("val/loss", c["_loss"], step=100)
"""


def start_server(env: dict) -> tuple[subprocess.Popen, str]:
    server = subprocess.Popen([KB, "serve", "--port", "0", "--no-ui"], env=env, stderr=subprocess.PIPE, text=True)
    url = re.search(r"http://127\.0\.0\.1:\d+", server.stderr.readline()).group(0)
    for _ in range(600):
        try:
            httpx.get(f"{url}/api/runs", params={"limit": 1}, timeout=5).raise_for_status()
            return server, url
        except httpx.TransportError:
            assert server.poll() is None, server.stderr.read()
            import time
            time.sleep(0.1)
    raise AssertionError("kb serve did not come up")


@pytest.mark.slow
def test_eight_writers_through_four_ways_in(tmp_path, database_url, engine):
    env = dict(os.environ, KB_HOME=str(tmp_path / "home"), KB_DATABASE_URL=database_url, HF_HUB_OFFLINE="1",
               MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", OMP_NUM_THREADS="1")
    env.pop("KB_API_TOKENS", None)
    offsets = {way: k * PER_WRITER for k, way in enumerate(
        ["ingest0", "ingest1", "track0", "track1", "post0", "post1", "mlflow0", "mlflow1"])}

    def configs(way):
        return json.dumps([config(offsets[way] + i) | {"_loss": loss(offsets[way] + i)} for i in range(PER_WRITER)])

    server, url = start_server(env)
    try:
        # made before the writers start: MLflow's own client, when two processes create an
        # experiment at once, takes the loser's RESOURCE_ALREADY_EXISTS without making the
        # experiment active (mlflow.tracking.fluent.set_experiment), and that process then logs
        # into "Default" - against MLflow's server as against this one
        httpx.post(f"{url}/api/2.0/mlflow/experiments/create", json={"name": PROJECT}).raise_for_status()
        procs = {}
        for way in ("ingest0", "ingest1"):
            path = tmp_path / f"{way}.jsonl"
            path.write_text("".join(json.dumps(native(way, offsets[way] + i)) + "\n" for i in range(PER_WRITER)))
            procs[way] = subprocess.Popen([KB, "ingest", str(path), "--no-index", "--json"], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for way in ("track0", "track1"):
            procs[way] = subprocess.Popen([sys.executable, "-c", TRACK, way, str(PER_WRITER), configs(way)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for way in ("mlflow0", "mlflow1"):
            procs[way] = subprocess.Popen([sys.executable, "-c", MLFLOW, way, str(PER_WRITER), configs(way)],
                                          env=env | {"MLFLOW_TRACKING_URI": url}, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True)

        def post(way: str) -> list[int]:
            with httpx.Client(base_url=url, timeout=120) as client:
                return [client.post("/api/runs", json=native(way, offsets[way] + i)).status_code
                        for i in range(PER_WRITER)]
        with ThreadPoolExecutor(2) as pool:
            statuses = list(pool.map(post, ["post0", "post1"]))
        outs = {way: p.communicate(timeout=900) for way, p in procs.items()}
    finally:
        server.terminate()
        server_err = server.communicate(timeout=120)[1]
    assert all(s in (200, 201) for codes in statuses for s in codes), statuses
    for way, p in procs.items():
        assert p.returncode == 0, (way, outs[way][1][-2000:])
        assert "Traceback" not in outs[way][1], (way, outs[way][1][-2000:])
    assert "Traceback" not in server_err and " 500 " not in server_err, server_err[-2000:]

    from kb.models import Run
    with engine.connect() as conn:
        total = conn.execute(select(func.count()).select_from(Run).where(Run.project == PROJECT)).scalar_one()
        names = conn.execute(select(Run.name, Run.id).where(Run.project == PROJECT)).all()
    per_way = {way: sum(1 for name, rid in names if (name or "").startswith(way) or rid.startswith(way))
               for way in offsets}
    assert total == 8 * PER_WRITER, str(per_way)
    ids = [rid for _, rid in names]
    assert len(set(ids)) == len(ids)
    for way in ("track0", "track1", "mlflow0", "mlflow1"):      # hooks name their runs; one each
        assert sum(1 for name, _ in names if name and name.startswith(way)) == PER_WRITER, way
    stored = ablation_state(engine, PROJECT)
    assert stored["ablations"], "the runs of the four ways should form ablations together"
    assert stored == recomputed(engine, PROJECT)
