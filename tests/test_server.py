"""`kb serve`: every REST endpoint through the ASGI app (httpx via Starlette's TestClient), bearer
tokens, MLflow's tracking endpoints, open MLflow runs surviving a restart, schemathesis against
/openapi.json with no 5xx, and the done-when: a real `kb serve` process that MLflow's own client
logs a run to, found afterwards by `kb runs --json`. SQLite, and Postgres when KB_TEST_DATABASE_URL
is set.

The agent runs with no language model (KB_LLM_BACKEND names none, so `ask` answers by
extraction, as it does wherever no model can run): the planner questions asked here need none,
and fuzzed questions must not wait seconds each for one.

    pytest tests/test_server.py -q
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update
from sqlmodel import Session

from kb.api import KnowledgeBase
from kb.server.app import create_app

KB = str(Path(sys.executable).parent / "kb")
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NO_LLM = "none-in-these-tests"      # an unknown backend: the agent answers by extraction
SPEC_REPORT = {"added", "updated", "unchanged", "failed", "skipped"}
SPEC_JOB = {"id", "hypothesis", "status", "backend", "attempts", "run", "error"}
SPEC_HYPOTHESIS = {"id", "title", "rationale", "baseline_run", "change", "evidence", "predicted", "risks",
                   "status", "result"}


@pytest.fixture
def server_settings(settings):
    return settings.model_copy(update={"llm_backend": NO_LLM, "index_sync_s": 0.2})


@pytest.fixture
def client(server_settings):
    """A server with no tokens set: every write is allowed (kb serve then listens on loopback only)."""
    with TestClient(create_app(server_settings)) as c:
        yield c


@pytest.fixture
def locked(server_settings):
    """A server with tokens: writes need one of them."""
    with TestClient(create_app(server_settings.model_copy(update={"api_tokens": f"other, {TOKEN}"}))) as c:
        yield c


def record(rid: str, lr: float, loss: float, project: str = "srv", status: str = "completed") -> dict:
    rec = {"id": rid, "project": project, "name": rid, "status": status,
           "config": {"model": {"n_layer": 4, "d_model": 256}, "optim": {"lr": lr, "warmup": 100}},
           "scale": {"params": 10_000_000},
           "metrics": {"val/loss": [[0, 10.0], [500, loss + 0.5], [1000, loss]]}}
    if status == "diverged":
        rec["metrics"] = {"val/loss": [[0, 10.0], [300, "NaN"]]}
        rec["failure"] = {"kind": "diverged", "step": 300, "message": "loss is NaN"}
    return rec


def lr_sweep() -> list[dict]:
    """val/loss a parabola in log10(lr) around 1e-3, two seeds a rate; 5e-3 diverged."""
    runs = []
    for lr in (1e-4, 2e-4, 4e-4):
        for seed, noise in ((0, 0.003), (1, -0.004)):
            loss = 3.0 + 0.25 * (math.log10(lr) + 3) ** 2 + noise
            rec = record(f"lr{lr:g}-s{seed}", lr, round(loss, 6))
            rec["config"]["seed"] = seed
            runs.append(rec)
    runs.append(record("div-lr0.005", 5e-3, 0, status="diverged"))
    return runs


def detail(response) -> str:
    body = response.json()
    assert set(body) == {"detail"} and "\n" not in body["detail"], body
    return body["detail"]


# ---- runs ------------------------------------------------------------------------------------------

def test_runs_are_posted_listed_and_read(client):
    first = client.post("/api/runs", json=record("r1", 3e-4, 3.2))
    assert first.status_code == 201 and first.headers["location"] == "/api/runs/r1"
    assert first.json() == {"added": 1, "updated": 0, "unchanged": 0, "failed": [], "skipped": []}
    again = client.post("/api/runs", json=record("r1", 3e-4, 3.2))
    assert again.status_code == 200 and again.json()["unchanged"] == 1
    many = client.post("/api/runs", json=[record("r2", 1e-3, 3.1), record("r3", 3e-3, 0, status="diverged"),
                                          {"config": {"a": 1}, "status": "exploded"}])
    assert many.status_code == 201 and set(many.json()) == SPEC_REPORT
    assert many.json()["added"] == 2 and [f["field"] for f in many.json()["failed"]] == ["status"]

    listed = client.get("/api/runs", params={"where": "config.optim.lr > 5e-4", "sort": "-config.optim.lr"})
    assert listed.status_code == 200
    assert [r["id"] for r in listed.json()] == ["r3", "r2"]
    assert {"id", "project", "name", "status", "config", "scale", "summary", "tags"} <= set(listed.json()[0])
    assert [r["id"] for r in client.get("/api/runs", params={"sort": "summary.val/loss", "limit": 1}).json()] == ["r2"]
    assert client.get("/api/runs", params={"project": "nope"}).json() == []

    shown = client.get("/api/runs/r3").json()
    assert shown["status"] == "diverged" and shown["failures"][0]["kind"] == "diverged"
    assert shown["metrics"]["val/loss"] == {"points": 2, "first": [0, 10.0], "last": [300, "NaN"]}
    every = client.get("/api/runs/r3", params={"points": "true"}).json()["metrics"]["val/loss"]
    assert every == [[0, 10.0], [300, "NaN"]]


def test_bad_input_is_4xx_with_one_line_naming_the_field(client):
    bad = client.post("/api/runs", json={"config": {"a": 1}, "metrics": {"loss": [[0, "high"]]}})
    assert bad.status_code == 400 and detail(bad).startswith("metrics.loss.0")
    assert "status" in detail(client.post("/api/runs", json=[{"config": {}, "status": "exploded"}]))
    assert client.post("/api/runs", json=[]).status_code == 400
    assert client.post("/api/runs", json="a string").status_code == 422
    not_json = client.post("/api/runs", content=b"{not json", headers={"content-type": "application/json"})
    assert not_json.status_code == 422
    assert detail(client.get("/api/runs", params={"where": "config.lr >> 3"})).startswith("where: expected a value")
    assert detail(client.get("/api/runs", params={"sort": "--lr"})).startswith("sort: expected a key")
    assert detail(client.get("/api/runs", params={"limit": 0})).startswith("query.limit: ")
    missing = client.get("/api/runs/no-such-run")
    assert missing.status_code == 404 and detail(missing) == "no run 'no-such-run'"
    assert detail(client.post("/api/ask", json={})) == "body.question: Field required"
    assert client.post("/api/ask", json={"question": "   "}).status_code == 422
    assert client.post("/api/ask", json={"question": "x", "typo": 1}).status_code == 422
    assert client.get("/no/such/route").status_code == 404


# ---- the agents, the human gate, jobs ----------------------------------------------------------------

def test_ask_answers_in_the_contract_shape_citing_records_that_exist(client):
    client.post("/api/runs", json=lr_sweep())
    got = client.post("/api/ask", json={"question": "Which run has the lowest val/loss in project srv?"})
    assert got.status_code == 200 and set(got.json()) == {"answer", "citations", "sql"}
    cited = [c["id"] for c in got.json()["citations"]]
    assert cited and all(set(c) == {"kind", "id", "quote"} for c in got.json()["citations"])
    assert cited[0] == "lr0.0004-s1"         # the lowest of the sweep: 3.0 + 0.25 * 0.398^2 - 0.004
    assert all(client.get(f"/api/runs/{i}").status_code == 200 for i in cited)
    assert got.json()["sql"].lstrip().upper().startswith("SELECT")


def test_propose_list_approve_and_reject_hypotheses(client):
    client.post("/api/runs", json=lr_sweep())
    proposed = client.post("/api/propose", json={"goal": "lower val/loss", "n": 2, "project": "srv"})
    assert proposed.status_code == 200, proposed.text
    found = proposed.json()
    assert found and all(SPEC_HYPOTHESIS <= set(h) and h["status"] == "proposed" for h in found)
    listed = client.get("/api/hypotheses", params={"status": "proposed"}).json()
    assert {h["id"] for h in listed} == {h["id"] for h in found}
    first = found[0]["id"]
    approved = client.post(f"/api/hypotheses/{first}/approve", json={"by": "alice", "reason": "cheap"})
    assert approved.status_code == 200 and approved.json()["status"] == "approved"
    assert approved.json()["decision"]["by"] == "alice"
    assert client.get(f"/api/hypotheses/{first}").json()["status"] == "approved"
    again = client.post(f"/api/hypotheses/{first}/approve", json={"by": "bob"})
    assert again.status_code == 400 and "already approved" in detail(again)
    assert client.post(f"/api/hypotheses/{first}/reject", json={"by": "bob"}).json()["status"] == "rejected"
    assert client.post("/api/hypotheses/hyp-nope/approve", json={"by": "carol"}).status_code == 404
    assert detail(client.post(f"/api/hypotheses/{first}/approve", json={})) == "body.by: Field required"
    assert client.post("/api/propose", json={"n": 0}).status_code == 422


def test_jobs_are_submitted_listed_read_and_cancelled(client):
    if not hasattr(KnowledgeBase, "submit"):
        pytest.skip("the runner's KnowledgeBase.submit (runner/queue.py) is not in this tree")
    queued = client.post("/api/jobs", json={"config": {"n_layer": 2, "max_steps": 10}, "seeds": 2,
                                            "project": "proxy-srv", "name": "tiny"})
    assert queued.status_code == 200, queued.text
    jobs = queued.json()
    assert len(jobs) == 2 and all(SPEC_JOB <= set(j) and j["status"] == "queued" for j in jobs)
    one = client.get(f"/api/jobs/{jobs[0]['id']}")
    assert one.status_code == 200 and one.json()["id"] == jobs[0]["id"]
    assert {j["id"] for j in client.get("/api/jobs", params={"status": "queued"}).json()} == {j["id"] for j in jobs}
    assert client.post(f"/api/jobs/{jobs[1]['id']}/cancel").json()["status"] == "cancelled"
    assert client.get("/api/jobs/job-nope").status_code == 404
    assert "unknown backend 'gpu-farm'" in detail(client.post("/api/jobs", json={"config": {}, "backend": "gpu-farm"}))
    assert "bogus: unknown option" in detail(client.post("/api/jobs", json={"config": {"bogus": 1}}))
    assert client.post("/api/jobs", json={}).status_code == 400          # neither a hypothesis nor a config
    assert client.post("/api/jobs", json={"hypothesis": "hyp-x", "project": "p"}).status_code == 422
    assert client.post("/api/jobs", json={"hypothesis": "hyp-nope"}).status_code == 404


# ---- tokens ----------------------------------------------------------------------------------------------

def test_writes_need_a_valid_token_when_tokens_are_set(locked):
    run = record("tok-1", 3e-4, 3.2)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        refused = locked.post("/api/runs", json=run, headers=headers)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        assert "token" in detail(refused)
    assert locked.get("/api/runs").json() == []           # nothing was written
    assert locked.post("/api/runs", json=run, headers=AUTH).status_code == 201
    assert locked.post("/api/runs", json=record("tok-2", 1e-3, 3.1),
                       headers={"Authorization": "Bearer other"}).status_code == 201
    assert [r["id"] for r in locked.get("/api/runs").json()] == ["tok-1", "tok-2"]      # reads need none
    assert locked.post("/api/hypotheses/hyp-x/approve", json={"by": "a"}).status_code == 401
    assert locked.post("/api/propose", json={}).status_code == 401
    assert locked.post("/api/jobs", json={"config": {}}).status_code == 401
    mlflow = locked.post("/api/2.0/mlflow/experiments/create", json={"name": "e"})
    assert mlflow.status_code == 401 and mlflow.json()["error_code"] == "UNAUTHENTICATED"
    assert locked.post("/api/2.0/mlflow/experiments/create", json={"name": "e"}, headers=AUTH).status_code == 200
    assert locked.post("/api/ask", json={"question": "how many runs in project default?"}).status_code == 200


# ---- MLflow's tracking API ---------------------------------------------------------------------------------

MLFLOW = "/api/2.0/mlflow"


def start_run(c, experiment: str, name: str = "r") -> str:
    exp = c.post(f"{MLFLOW}/experiments/create", json={"name": experiment}).json()["experiment_id"]
    return c.post(f"{MLFLOW}/runs/create", json={"experiment_id": exp, "run_name": name, "user_id": "alice",
                                                 "start_time": "1700000000000"}).json()["run"]["info"]["run_id"]


def test_mlflow_experiments_runs_and_their_errors(client, server_settings):
    missing = client.get(f"{MLFLOW}/experiments/get-by-name", params={"experiment_name": "e1"})
    assert missing.status_code == 404 and missing.json()["error_code"] == "RESOURCE_DOES_NOT_EXIST"
    created = client.post(f"{MLFLOW}/experiments/create", json={"name": "e1", "tags": [{"key": "team", "value": "a"}]})
    exp_id = created.json()["experiment_id"]
    exp = client.get(f"{MLFLOW}/experiments/get", params={"experiment_id": exp_id}).json()["experiment"]
    assert exp["name"] == "e1" and exp["tags"] == [{"key": "team", "value": "a"}]
    assert client.get(f"{MLFLOW}/experiments/get-by-name", params={"experiment_name": "e1"}).json()["experiment"] == exp
    dup = client.post(f"{MLFLOW}/experiments/create", json={"name": "e1"})
    assert dup.status_code == 400 and dup.json()["error_code"] == "RESOURCE_ALREADY_EXISTS"
    default = client.get(f"{MLFLOW}/experiments/get", params={"experiment_id": "0"}).json()["experiment"]
    assert default["name"] == "Default"
    assert client.get(f"{MLFLOW}/experiments/get", params={"experiment_id": "x"}).status_code == 404

    run = client.post(f"{MLFLOW}/runs/create", json={"experiment_id": exp_id, "run_name": "lr-3e-4",
                                                     "start_time": "1700000000000",
                                                     "tags": [{"key": "mlflow.source.name", "value": "train.py"}]})
    run_id = run.json()["run"]["info"]["run_id"]
    assert run.json()["run"]["info"]["status"] == "RUNNING"
    ok = client.post(f"{MLFLOW}/runs/log-batch", json={
        "run_id": run_id, "params": [{"key": "optim.lr", "value": "0.0003"}, {"key": "model.n_layer", "value": "4"}],
        "tags": [{"key": "baseline", "value": "true"}],
        "metrics": [{"key": "train/loss", "value": 9.0, "timestamp": "1700000000000", "step": "0"},
                    {"key": "train/loss", "value": 5.0, "timestamp": 1700000001000, "step": 100}]})
    assert ok.status_code == 200 and ok.json() == {}
    client.post(f"{MLFLOW}/runs/log-metric", json={"run_uuid": run_id, "key": "train/loss", "value": 4.0,
                                                   "timestamp": 1700000002000, "step": 200})
    client.post(f"{MLFLOW}/runs/log-metric", json={"run_id": run_id, "key": "grad_norm", "value": "NaN",
                                                   "timestamp": 1700000002000, "step": 200})
    client.post(f"{MLFLOW}/runs/log-parameter", json={"run_id": run_id, "key": "seed", "value": "7"})
    client.post(f"{MLFLOW}/runs/set-tag", json={"run_id": run_id, "key": "mlflow.note.content", "value": "first try"})
    changed = client.post(f"{MLFLOW}/runs/log-parameter", json={"run_id": run_id, "key": "seed", "value": "8"})
    assert changed.status_code == 400 and "params.seed" in changed.json()["message"]
    got = client.get(f"{MLFLOW}/runs/get", params={"run_id": run_id}).json()["run"]
    assert {m["key"]: m["value"] for m in got["data"]["metrics"]} == {"train/loss": 4.0, "grad_norm": "NaN"}
    assert {p["key"]: p["value"] for p in got["data"]["params"]} == {"optim.lr": "0.0003", "model.n_layer": "4",
                                                                     "seed": "7"}
    history = client.get(f"{MLFLOW}/metrics/get-history", params={"run_id": run_id, "metric_key": "train/loss"})
    assert [(m["step"], m["value"]) for m in history.json()["metrics"]] == [(0, 9.0), (100, 5.0), (200, 4.0)]
    assert client.get("/api/runs", params={"project": "e1"}).json() == []        # open: not a run yet

    ended = client.post(f"{MLFLOW}/runs/update", json={"run_id": run_id, "status": "FINISHED",
                                                       "end_time": 1700000003000})
    assert ended.json()["run_info"]["status"] == "FINISHED" and ended.json()["run_info"]["end_time"] == 1700000003000
    stored = client.get(f"/api/runs/{run_id}", params={"points": "true"}).json()
    assert stored["project"] == "e1" and stored["name"] == "lr-3e-4" and stored["status"] == "completed"
    assert stored["config"] == {"optim": {"lr": 3e-4}, "model": {"n_layer": 4}, "seed": 7}
    assert stored["metrics"]["train/loss"] == [[0, 9.0, 1700000000.0], [100, 5.0, 1700000001.0],
                                               [200, 4.0, 1700000002.0]]
    assert stored["metrics"]["grad_norm"] == [[200, "NaN", 1700000002.0]]
    assert stored["tags"] == ["baseline"] and stored["notes"] == "first try"
    assert stored["started_at"].startswith("2023-11-14T22:13:20")

    # written after it ended: the stored run follows
    client.post(f"{MLFLOW}/runs/log-metric", json={"run_id": run_id, "key": "val/loss", "value": 4.5,
                                                   "timestamp": 1700000004000, "step": 200})
    assert client.get(f"/api/runs/{run_id}").json()["summary"]["val/loss"] == 4.5

    for status, kb_status in (("FAILED", "failed"), ("KILLED", "killed")):
        other = start_run(client, f"e-{status}")
        client.post(f"{MLFLOW}/runs/update", json={"run_id": other, "status": status})
        died = client.get(f"/api/runs/{other}").json()
        # nothing logged: remembered by what ran, as `kb track` remembers a script that died on import
        assert died["status"] == kb_status and died["config"] == {"command": f"mlflow run {other}"}
    deep = client.post(f"{MLFLOW}/runs/log-parameter", json={"run_id": run_id, "key": "layers",
                                                             "value": "[" * 70 + "]" * 70})
    assert deep.status_code == 400 and "config.layers" in deep.json()["message"]
    nope = client.post(f"{MLFLOW}/runs/log-metric", json={"run_id": "0" * 32, "key": "x", "value": 1, "timestamp": 1})
    assert nope.status_code == 404 and nope.json()["error_code"] == "RESOURCE_DOES_NOT_EXIST"
    bad = client.post(f"{MLFLOW}/runs/update", json={"run_id": run_id, "status": "DONE"})
    assert bad.status_code == 400 and "status" in bad.json()["message"]
    assert client.post(f"{MLFLOW}/runs/log-metric", json={"run_id": run_id, "key": "x"}).status_code == 400


def test_concurrent_clients_log_without_errors(kb):
    """Trainings log at once (the server calls the live store from its thread pool): every call
    succeeds and every point and param is kept, on SQLite's one writer as on Postgres."""
    from concurrent.futures import ThreadPoolExecutor
    live = kb.mlflow_live()
    exp = live.create_experiment("together").id

    def train(i: int) -> str:
        run = live.create_run(exp, name=f"t{i}").id
        for step in range(15):
            live.log(run, metrics=[("loss", 1.0 / (step + 1), 1700000000000 + step, step)],
                     params={f"p{step}": str(i)}, tags={"step": str(step)})
        live.update(run, status="FINISHED")
        return run

    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(train, range(4)))
    for i, run_id in enumerate(runs):
        stored = kb.run(run_id)
        assert len(stored.metrics["loss"]) == 15 and stored.config == {f"p{step}": i for step in range(15)}


