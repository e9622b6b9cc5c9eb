"""Bearer tokens. KB_API_TOKENS (comma-separated) may read and write; KB_API_READ_TOKENS may only
read. With no token set at all every request is allowed, because `kb serve` then listens on the
loopback interface only; with tokens set, writes need a write token, and reads need a token only
when read tokens are set. The UI at /ui asks for a write token as its password once any is set.

    Authorization: Bearer <token>            (MLflow's client sends it from MLFLOW_TRACKING_TOKEN)

The server keeps only SHA-256 digests of the tokens, and a token may be configured as its digest
(`sha256:<64 hex>`, what `kb token` prints), so the plain token need not be in the server's
environment at all. A presented token is hashed and compared with every digest in constant time.
"""
from __future__ import annotations

import hashlib
import hmac
import re
import secrets

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kb.errors import KBError, UnknownFormat

bearer = HTTPBearer(auto_error=False, description="a token from KB_API_TOKENS (read and write) or "
                                                  "KB_API_READ_TOKENS (read only), when set")
HASHED = re.compile(r"sha256:([0-9a-fA-F]{64})")
WRITE, READ = "write", "read"


class Unauthorized(KBError):
    """A request without a token good enough for it (HTTP 401)."""


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def hashed(token: str) -> str:
    """How to configure `token` without writing it down: `sha256:<hex>`."""
    return "sha256:" + digest(token).hex()


def new_token() -> str:
    return secrets.token_urlsafe(32)


class Tokens:
    """The configured tokens, as digests with their role."""

    def __init__(self, write: list[str], read: list[str] = ()):
        self._digests = [(self._digest_of(t, "KB_API_TOKENS"), WRITE) for t in write]
        self._digests += [(self._digest_of(t, "KB_API_READ_TOKENS"), READ) for t in read]
        self.writes_need_token = bool(self._digests)
        self.reads_need_token = any(role == READ for _, role in self._digests)

    @staticmethod
    def _digest_of(entry: str, variable: str) -> bytes:
        if entry.startswith("sha256:"):
            match = HASHED.fullmatch(entry)
            if not match:
                raise UnknownFormat(f"{variable}: an entry starting 'sha256:' must be 64 hex digits after it")
            return bytes.fromhex(match.group(1))
        return digest(entry)

    def __len__(self) -> int:
        return len(self._digests)

    def can_write(self, given: str) -> bool:
        return self.role(given) == WRITE

    def role(self, given: str) -> str | None:
        """WRITE, READ or None. Every digest is compared (no early exit), each in constant time,
        so the time taken tells nothing about which tokens exist."""
        presented = digest(given)
        found = None
        for stored, role in self._digests:
            if hmac.compare_digest(presented, stored) and found != WRITE:
                found = role
        return found


def _role(request: Request, credentials: HTTPAuthorizationCredentials | None) -> str | None:
    if credentials is None:
        return None
    return request.app.state.tokens.role(credentials.credentials)


def require_writer(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
    tokens: Tokens = request.app.state.tokens
    if not tokens.writes_need_token:
        return
    if credentials is None:
        raise Unauthorized("this server takes writes with a token: send Authorization: Bearer <token>")
    if _role(request, credentials) != WRITE:
        raise Unauthorized("the bearer token is not one of this server's write tokens (KB_API_TOKENS)")


def require_reader(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
    tokens: Tokens = request.app.state.tokens
    if not tokens.reads_need_token:
        return
    if credentials is None:
        raise Unauthorized("this server serves reads with a token: send Authorization: Bearer <token>")
    if _role(request, credentials) is None:
        raise Unauthorized("the bearer token is not one of this server's (KB_API_TOKENS, KB_API_READ_TOKENS)")


writer = [Depends(require_writer)]
reader = [Depends(require_reader)]
