"""/api/hypotheses: list and read hypotheses, and the human gate (approve, reject).

    curl 'localhost:8000/api/hypotheses?status=proposed'
    curl -X POST localhost:8000/api/hypotheses/hyp-1a2b3c4d5e/approve -H 'Authorization: Bearer $TOKEN' \\
         -d '{"by": "alice", "reason": "cheap, clear ablation"}'
"""
from __future__ import annotations

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from kb.server.auth import writer
from kb.server.text import Text

router = APIRouter(prefix="/api/hypotheses", tags=["hypotheses"])


class Decision(BaseModel):
    model_config = ConfigDict(extra="forbid")
    by: Text = Field(min_length=1, max_length=200, pattern=r"\S", description="who decides")
    reason: Text = Field("", max_length=10_000, description="why, for whoever reads the history later")


@router.get("")
def list_hypotheses(request: Request,
                    status: Text | None = Query(None, description="proposed, approved, rejected, ..."),
                    project: Text | None = Query(None)):
    """Hypotheses, newest first: a list of SPEC's Hypothesis, as `kb hypotheses --json`."""
    return request.app.state.kb.hypotheses(status=status, project=project)


@router.get("/{hypothesis_id}")
def get_hypothesis(request: Request, hypothesis_id: Text):
    return request.app.state.kb.hypothesis(hypothesis_id)


@router.post("/{hypothesis_id}/approve", dependencies=writer)
def approve(request: Request, hypothesis_id: Text, body: Decision):
    """Record the decision to run it; the hypothesis after the decision, as `kb approve --json`."""
    return request.app.state.kb.approve(hypothesis_id, by=body.by, reason=body.reason)


@router.post("/{hypothesis_id}/reject", dependencies=writer)
def reject(request: Request, hypothesis_id: Text, body: Decision):
    return request.app.state.kb.reject(hypothesis_id, by=body.by, reason=body.reason)