def test_open_runs_survive_the_server_and_an_end_it_missed_is_stored_on_start(server_settings):
    from kb.models import MlflowRun
    with TestClient(create_app(server_settings)) as first:
        open_id = start_run(first, "long", "still-open")
        lost_id = start_run(first, "lost", "ended-in-a-crash")
        for step in (0, 10):
            first.post(f"{MLFLOW}/runs/log-metric", json={"run_id": open_id, "key": "loss", "value": 5 - step / 10,
                                                          "timestamp": 1700000000000 + step, "step": step})
        first.post(f"{MLFLOW}/runs/log-metric", json={"run_id": lost_id, "key": "loss", "value": 2.0,
                                                      "timestamp": 1700000000000, "step": 0})
    # the server died after committing an end and before storing the run: the window, made by hand
    k = KnowledgeBase.open(server_settings)
    with Session(k.engine) as s, s.begin():
        s.execute(update(MlflowRun).where(MlflowRun.id == lost_id).values(status="FINISHED", end_time=1700000009000))
    k.close()
    with TestClient(create_app(server_settings)) as second:
        assert second.get(f"/api/runs/{lost_id}").json()["status"] == "completed"
        second.post(f"{MLFLOW}/runs/log-metric", json={"run_id": open_id, "key": "loss", "value": 3.0,
                                                       "timestamp": 1700000000020, "step": 20})
        second.post(f"{MLFLOW}/runs/update", json={"run_id": open_id, "status": "FINISHED"})
        curve = second.get(f"/api/runs/{open_id}", params={"points": "true"}).json()["metrics"]["loss"]
    assert [(p[0], p[1]) for p in curve] == [(0, 5.0), (10, 4.0), (20, 3.0)]


