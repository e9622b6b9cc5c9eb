"""MLflow runs logged live: what MLflow's client sends to `kb serve` (kb/server/mlflow_compat.py).

    live = k.mlflow_live()
    exp = live.create_experiment("gpt-small")
    run = live.create_run(exp.id, name="lr-3e-4", user="alice")
    live.log(run.id, params={"optim.lr": "3e-4"}, metrics=[("train/loss", 6.2, 1700000000000, 100)])
    live.update(run.id, status="FINISHED", end_time=1700000060000)     # -> stored as a native run

An open run lives in SQL (MlflowRun, MlflowPoint: migration 0010), one transaction per call,
so a server that dies or restarts loses nothing of it. When a run ends (FINISHED, FAILED,
KILLED) it is stored through `KnowledgeBase.ingest_records` as the native record the MLflow
ingester makes of a run read from an MLflow store (ingest.mlflow.native_record: project = the
experiment's name, config = the params typed and nested on dots, metrics = every logged point
with its step and wall time), under MLflow's run id, so `kb show <run_id>` finds it. A run
changed after it ended is stored again. An ended run not stored yet (the server died in
between) is stored by `store_ended`, which `kb serve` calls when it starts.

Limits are MLflow's own, so a client that works against MLflow's server works here: keys of
at most 250 characters (200 here: the knowledge base's limit on a metric's name), param values
of 6,000, tag values of 8,000; a batch of at most 1,000 metrics, 100 params and 100 tags. A
param, once logged, keeps its value (MLflow refuses a change too).
"""
from __future__ import annotations

import logging
import math
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from kb.db import WriteBatch
from kb.errors import AlreadyExists, InvalidRecord, NotFound
from kb.models import MlflowExperiment, MlflowPoint, MlflowRun
from kb.records import INT64, MAX_NAME, parse_run, text_problem

log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = (0, "Default")      # MLflow's: a run started with no experiment set goes here
ENDED = ("FINISHED", "FAILED", "KILLED")
STATUSES = ("RUNNING", "SCHEDULED") + ENDED
MAX_PARAM_VALUE, MAX_TAG_VALUE = 6000, 8000
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100
SOURCE_KIND = "mlflow"
LAST_MS = 253402300799999        # 9999-12-31T23:59:59.999Z: the last time a record's dates can hold


@dataclass
class Experiment:
    id: int
    name: str
    artifact_location: str
    tags: dict
    created_ms: int


@dataclass
class LiveRun:
    id: str
    experiment_id: int
    name: str
    user_id: str
    status: str
    start_time: int | None
    end_time: int | None
    params: dict
    tags: dict
    latest: dict = field(default_factory=dict)    # key -> (value, timestamp, step): MLflow's "latest"
    stored: bool = False


