"""The FastAPI app: `create_app(kb_or_settings)`; `kb serve` runs it under uvicorn.

    from kb.server.app import create_app
    app = create_app(Settings(home=".kb"))        # or an open KnowledgeBase, or None (KB_* settings)

The app holds the embedded vector index for its lifetime: a background thread indexes what
other processes queue (`kb ingest`, `kb track`, workers) every `KB_INDEX_SYNC_S` seconds, and
at once after a write through this server. On start it also stores the MLflow runs that ended
while no server was there to store them (ingest.mlflow_live).

Errors become HTTP here and nowhere else: bad input 400 (422 when the request does not match
the OpenAPI schema), a missing record 404, a write without a valid token 401, an index or model
that cannot be had now 503; the body is `{"detail": "<one line>"}`, or MLflow's
`{"error_code", "message"}` under /api/2.0/mlflow.
"""
from __future__ import annotations

import json
import logging
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kb.errors import (AlreadyExists, IndexUnavailable, InvalidRecord, KBError, LLMError, NotFound, QueryError,
                       ReadOnlyStore, UnknownFormat)
from kb.records import json_safe
from kb.server.auth import Tokens, Unauthorized, reader
from kb.server.limits import BodyLimit

log = logging.getLogger(__name__)

MLFLOW_PREFIX = "/api/2.0/mlflow"
MLFLOW_CODES = {400: "INVALID_PARAMETER_VALUE", 401: "UNAUTHENTICATED", 404: "RESOURCE_DOES_NOT_EXIST",
                405: "ENDPOINT_NOT_FOUND", 503: "TEMPORARILY_UNAVAILABLE"}


class KBJSON(JSONResponse):
    """JSON as the CLI's --json writes it: non-finite numbers as "NaN"/"Infinity" strings, times
    ISO-8601; ASCII-escaped, so text that is not valid Unicode still goes out as valid JSON."""

    def render(self, content) -> bytes:
        return json.dumps(json_safe(content), allow_nan=False, separators=(",", ":")).encode("ascii")


class IndexKeeper:
    """Indexes what awaits indexing, every `every_s` seconds or when woken, in one thread. `lock`
    is held around each sync; the agents take it too, so a search never meets a write."""

    def __init__(self, kb, lock: threading.RLock, every_s: float):
        self.kb, self.lock, self.every_s = kb, lock, every_s
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kb-index", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def sync(self) -> bool:
        with self.lock:
            return self.kb.try_sync_index()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception:          # noqa: BLE001 - a bad sync must not end the server's indexing
                log.exception("indexing failed; retrying in %.0f s", self.every_s)
            self._wake.wait(self.every_s)
            self._wake.clear()


def create_app(kb_or_settings=None, *, index: bool = True, ui: bool = True) -> FastAPI:
    """The app on an open KnowledgeBase (left open at shutdown), or on one it opens from Settings
    or the KB_* variables (closed at shutdown). `index=False`: no indexing thread; `ui=False`: no
    Gradio UI at /ui (it costs gradio's import, ~3.5 s)."""
    from kb.api import KnowledgeBase, open_kb
    from kb.server import agents, hypotheses, jobs, mlflow_compat, runs

    owned = not isinstance(kb_or_settings, KnowledgeBase)
    k = open_kb(kb_or_settings)
    lock = threading.RLock()
    keeper = IndexKeeper(k, lock, k.settings.index_sync_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        stored = k.mlflow_live().store_ended()
        if stored:
            log.info("stored %d MLflow run(s) that ended while no server ran", len(stored))
        if index:
            keeper.start()
        try:
            yield
        finally:
            keeper.stop()
            if owned:
                k.close()

    app = FastAPI(title="pretrain-kb", version="1", lifespan=lifespan, default_response_class=KBJSON,
                  description="Runs, questions, hypotheses and jobs of a pretrain-kb knowledge base, and the "
                              "part of MLflow's tracking API its client logs runs with (under /api/2.0/mlflow). "
                              "Writes need `Authorization: Bearer <token>` when KB_API_TOKENS is set.")
    app.state.kb, app.state.lock, app.state.keeper = k, lock, keeper
    app.state.tokens = Tokens(k.settings.tokens, k.settings.read_tokens)
    for module in (runs, agents, hypotheses, jobs, mlflow_compat):
        app.include_router(module.router, dependencies=reader)
    _handle_errors(app)
    app.add_middleware(BodyLimit, max_bytes=int(k.settings.api_max_body_mb * (1 << 20)))
    if k.settings.cors_origins:       # closed unless origins are named: no wildcard, no credentials
        app.add_middleware(CORSMiddleware, allow_origins=k.settings.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    if ui:
        from kb.ui.app import mount
        app = mount(app, k, lock, tokens=app.state.tokens)
    return app


# ---- errors --------------------------------------------------------------------------------------

def status_of(exc: Exception) -> int:
    if isinstance(exc, Unauthorized):
        return 401
    if isinstance(exc, NotFound):
        return 404
    if isinstance(exc, (InvalidRecord, QueryError, UnknownFormat)):
        return 400
    if isinstance(exc, (IndexUnavailable, LLMError, ReadOnlyStore)):
        return 503
    return 500


def one_line(message: str) -> str:
    """The first line: a query error's later lines draw a caret under its column."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    return lines[0] if lines else "(no message)"


def error(request: Request, status: int, message: str, headers: dict | None = None,
          mlflow_code: str | None = None) -> KBJSON:
    message = one_line(message)
    if request.url.path.startswith(MLFLOW_PREFIX):
        body = {"error_code": mlflow_code or MLFLOW_CODES.get(status, "INTERNAL_ERROR"), "message": message}
    else:
        body = {"detail": message}
    return KBJSON(body, status_code=status, headers=headers)


def _handle_errors(app: FastAPI) -> None:
    @app.exception_handler(KBError)
    async def kb_error(request: Request, exc: KBError):
        status = status_of(exc)
        if status >= 500:
            log.error("%s %s: %s", request.method, request.url.path, exc)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        # MLflow's set_experiment takes the existing experiment on this code (two clients racing)
        code = "RESOURCE_ALREADY_EXISTS" if isinstance(exc, AlreadyExists) else None
        return error(request, status, str(exc), headers, code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        # MLflow's client reads any 4xx; its own server answers a malformed request with 400
        status = 400 if request.url.path.startswith(MLFLOW_PREFIX) else 422
        return error(request, status, f"{where}: {message}")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return error(request, exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return error(request, 500, f"{type(exc).__name__}: {exc}")