def test_the_server_indexes_what_other_processes_queue(server_settings):
    with TestClient(create_app(server_settings)) as c:
        writer = KnowledgeBase.open(server_settings)        # another writer: it cannot take the index
        try:
            # committed and queued in SQL only: this writer cannot take the index the server holds
            writer.ingest_records([record("queued-elsewhere", 3e-4, 3.3)], index=False)
            deadline = time.monotonic() + 60
            while writer.pending_index() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert writer.pending_index() == 0
        finally:
            writer.close()
        with c.app.state.lock:
            hits = c.app.state.kb.search("queued-elsewhere srv", limit=3)
        assert "queued-elsewhere" in [h.payload.get("ref_id") for h in hits]



def _string_parameters(app) -> list[tuple[str, str, dict, str]]:
    """(method, path, operation, parameter) for every string query or path parameter of every
    operation that needs no body."""
    out = []
    for path, methods in app.openapi()["paths"].items():
        for method, op in methods.items():
            if op.get("requestBody", {}).get("required"):
                continue
            for param in op.get("parameters", []):
                schema = param.get("schema", {})
                types = {schema.get("type")} | {s.get("type") for s in schema.get("anyOf", [])}
                if param["in"] in ("query", "path") and "string" in types:
                    out.append((method, path, op, param["name"]))
    return out