class LiveRuns:
    """MLflow's tracking calls on a KnowledgeBase's SQL store; every method is one transaction."""

    def __init__(self, kb):
        self.kb = kb
        self.engine = kb.engine

    # ---- experiments ---------------------------------------------------------------------------

    def experiment(self, ref) -> Experiment:
        exp_id = _experiment_id(ref)
        if exp_id == DEFAULT_EXPERIMENT[0]:
            self._ensure_default()
        with Session(self.engine) as s:
            row = s.get(MlflowExperiment, exp_id)
            if row is None:
                raise NotFound(f"no experiment with id {ref!r}")
            return _experiment(row)

    def experiment_by_name(self, name: str) -> Experiment:
        if name == DEFAULT_EXPERIMENT[1]:
            self._ensure_default()
        with Session(self.engine) as s:
            row = s.execute(select(MlflowExperiment).where(MlflowExperiment.name == name)).scalar_one_or_none()
            if row is None:
                raise NotFound(f"no experiment named {name!r}")
            return _experiment(row)

    def create_experiment(self, name: str, artifact_location: str = "", tags: dict | None = None) -> Experiment:
        _check_text(name, "name", MAX_NAME, empty=False)
        _check_text(artifact_location or "", "artifact_location", MAX_TAG_VALUE)
        tags = _checked_tags(tags or {})
        row = MlflowExperiment(name=name, artifact_location=artifact_location or "", tags=tags)
        if name == DEFAULT_EXPERIMENT[1]:
            self._ensure_default()           # and then the name is taken, as on MLflow's server
        try:
            with _write(self.engine) as s:
                s.add(row)
                s.flush()
                return _experiment(row)
        except IntegrityError:
            raise AlreadyExists(f"an experiment named {name!r} exists already", field="name") from None

    def _ensure_default(self) -> None:
        """MLflow's experiment 0, "Default", made on first use (once, however many ask at once)."""
        with Session(self.engine) as s:
            if s.get(MlflowExperiment, DEFAULT_EXPERIMENT[0]) is not None:
                return
        try:
            with _write(self.engine) as s:
                taken = s.execute(select(func.count()).select_from(MlflowExperiment)
                                  .where(MlflowExperiment.name == DEFAULT_EXPERIMENT[1])).scalar_one()
                if not taken:
                    s.add(MlflowExperiment(id=DEFAULT_EXPERIMENT[0], name=DEFAULT_EXPERIMENT[1], tags={}))
        except IntegrityError:
            pass                 # made meanwhile by another request

    # ---- runs ----------------------------------------------------------------------------------

    def create_run(self, experiment_id, *, name: str | None = None, user_id: str = "",
                   start_time: int | None = None, tags: dict | None = None) -> LiveRun:
        exp = self.experiment(experiment_id)
        tags = _checked_tags(tags or {})
        name = name or tags.get("mlflow.runName") or ""
        _check_text(name, "run_name", MAX_NAME)
        _check_text(user_id or "", "user_id", MAX_NAME)
        start = _check_time(start_time, "start_time") if start_time is not None else _now_ms()
        row = MlflowRun(id=uuid.uuid4().hex, experiment_id=exp.id, name=name, user_id=user_id or "",
                        status="RUNNING", start_time=start, params={},
                        tags=tags | ({"mlflow.runName": name} if name else {}))
        with _write(self.engine) as s:
            s.add(row)
            s.flush()
            return _live(row, {})

    def run(self, run_id: str) -> LiveRun:
        with Session(self.engine) as s:
            return _live(_run_row(s, run_id), _latest(s, run_id))

    def history(self, run_id: str, key: str) -> list[tuple]:
        """Every value of `key`: (value, timestamp, step), in the order they were logged."""
        with Session(self.engine) as s:
            _run_row(s, run_id)
            rows = s.execute(select(MlflowPoint.value, MlflowPoint.timestamp, MlflowPoint.step)
                             .where(MlflowPoint.run_id == run_id, MlflowPoint.key == key)
                             .order_by(MlflowPoint.seq))
            return [(_value(v), ts, step) for v, ts, step in rows]

    def log(self, run_id: str, *, metrics=(), params: dict | None = None, tags: dict | None = None) -> bool:
        """One batch: metrics as (key, value, timestamp_ms, step); params and tags as {key: text}.
        True when the run had ended, so it was stored again."""
        metrics, params, tags = list(metrics), dict(params or {}), dict(tags or {})
        for what, n, most in (("metrics", len(metrics), MAX_METRICS), ("params", len(params), MAX_PARAMS),
                              ("tags", len(tags), MAX_TAGS)):
            if n > most:
                raise InvalidRecord(f"{n} in one batch; MLflow's limit is {most}", field=what)
        points = [_point(run_id, *m) for m in metrics]
        for key, value in params.items():
            _check_text(key, "params", MAX_NAME, empty=False)
            _check_text(value, f"params.{key}", MAX_PARAM_VALUE)
        tags = _checked_tags(tags)
        with _write(self.engine) as s:
            row = _run_row(s, run_id, lock=True)
            changed = {k: (row.params[k], v) for k, v in params.items() if k in row.params and row.params[k] != v}
            if changed:
                key, (old, new) = next(iter(changed.items()))
                raise InvalidRecord(f"logged as {old!r} already; a param cannot change (now {new!r})",
                                    field=f"params.{key}")
            if params:
                _check_config(row.params | params)
                row.params = row.params | params
            if tags:
                row.tags = row.tags | tags
                if "mlflow.runName" in tags:           # MLflow's server renames the run too
                    row.name = tags["mlflow.runName"]
            s.add_all(points)
            row.stored = False
            ended = row.status in ENDED
        if ended:             # changed after it ended: the stored run follows
            self.store(run_id)
        return ended

    def update(self, run_id: str, *, status: str | None = None, end_time: int | None = None,
               name: str | None = None) -> LiveRun:
        """MLflow's runs/update: a new status, end time or name; an ended run is stored."""
        if status is not None and status not in STATUSES:
            raise InvalidRecord(f"{status!r} is not a run status; MLflow's are {', '.join(STATUSES)}", field="status")
        if name is not None:
            _check_text(name, "run_name", MAX_NAME)
        with _write(self.engine) as s:
            row = _run_row(s, run_id, lock=True)
            if status is not None:
                row.status = status
            if end_time is not None:
                row.end_time = _check_time(end_time, "end_time")
            elif status in ENDED and row.end_time is None:
                row.end_time = _now_ms()
            if name:
                row.name = name
                row.tags = row.tags | {"mlflow.runName": name}
            row.stored = False
            ended = row.status in ENDED
        if ended:
            self.store(run_id)
        return self.run(run_id)

    # ---- into the knowledge base -----------------------------------------------------------------

    def store(self, run_id: str) -> str:
        """Store the run as a native run (id = MLflow's run id); InvalidRecord if it cannot be."""
        from ingest.mlflow import native_record

        with Session(self.engine) as s:
            row = _run_row(s, run_id)
            exp = s.get(MlflowExperiment, row.experiment_id)
            live = _live(row, _latest(s, run_id))
            points: dict[str, list] = {}
            for key, step, value, ts in s.execute(
                    select(MlflowPoint.key, MlflowPoint.step, MlflowPoint.value, MlflowPoint.timestamp)
                    .where(MlflowPoint.run_id == run_id)
                    .order_by(MlflowPoint.key, MlflowPoint.timestamp, MlflowPoint.step, MlflowPoint.seq)):
                points.setdefault(key, []).append([step, _value(value), ts / 1000])
        exp_entity, run_entity = _entities(_experiment(exp), live)
        record = native_record(exp_entity, run_entity, points) | {"id": run_id}
        if not record["config"] and not record["metrics"]:
            # nothing logged (a script that died early): remembered by what ran, as `kb track` does
            record["config"] = {"command": live.tags.get("mlflow.source.name") or f"mlflow run {run_id}"}
        report = self.kb.ingest_records([record], source=f"mlflow:kb-serve#{run_id}", source_kind=SOURCE_KIND,
                                        index=False)
        if report.failed:
            f = report.failed[0]
            raise InvalidRecord(f"run {run_id} ended but cannot be stored: {f['error']}", field=f["field"])
        with _write(self.engine) as s:
            # unless it changed again meanwhile: then the call that changed it stores it
            s.execute(update(MlflowRun).where(MlflowRun.id == run_id, MlflowRun.status.in_(ENDED))
                      .values(stored=True))
        return run_id

    def store_ended(self) -> list[str]:
        """Store every ended run that is not stored as it is now (a server died in between); the
        ids stored. A run that cannot be stored is left as it is, logged, for its next change."""
        with Session(self.engine) as s:
            ids = list(s.execute(select(MlflowRun.id).where(MlflowRun.status.in_(ENDED),
                                                            MlflowRun.stored.is_(False))).scalars())
        done = []
        for run_id in ids:
            try:
                done.append(self.store(run_id))
            except InvalidRecord as exc:
                log.warning("%s", exc)
        return done


