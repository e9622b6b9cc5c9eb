"""/api/ask and /api/propose: the agents, one at a time (they share one in-process LLM and the index).

    curl -X POST localhost:8000/api/ask -d '{"question": "Which learning rate diverged at 350M?"}'
    curl -X POST localhost:8000/api/propose -H 'Authorization: Bearer $TOKEN' -d '{"goal": "lower val/loss", "n": 3}'
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from kb.server.auth import writer
from kb.server.text import Text

router = APIRouter(prefix="/api", tags=["agents"])


class Question(BaseModel):
    model_config = ConfigDict(extra="forbid")
    question: Text = Field(min_length=1, max_length=10_000, pattern=r"\S",
                          examples=["Which learning rate diverged at 350M?"])


class ProposeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    goal: Text = Field("", max_length=10_000, description='what to improve, e.g. "lower val/loss at fixed compute"')
    n: int = Field(3, ge=1, le=50, description="hypotheses to propose at most")
    project: Text | None = Field(None, description="propose changes to this project's runs only")
    metric: Text | None = Field(None, description="the metric to improve (default: the goal's, else val/loss)")
    budget_runs: int | None = Field(None, ge=1, le=10_000, description="most training runs one plan may take")
    budget_flops: float | None = Field(None, gt=0, allow_inf_nan=False, description="most FLOPs one plan may take")


@router.post("/ask")
def ask(request: Request, body: Question):
    """An Answer: `{"answer", "citations": [{"kind", "id", "quote"}], "sql"}`, as `kb ask --json`."""
    state = request.app.state
    with state.lock:            # what other processes queued is searched too, as `kb ask` does
        state.kb.try_sync_index()
        return state.kb.ask(body.question).as_dict()


@router.post("/propose", dependencies=writer)
def propose(request: Request, body: ProposeRequest):
    """New hypotheses, stored with status `proposed`: a list of SPEC's Hypothesis, as `kb propose --json`."""
    options = body.model_dump(exclude={"goal", "n", "project"}, exclude_none=True)
    state = request.app.state
    with state.lock:
        return state.kb.propose(goal=body.goal, n=body.n, project=body.project, **options)