def test_a_nul_in_any_string_parameter_is_refused_naming_it(client):
    """Postgres text cannot hold a NUL: every string a request carries is refused with a 4xx that
    names it, on SQLite too, before it reaches SQL (schemathesis once found a required query
    parameter whose validator FastAPI had dropped: a 500 on Postgres, a 404 on SQLite)."""
    found = _string_parameters(client.app)
    assert len(found) >= 15 and ("get", "/api/2.0/mlflow/experiments/get-by-name") in {f[:2] for f in found}
    wrong = []
    for method, path, op, name in found:
        values = {p["name"]: "x" for p in op.get("parameters", []) if p.get("required")} | {name: "\x00"}
        url = re.sub(r"\{(\w+)\}", lambda m: values.pop(m.group(1)).replace("\x00", "%00"), path)
        got = client.request(method.upper(), url, params=values, headers=AUTH)
        if got.status_code not in (400, 422) or name not in got.text or "NUL" not in got.text:
            wrong.append((method, path, name, got.status_code, got.text[:200]))
    assert not wrong

# ---- schemathesis ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_no_input_makes_a_server_error(locked):
    """Every operation of /openapi.json, valid and invalid input, with a token (so writes reach their
    handlers): no 5xx. A modest number of examples per operation keeps this under a minute."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation import GenerationMode

    locked.post("/api/runs", json=lr_sweep(), headers=AUTH)
    schema = schemathesis.openapi.from_asgi("/openapi.json", locked.app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20
    examples = int(os.environ.get("KB_SERVER_FUZZ_EXAMPLES", "4"))
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            def check(case):
                case.call_and_validate(headers=AUTH, checks=[not_a_server_error])
            try:
                check()
            except Unsatisfiable:
                # no input of this operation breaks its schema (optional free-text parameters only)
                if mode is GenerationMode.POSITIVE:
                    raise


# ---- the real thing: kb serve and MLflow's client ----------------------------------------------------------

TRAIN = """
import mlflow, sys
mlflow.set_experiment(sys.argv[1])
mlflow.start_run(run_name="lr-3e-4")
mlflow.log_params({"optim.lr": 3e-4, "model.n_layer": 4, "data": "owt"})
for step in range(0, 500, 100):
    mlflow.log_metric("train/loss", 10.0 / (1 + step / 100), step=step)
