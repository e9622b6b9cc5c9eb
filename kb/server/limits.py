"""A cap on request bodies (KB_API_MAX_BODY_MB): a body over it is answered 413 before the app
parses any of it, whether it declared its length or came chunked.

    app.add_middleware(BodyLimit, max_bytes=64 << 20)
"""
from __future__ import annotations

import json

from starlette.exceptions import HTTPException


class BodyTooLarge(HTTPException):
    """Raised from `receive` mid-body: an HTTPException, so the app's own handler answers 413 when
    the route reads the body (FastAPI re-raises those unchanged), and this middleware does when
    nothing inside catches it."""

    def __init__(self, max_bytes: int):
        super().__init__(413, _message(max_bytes))


def _message(max_bytes: int) -> str:
    return f"request body over {max_bytes / (1 << 20):g} MiB (KB_API_MAX_BODY_MB)"


class BodyLimit:
    """Pure ASGI middleware: a declared Content-Length over the cap is refused at once; an
    undeclared (chunked) body is counted as it arrives and refused when it passes the cap."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, send)
        seen = 0
        started = False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(scope, send)

    async def _refuse(self, scope, send):
        message = _message(self.max_bytes)
        if scope.get("path", "").startswith("/api/2.0/mlflow"):
            body = {"error_code": "INVALID_PARAMETER_VALUE", "message": message}
        else:
            body = {"detail": message}
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})
