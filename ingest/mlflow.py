"""MLflow tracking stores: every run of every active experiment, read through MLflow's own client
(deleted runs and experiments stay deleted).

Targets: a tracking URI (`sqlite:///path.db`, `postgresql://...`, `postgresql+psycopg://...`,
`file:///abs/mlruns`), an `mlruns/` folder, or an MLflow SQLite file (`mlflow.db`).

One MLflow run becomes one native record:
  project     experiment name            name      run name (tag mlflow.runName)
  status      FINISHED completed, FAILED failed, KILLED killed, RUNNING/SCHEDULED running
  config      params, typed ("3e-4" -> 3e-4, "true" -> True, "None" -> None, "[1, 2]" -> [1, 2])
              and nested on dots ("optim.lr" -> {"optim": {"lr": ...}}); a param whose dotted
              prefix is itself a param ("a" and "a.b") keeps its flat name ("a.b")
  metrics     full histories {key: [[step, value, wall_time_s]]}, MLflow's order (timestamp, step)
  summary     MLflow's latest value per metric (finite ones)
  tags        tag keys whose value is "" or "true" ("baseline", "ablation:norm")
  notes       tag mlflow.note.content
  code        mlflow.source.git.commit -> git_commit, mlflow.source.name -> entrypoint
  meta        mlflow_run_id, experiment_id, user, artifact_uri, mlflow_parent_run_id, and every
              tag verbatim under mlflow_tags
Source URI: `mlflow:<tracking uri>#<run uuid>` (password hidden), stable across re-ingests.

Speed: `get_metric_history` is one query per (run, key); on SQL stores the histories of a
batch of runs are read in one query over MLflow's own `SqlMetric` table model instead, with
the same NaN handling and order, which keeps every point identical. A store that does not
exist, or a database without MLflow's tables, is reported and never created or migrated
(MLflow's SqlAlchemyStore would create tables in it).

    kb ingest sqlite:///mlflow.db        kb ingest ./mlruns
"""
from __future__ import annotations

import ast
import json
import math
import os
import re
import sqlite3
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from ingest.base import register, rejected
from kb.errors import InvalidRecord
from kb.records import INT64, Item, Parsed, json_safe, parse_run

SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
PAGE = 1000            # runs per search_runs page (MLflow's maximum for SQL stores is 50,000)
METRIC_BATCH = 100     # runs whose histories are fetched together: bounds memory per query
STATUS = {"FINISHED": "completed", "FAILED": "failed", "KILLED": "killed",
          "RUNNING": "running", "SCHEDULED": "running"}
INT_RE = re.compile(r"[-+]?(0|[1-9][0-9]*)")
# a float needs a point or an exponent, so "007" (an id, a seed) stays text
FLOAT_RE = re.compile(r"[-+]?(?:(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+)")


@register("mlflow")
class MlflowIngester:
    def detect(self, target: str) -> int:
        scheme = _scheme(target)
        if scheme in SQL_SCHEMES or scheme == "file":
            return 95
        path = Path(target)
        if path.is_dir() and _looks_mlruns(path):
            return 90
        if path.is_file() and _is_mlflow_sqlite(path):
            return 90
        return 0

    def local_path(self, target: str) -> Path | None:
        """The file or folder a target's store is on this machine (a SQLite file, an mlruns/
        folder), or None for a server (ingest.pipeline sizes the input by it)."""
        try:
            uri = _tracking_uri(target)
        except InvalidRecord:
            return None
        if _scheme(uri) == "sqlite":
            from sqlalchemy.engine import make_url
            return Path(make_url(uri).database)
        if _scheme(uri) == "file":
            from urllib.parse import unquote, urlparse
            return Path(unquote(urlparse(uri).path))
        return None

    def read(self, target: str) -> Iterator[Item]:
        try:
            uri = _tracking_uri(target)
        except InvalidRecord as exc:
            yield rejected(_public(target), exc.error)
            return
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        engine = None
        try:
            if _scheme(uri) in SQL_SCHEMES:
                engine = _open_sql(uri)
            with _file_store_allowed(_scheme(uri) == "file"):
                client = MlflowClient(tracking_uri=uri)
        except (InvalidRecord, MlflowException) as exc:
            yield rejected(_public(target), getattr(exc, "error", None) or _message(exc))
            return
        except Exception as exc:     # a driver error (no such host, bad password) names the store
            reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
            yield rejected(_public(target), f"cannot open the MLflow store: {reason}")
            return
        try:
            yield from _read_store(client, uri, engine)
        finally:
            if engine is not None:
                engine.dispose()