# ---- rows and checks ---------------------------------------------------------------------------

@contextmanager
def _write(engine):
    """One write transaction whose reads are part of it: on SQLite the write lock is taken up front
    (kb.db.WriteBatch: BEGIN IMMEDIATE; the driver alone would begin at the first write, after
    the run was read), on Postgres the run's row is locked (`_run_row(lock=True)`). So two
    requests never both find a param unset and both set it."""
    with WriteBatch(engine) as batch, batch.record() as s:
        yield s


def _experiment_id(ref) -> int:
    try:
        exp_id = int(str(ref))
    except ValueError:
        raise NotFound(f"no experiment with id {ref!r}") from None
    if not 0 <= exp_id < 2**31:          # beyond the id column's range no row can exist
        raise NotFound(f"no experiment with id {ref!r}")
    return exp_id


def _run_row(s: Session, run_id: str, lock: bool = False) -> MlflowRun:
    stmt = select(MlflowRun).where(MlflowRun.id == run_id)
    row = s.execute(stmt.with_for_update() if lock else stmt).scalar_one_or_none()
    if row is None:
        raise NotFound(f"no run with id {run_id!r}")
    return row


def _latest(s: Session, run_id: str) -> dict:
    """MLflow's latest value of each key: the highest step, then the latest timestamp."""
    ranked = (select(MlflowPoint.key, MlflowPoint.value, MlflowPoint.timestamp, MlflowPoint.step,
                     func.row_number().over(partition_by=MlflowPoint.key,
                                            order_by=(MlflowPoint.step.desc(), MlflowPoint.timestamp.desc(),
                                                      MlflowPoint.seq.desc())).label("rank"))
              .where(MlflowPoint.run_id == run_id).subquery())
    rows = s.execute(select(ranked.c.key, ranked.c.value, ranked.c.timestamp, ranked.c.step)
                     .where(ranked.c.rank == 1).order_by(ranked.c.key))
    return {key: (_value(v), ts, step) for key, v, ts, step in rows}


