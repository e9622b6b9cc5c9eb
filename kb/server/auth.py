"""Bearer tokens for writes. Tokens come from KB_API_TOKENS (comma-separated); with none set every
write is allowed, because `kb serve` then listens on the loopback interface only.

    Authorization: Bearer <token>            (MLflow's client sends it from MLFLOW_TRACKING_TOKEN)
"""
from __future__ import annotations

import hmac

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kb.errors import KBError

bearer = HTTPBearer(auto_error=False, description="a token from KB_API_TOKENS; needed for writes when set")


class Unauthorized(KBError):
    """A write without a valid bearer token (HTTP 401)."""


def token_ok(given: str, tokens: list[str]) -> bool:
    """Compared in constant time against every token, so the time taken tells nothing about them."""
    given_bytes = given.encode("utf-8", "surrogatepass")
    matches = [hmac.compare_digest(given_bytes, t.encode("utf-8", "surrogatepass")) for t in tokens]
    return any(matches)


def require_writer(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
    tokens: list[str] = request.app.state.tokens
    if not tokens:
        return
    if credentials is None:
        raise Unauthorized("this server takes writes with a token: send Authorization: Bearer <token>")
    if not token_ok(credentials.credentials, tokens):
        raise Unauthorized("the bearer token is not one of this server's (KB_API_TOKENS)")


writer = [Depends(require_writer)]