def _read_store(client, uri: str, engine) -> Iterator[Item]:
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    public = _public(uri)
    try:
        experiments = _all_pages(lambda tok: client.search_experiments(page_token=tok))
        for exp in experiments:
            pages = _all_pages(lambda tok: client.search_runs(
                [exp.experiment_id], max_results=PAGE, page_token=tok,
                order_by=["attributes.start_time ASC"]))
            batch = []
            for run in pages:
                batch.append(run)
                if len(batch) == METRIC_BATCH:
                    yield from _read_batch(client, engine, exp, batch, public)
                    batch = []
            yield from _read_batch(client, engine, exp, batch, public)
    except (MlflowException, SQLAlchemyError) as exc:     # the store went away mid-read
        yield rejected(public, f"reading the MLflow store failed: {_message(exc)}")


def _read_batch(client, engine, exp, runs: list, public: str) -> Iterator[Item]:
    if not runs:
        return
    from mlflow.exceptions import MlflowException

    bulk = _bulk_histories(engine, [r.info.run_id for r in runs]) if engine is not None else None
    for run in runs:
        source = f"mlflow:{public}#{run.info.run_id}"
        try:
            if bulk is not None:
                metrics = bulk.get(run.info.run_id, {})
            else:
                metrics = {k: [_point(m.step, m.value, m.timestamp)
                               for m in client.get_metric_history(run.info.run_id, k)]
                           for k in run.data.metrics}
            record = parse_run(native_record(exp, run, metrics))
        except InvalidRecord as exc:
            yield rejected(source, exc.error, field=exc.field)
            continue
        except MlflowException as exc:
            yield rejected(source, _message(exc))
            continue
        yield Parsed(record, "mlflow", source, None)


def native_record(exp, run, metrics: dict) -> dict:
    """One MLflow run (MLflow's entities) as a native record; also what runs logged live through
    `kb serve` become (ingest.mlflow_live)."""
    info, params, tags = run.info, run.data.params, run.data.tags
    code = {k: v for k, v in (("git_commit", tags.get("mlflow.source.git.commit")),
                              ("entrypoint", tags.get("mlflow.source.name"))) if v}
    meta = {"mlflow_run_id": info.run_id, "experiment_id": exp.experiment_id,
            "user": tags.get("mlflow.user") or info.user_id or None,
            "artifact_uri": info.artifact_uri, "mlflow_parent_run_id": tags.get("mlflow.parentRunId"),
            "mlflow_tags": dict(tags)}
    status = STATUS.get(info.status)
    if status is None:
        raise InvalidRecord(f"unknown MLflow run status {info.status!r}", field="status")
    return {
        "project": exp.name, "name": info.run_name or tags.get("mlflow.runName") or None,
        "status": status, "config": nest(typed_params(params)), "metrics": metrics,
        "summary": json_safe(dict(run.data.metrics)),
        "tags": sorted(k for k, v in tags.items()
                       if not k.startswith("mlflow.") and v in ("", "true", "True")),
        "notes": tags.get("mlflow.note.content", ""),
        "started_at": _time(info.start_time), "ended_at": _time(info.end_time),
        "code": code or None, "meta": {k: v for k, v in meta.items() if v is not None},
    }


# -- params: MLflow stores every value as its str(); recover the type where it parses back ----

def typed_params(params: dict[str, str]) -> dict[str, Any]:
    return {k: typed(v) for k, v in params.items()}


