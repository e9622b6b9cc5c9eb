"""/api/runs: store native records, list runs with the query language, read one run.

    curl -X POST localhost:8000/api/runs -H 'Authorization: Bearer $TOKEN' -d @run.json
    curl 'localhost:8000/api/runs?where=status%20%3D%20%27diverged%27&sort=-summary.val/loss&limit=5'
    curl localhost:8000/api/runs/small-lr0.003?points=true
"""
from __future__ import annotations

from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Body, Query, Request, Response

from kb.errors import InvalidRecord, QueryError
from kb.server.auth import writer
from kb.server.text import Text

router = APIRouter(prefix="/api/runs", tags=["runs"])
MAX_LIMIT = 2**63 - 1         # SQL's LIMIT is 64 bits (kb runs --limit takes the same)


@router.post("", dependencies=writer, status_code=200)
def post_runs(request: Request, response: Response,
              record: dict[str, Any] | list[dict[str, Any]] = Body(
                  ..., description="a native run record (SPEC), or a list of them")):
    """Store native run records; the ingest report (`kb ingest --json`'s shape). A single record
    that cannot be stored is a 400 naming its field; a list reports its failures in the report."""
    k = request.app.state.kb
    records = record if isinstance(record, list) else [record]
    if not records:
        raise InvalidRecord("an empty list: send a run record or a list of them", field="body")
    report = k.ingest_records(records, source="api", index=False)
    request.app.state.keeper.wake()
    if report.failed and not report.ids:
        f = report.failed[0]
        where = f"record {f['line']}: " if len(records) > 1 else ""
        raise InvalidRecord(f"{where}{f['error']}", field=f["field"])
    if report.added:
        response.status_code = 201
    if len(report.ids) == 1:
        response.headers["Location"] = f"/api/runs/{quote(report.ids[0], safe='')}"
    return report.as_dict()


@router.get("")
def list_runs(request: Request,
              where: Text | None = Query(None, description="a query: config.optim.lr > 1e-3 and status = 'diverged'"),
              sort: Text | None = Query(None, description="a key, '-' first for descending, e.g. -summary.val/loss"),
              limit: int | None = Query(None, ge=1, le=MAX_LIMIT),
              project: Text | None = Query(None, description="only this project's runs")):
    """Runs, as `kb runs --json` lists them."""
    from kb.query import parse, parse_sort
    for name, parse_text, text in (("where", parse, where), ("sort", parse_sort, sort)):
        if text:
            try:
                parse_text(text)
            except QueryError as exc:
                raise QueryError(f"{name}: {exc}") from None
    return [r.as_dict() for r in request.app.state.kb.runs(where=where, sort=sort, limit=limit, project=project)]


@router.get("/{run_id:path}")
def get_run(request: Request, run_id: Text,
            points: bool = Query(False, description="every curve point, not just each curve's first and last")):
    """One run, as `kb show --json` gives it: config, summary, metrics, failures, anomalies, ablations."""
    detail = request.app.state.kb.run(run_id)
    data = detail.as_dict()
    if not points:
        data["metrics"] = {k: {"points": len(v), "first": v[0], "last": v[-1]} for k, v in data["metrics"].items()}
    return data