def _experiment(row: MlflowExperiment) -> Experiment:
    return Experiment(row.id, row.name, row.artifact_location, dict(row.tags),
                      int(row.created_at.timestamp() * 1000))


def _live(row: MlflowRun, latest: dict) -> LiveRun:
    return LiveRun(row.id, row.experiment_id, row.name, row.user_id, row.status, row.start_time, row.end_time,
                   dict(row.params), dict(row.tags), latest, row.stored)


def _point(run_id: str, key, value, timestamp, step) -> MlflowPoint:
    _check_text(key, "metrics", MAX_NAME, empty=False)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRecord(f"{value!r} is not a number", field=f"metrics.{key}")
    step = 0 if step is None else step
    if isinstance(step, bool) or not isinstance(step, int) or not -INT64 - 1 <= step <= INT64:
        raise InvalidRecord(f"step {step!r} is not a 64-bit integer", field=f"metrics.{key}")
    ts = _check_time(_now_ms() if timestamp is None else timestamp, f"metrics.{key}")
    value = float(value)
    # SQLite keeps a NaN as NULL; NULL here always means NaN (MLflow has no null values)
    return MlflowPoint(run_id=run_id, key=key, step=step, timestamp=ts, value=None if math.isnan(value) else value)


def _value(v: float | None) -> float:
    return math.nan if v is None else v


def _check_text(value, what: str, limit: int, empty: bool = True) -> None:
    if not isinstance(value, str):
        raise InvalidRecord(f"{value!r} is not text", field=what)
    if not empty and not value.strip():
        raise InvalidRecord("must not be empty", field=what)
    if problem := text_problem(value, limit):
        raise InvalidRecord(problem, field=what)


def _check_config(params: dict) -> None:
    """The params as the stored run's config will hold them: a param that could not be stored
    (nested too deep once typed, a key path too long) is refused when it is logged, not at the end."""
    from ingest.mlflow import nest, typed_params
    parse_run({"config": nest(typed_params(params))})


def _checked_tags(tags: dict) -> dict:
    for key, value in tags.items():
        _check_text(key, "tags", MAX_NAME, empty=False)
        _check_text(value, f"tags.{key}", MAX_TAG_VALUE)
    return tags


def _check_time(ms, what: str) -> int:
    if isinstance(ms, bool) or not isinstance(ms, int) or not 0 <= ms <= LAST_MS:
        raise InvalidRecord(f"{ms!r} is not a time in milliseconds since 1970", field=what)
    return ms


def _now_ms() -> int:
    return int(time.time() * 1000)


def _entities(exp: Experiment, run: LiveRun):
    """The run as MLflow's own entities: the MLflow ingester's mapping reads those."""
    from mlflow.entities import Experiment as MlflowExperimentEntity
    from mlflow.entities import Metric, Param, Run, RunData, RunInfo, RunTag

    info = RunInfo(run_id=run.id, experiment_id=str(run.experiment_id), user_id=run.user_id, status=run.status,
                   start_time=run.start_time, end_time=run.end_time, lifecycle_stage="active",
                   artifact_uri=None, run_name=run.name or None)
    data = RunData(metrics=[Metric(k, v, ts, step) for k, (v, ts, step) in run.latest.items()],
                   params=[Param(k, v) for k, v in run.params.items()],
                   tags=[RunTag(k, v) for k, v in run.tags.items()])
    return (MlflowExperimentEntity(str(exp.id), exp.name, exp.artifact_location, "active"),
            Run(run_info=info, run_data=data))