def typed(text: str) -> Any:
    if text in ("true", "True"):
        return True
    if text in ("false", "False"):
        return False
    if text in ("None", "null"):
        return None
    if text.lower().lstrip("+-") in ("nan", "inf", "infinity"):
        return json_safe(float(text))      # what str() made of a non-finite float param
    if INT_RE.fullmatch(text):
        n = int(text)
        return n if -INT64 - 1 <= n <= INT64 else text
    if FLOAT_RE.fullmatch(text):
        x = float(text)
        return json_safe(x)      # "nan" and "1e999" become "NaN" and "Infinity", as from any source
    if text[:1] in "[{(":
        return _container(text)
    return text


def _container(text: str) -> Any:
    """A JSON list/dict, or the Python repr MLflow's str() made of one ("['a', 1]", "(1, 2)")."""
    try:
        value = json.loads(text)
    except ValueError:
        try:
            value = ast.literal_eval(text)     # literals only: never evaluates code
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return text
    ok, clean = _jsonable(value)
    return clean if ok else text


def _jsonable(value: Any) -> tuple[bool, Any]:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            ok, v = _jsonable(v)
            if not ok or not isinstance(k, str):
                return False, None
            out[k] = v
        return True, out
    if isinstance(value, (list, tuple)):
        items = [_jsonable(v) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if value is None or isinstance(value, (bool, str)):
        return True, value
    if isinstance(value, int):
        return -INT64 - 1 <= value <= INT64, value
    if isinstance(value, float):
        return True, json_safe(value)
    return False, None


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """{"optim.lr": 1} -> {"optim": {"lr": 1}}; a key under another key's leaf stays flat."""
    keys = set(flat)
    out: dict[str, Any] = {}
    for key in sorted(flat):
        parts = key.split(".")
        if (len(parts) == 1 or "" in parts
                or any(".".join(parts[:i]) in keys for i in range(1, len(parts)))):
            out[key] = flat[key]
            continue
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = flat[key]
    return out


# -- metric histories -----------------------------------------------------------------------

def _point(step: int, value: float, timestamp_ms: int | None) -> list:
    return [step, value, None if timestamp_ms is None else timestamp_ms / 1000]


def _bulk_histories(engine, run_ids: list[str]) -> dict[str, dict[str, list]]:
    """Every point of these runs in one query, as get_metric_history returns them.

    The query is built from MLflow's own SqlMetric model and run on the driver's cursor:
    SQLAlchemy's per-row result processing was two thirds of the read time on 1.2M points."""
    from mlflow.store.tracking.dbmodels.models import SqlMetric as m
    from sqlalchemy import select

    query = (select(m.run_uuid, m.key, m.step, m.value, m.timestamp, m.is_nan)
             .where(m.run_uuid.in_(run_ids))
             .order_by(m.run_uuid, m.key, m.timestamp, m.step, m.value))
    compiled = query.compile(dialect=engine.dialect, compile_kwargs={"render_postcompile": True})
    params = ([compiled.params[k] for k in compiled.positiontup] if compiled.positional
              else compiled.params)
    out: dict[str, dict[str, list]] = {}
    with engine.connect() as conn:
        cursor = conn.connection.dbapi_connection.cursor()
        try:
            cursor.execute(str(compiled), params)
            for run_uuid, key, step, value, ts, is_nan in cursor:
                # MLflow stores NaN as 0 with is_nan set, exactly as SqlMetric.to_mlflow_entity reads it
                point = [step, math.nan if is_nan else value, None if ts is None else ts / 1000]
                out.setdefault(run_uuid, {}).setdefault(key, []).append(point)
        finally:
            cursor.close()
    return out


# -- opening a store without creating one ----------------------------------------------------

def _scheme(target: str) -> str:
    head = target.split(":", 1)[0].lower() if ":" in target else ""
    if head == "file":
        return "file"
    base = head.split("+", 1)[0]
    return base if base in SQL_SCHEMES and "://" in target else ""


def _tracking_uri(target: str) -> str:
    """The target as an absolute tracking URI; a local store that is missing is an error."""
    scheme = _scheme(target)
    if scheme in SQL_SCHEMES:
        from sqlalchemy.engine import make_url
        try:
            url = make_url(target)
        except Exception as exc:     # sqlalchemy's ArgumentError: the text is not a URL
            raise InvalidRecord(f"not a database URI: {exc}") from None
        if scheme == "sqlite":
            if not url.database or url.database == ":memory:" or url.database.startswith("file:"):
                raise InvalidRecord("an MLflow SQLite URI names a file: sqlite:///path/to/mlflow.db")
            path = Path(url.database).expanduser().resolve()
            if not path.is_file():
                raise InvalidRecord(f"MLflow store not found: {path} (from {target})")
            url = url.set(database=str(path))
        elif url.drivername == "postgresql" and not _has_module("psycopg2") and _has_module("psycopg"):
            url = url.set(drivername="postgresql+psycopg")   # psycopg 3 is what pretrain-kb ships
        return url.render_as_string(hide_password=False)
    if scheme == "file":
        from urllib.parse import unquote, urlparse
        path = Path(unquote(urlparse(target).path)).resolve()
    else:
        path = Path(target).expanduser().resolve()
        if path.is_file():
            return f"sqlite:///{path}"
    if not path.is_dir():
        raise InvalidRecord(f"MLflow store not found: {path}")
    if not os.access(path, os.R_OK | os.X_OK):
        raise InvalidRecord(f"MLflow store is not readable: {path}")
    return path.as_uri()


def _open_sql(uri: str):
    """An engine on an existing MLflow database; refuses one MLflow would create or migrate."""
    import sqlalchemy
    from mlflow.store.db.base_sql_model import Base
    import mlflow.store.tracking.dbmodels.models  # noqa: F401  (registers the tables on Base)

    engine = sqlalchemy.create_engine(uri)
    try:
        tables = set(sqlalchemy.inspect(engine).get_table_names())
    except Exception:
        engine.dispose()
        raise
    if not {"experiments", "runs", "metrics"} <= tables:
        engine.dispose()
        raise InvalidRecord(f"{_public(uri)} is not an MLflow tracking database "
                            "(no experiments/runs/metrics tables)")
    missing = set(Base.metadata.tables) - tables
    if missing:
        engine.dispose()
        raise InvalidRecord(f"{_public(uri)} has an older MLflow schema (missing tables: "
                            f"{', '.join(sorted(missing)[:5])}); run `mlflow db upgrade` on it first")
    return engine


@contextmanager
def _file_store_allowed(enabled: bool):
    """MLflow 3 opens an `mlruns/` folder only when MLFLOW_ALLOW_FILE_STORE is set; reading a
    legacy store is what that switch is for. Set only while the client builds its (cached) store."""
    if not enabled:
        yield
        return
    before = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
        else:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = before


def _looks_mlruns(path: Path) -> bool:
    if path.name == "mlruns":
        return True
    try:
        children = [c for c in path.iterdir() if c.is_dir()][:50]
    except OSError:
        return False
    for child in children:
        meta = child / "meta.yaml"
        try:
            head = meta.read_text(errors="replace")[:2048] if meta.is_file() else ""
        except OSError:
            continue
        if "experiment_id:" in head and "artifact_location:" in head:
            return True
    return False


def _is_mlflow_sqlite(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            if fh.read(16) != b"SQLite format 3\x00":
                return False
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            names = {r[0] for r in conn.execute("select name from sqlite_master where type='table'")}
        finally:
            conn.close()
    except (OSError, sqlite3.Error):
        return False
    return {"experiments", "runs", "metrics", "alembic_version"} <= names


# -- small helpers ----------------------------------------------------------------------------

def _all_pages(fetch) -> Iterator:
    token = None
    while True:
        page = fetch(token)
        yield from page
        token = page.token
        if not token:
            return


def _time(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


def _public(uri: str) -> str:
    """The URI as it may be shown and stored: a database password never leaves this module."""
    return re.sub(r"(://[^:/@]+):[^/]*@", r"\1:***@", uri) if _scheme(uri) in SQL_SCHEMES else uri


def _message(exc: Exception) -> str:
    return getattr(exc, "message", None) or str(exc)


def _has_module(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None