mlflow.end_run()
print(mlflow.last_active_run().info.run_id)
"""


@pytest.mark.slow
def test_kb_serve_takes_a_run_from_mlflows_own_client(tmp_path, database_url):
    env = dict(os.environ, KB_HOME=str(tmp_path / "home"), KB_DATABASE_URL=database_url, KB_API_TOKENS=TOKEN,
               MLFLOW_TRACKING_TOKEN=TOKEN, MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", HF_HUB_OFFLINE="1")
    server = subprocess.Popen([KB, "serve", "--port", "0"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = server.stderr.readline()
        port = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert port, line
        url = f"http://127.0.0.1:{port.group(1)}"
        (tmp_path / "train.py").write_text(TRAIN)
        train = subprocess.run([sys.executable, str(tmp_path / "train.py"), "mlflow-exp"], cwd=tmp_path,
                               env=env | {"MLFLOW_TRACKING_URI": url}, capture_output=True, text=True, timeout=300)
        assert train.returncode == 0, train.stderr
        run_id = train.stdout.strip().splitlines()[-1]
        curve = httpx.get(f"{url}/api/runs/{run_id}", params={"points": "true"}).json()["metrics"]["train/loss"]
    finally:
        # killed, not stopped: the server may be loading the embedding model to index the run, and
        # what SQL holds must not depend on a clean shutdown (SIGTERM is tested below)
        server.kill()
        server.wait(timeout=60)
        server.stderr.close()
    assert [(p[0], p[1]) for p in curve] == [(s, pytest.approx(10.0 / (1 + s / 100))) for s in range(0, 500, 100)]
    found = subprocess.run([KB, "runs", "--where", "project = 'mlflow-exp'", "--json"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr
    [run] = json.loads(found.stdout)
    assert run["id"] == run_id and run["name"] == "lr-3e-4" and run["status"] == "completed"
    assert run["config"] == {"optim": {"lr": 3e-4}, "model": {"n_layer": 4}, "data": "owt"}
    assert run["stats"]["train/loss"] == {"points": 5, "first_step": 0, "last_step": 400, "final": 2.0, "nonfinite": 0,
                                          "best": 2.0, "best_step": 400}


def test_kb_serve_stops_cleanly_on_sigterm_and_ctrl_c(tmp_path):
    env = dict(os.environ, KB_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1")
    env.pop("KB_DATABASE_URL", None)
    env.pop("KB_API_TOKENS", None)
    for sig in (signal.SIGTERM, signal.SIGINT):
        server = subprocess.Popen([KB, "serve", "--port", "0"], env=env, stderr=subprocess.PIPE, text=True)
        try:
            url = re.search(r"http://127\.0\.0\.1:\d+", server.stderr.readline()).group(0)
            assert "loopback only" in server.stderr.readline()
            deadline = time.monotonic() + 60
            while True:          # up once the app has started: the store is open, the index held
                try:
                    assert httpx.get(f"{url}/api/runs").json() == []
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline and server.poll() is None
                    time.sleep(0.1)
            server.send_signal(sig)
            assert server.wait(timeout=60) == 0, server.stderr.read()
        finally:
            if server.poll() is None:
                server.kill()
            server.stderr.close()


def test_kb_serve_refuses_a_public_host_without_tokens_and_a_port_in_use(tmp_path, capsys, monkeypatch):
    import socket

    from kb.cli import main
    monkeypatch.setenv("KB_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KB_API_TOKENS", raising=False)
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "KB_API_TOKENS" in err
    monkeypatch.setenv("KB_API_TOKENS", TOKEN)
    assert main(["serve", "--host", "no-such-host.invalid"]) == 2
    assert "--host" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        capsys.readouterr()
        assert main(["serve", "--port", str(taken.getsockname()[1])]) == 1
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err
