"""MLflow's tracking REST API, the part MLflow's own client logs runs with, on a knowledge base.

    export MLFLOW_TRACKING_URI=http://127.0.0.1:8000     # MLFLOW_TRACKING_TOKEN=<token> when KB_API_TOKENS is set
    python train.py        # mlflow.set_experiment / start_run / log_params / log_metric / end_run, unchanged

Endpoints (under /api/2.0/mlflow, MLflow's request and response JSON): experiments/get-by-name,
experiments/get, experiments/create, runs/create, runs/get, runs/update, runs/log-metric,
runs/log-parameter, runs/set-tag, runs/log-batch, metrics/get-history. Open runs are kept in
SQL and an ended run becomes a native run under MLflow's run id (ingest.mlflow_live). Errors
are MLflow's `{"error_code", "message"}`, so its client raises what it would against MLflow.
Artifacts, models, traces and search are not served.
"""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from kb.errors import InvalidRecord
from kb.server.auth import writer
from kb.server.text import Text

router = APIRouter(prefix="/api/2.0/mlflow", tags=["mlflow"])


# ---- requests: MLflow's messages, with the fields this server reads (others are ignored) -----------

class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")


class KeyValue(_Message):
    key: str
    value: str = ""


class MetricIn(_Message):
    key: str
    value: float
    timestamp: int | None = Field(None, description="ms since the epoch; default now")
    step: int = 0


class CreateExperiment(_Message):
    name: str
    artifact_location: str = ""
    tags: list[KeyValue] = []


class CreateRun(_Message):
    experiment_id: str = "0"
    user_id: str = ""
    start_time: int | None = None
    run_name: str | None = None
    tags: list[KeyValue] = []


class RunMessage(_Message):
    run_id: Text | None = None
    run_uuid: Text | None = Field(None, description="the old name of run_id; either will do")

    @property
    def run(self) -> str:
        if not (self.run_id or self.run_uuid):
            raise InvalidRecord("missing: the run to write to", field="run_id")
        return self.run_id or self.run_uuid


class LogMetric(RunMessage, MetricIn):
    pass


class LogParam(RunMessage, KeyValue):
    pass


class SetTag(RunMessage, KeyValue):
    pass


class LogBatch(RunMessage):
    metrics: list[MetricIn] = []
    params: list[KeyValue] = []
    tags: list[KeyValue] = []


class UpdateRun(RunMessage):
    status: str | None = None
    end_time: int | None = None
    run_name: str | None = None


# ---- experiments ------------------------------------------------------------------------------------

@router.get("/experiments/get-by-name")
def get_experiment_by_name(request: Request, experiment_name: Annotated[Text, Query()]):
    return {"experiment": _experiment(_live(request).experiment_by_name(experiment_name))}


@router.get("/experiments/get")
def get_experiment(request: Request, experiment_id: Annotated[Text, Query()]):
    return {"experiment": _experiment(_live(request).experiment(experiment_id))}


@router.post("/experiments/create", dependencies=writer)
def create_experiment(request: Request, body: CreateExperiment):
    exp = _live(request).create_experiment(body.name, body.artifact_location, _pairs(body.tags))
    return {"experiment_id": str(exp.id)}


# ---- runs -------------------------------------------------------------------------------------------

@router.post("/runs/create", dependencies=writer)
def create_run(request: Request, body: CreateRun):
    run = _live(request).create_run(body.experiment_id, name=body.run_name, user_id=body.user_id,
                                    start_time=body.start_time, tags=_pairs(body.tags))
    return {"run": _run(run)}


@router.get("/runs/get")
def get_run(request: Request, run_id: Text | None = Query(None), run_uuid: Text | None = Query(None)):
    return {"run": _run(_live(request).run(RunMessage(run_id=run_id, run_uuid=run_uuid).run))}


@router.post("/runs/update", dependencies=writer)
def update_run(request: Request, body: UpdateRun):
    run = _live(request).update(body.run, status=body.status, end_time=body.end_time, name=body.run_name)
    _stored(request, run)
    return {"run_info": _run_info(run)}


@router.post("/runs/log-metric", dependencies=writer)
def log_metric(request: Request, body: LogMetric):
    _log(request, body.run, metrics=[body])
    return {}


@router.post("/runs/log-parameter", dependencies=writer)
def log_parameter(request: Request, body: LogParam):
    _log(request, body.run, params=[body])
    return {}


@router.post("/runs/set-tag", dependencies=writer)
def set_tag(request: Request, body: SetTag):
    _log(request, body.run, tags=[body])
    return {}


@router.post("/runs/log-batch", dependencies=writer)
def log_batch(request: Request, body: LogBatch):
    _log(request, body.run, metrics=body.metrics, params=body.params, tags=body.tags)
    return {}


@router.get("/metrics/get-history")
def get_metric_history(request: Request, metric_key: Annotated[Text, Query()], run_id: Text | None = Query(None),
                       run_uuid: Text | None = Query(None)):
    points = _live(request).history(RunMessage(run_id=run_id, run_uuid=run_uuid).run, metric_key)
    return {"metrics": [{"key": metric_key, "value": v, "timestamp": ts, "step": step} for v, ts, step in points]}


# ---- between MLflow's JSON and the live store ----------------------------------------------------------

def _live(request: Request):
    return request.app.state.kb.mlflow_live()


def _log(request: Request, run_id: str, *, metrics=(), params=(), tags=()) -> None:
    live = _live(request)
    duplicated = _first_repeat(p.key for p in params)
    if duplicated is not None:
        raise InvalidRecord("given twice in one batch", field=f"params.{duplicated}")
    stored = live.log(run_id, metrics=[(m.key, m.value, m.timestamp, m.step) for m in metrics],
                      params=_pairs(params), tags=_pairs(tags))
    if stored:
        request.app.state.keeper.wake()


def _stored(request: Request, run) -> None:
    """An ended run was stored: index it soon."""
    if run.stored:
        request.app.state.keeper.wake()


def _pairs(items) -> dict:
    return {i.key: i.value for i in items}


def _first_repeat(keys):
    seen = set()
    for key in keys:
        if key in seen:
            return key
        seen.add(key)
    return None


def _experiment(exp) -> dict:
    return {"experiment_id": str(exp.id), "name": exp.name, "artifact_location": exp.artifact_location,
            "lifecycle_stage": "active", "creation_time": exp.created_ms, "last_update_time": exp.created_ms,
            "tags": [{"key": k, "value": v} for k, v in exp.tags.items()]}


def _run_info(run) -> dict:
    info = {"run_id": run.id, "run_uuid": run.id, "run_name": run.name, "experiment_id": str(run.experiment_id),
            "user_id": run.user_id, "status": run.status, "start_time": run.start_time,
            "artifact_uri": "", "lifecycle_stage": "active"}
    if run.end_time is not None:
        info["end_time"] = run.end_time
    return info


def _run(run) -> dict:
    return {"info": _run_info(run),
            "data": {"metrics": [{"key": k, "value": v, "timestamp": ts, "step": step}
                                 for k, (v, ts, step) in run.latest.items()],
                     "params": [{"key": k, "value": v} for k, v in run.params.items()],
                     "tags": [{"key": k, "value": v} for k, v in run.tags.items()]},
            "inputs": {}}
