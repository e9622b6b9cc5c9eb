"""/api/jobs: queue proxy trainings (an approved hypothesis's plan, or one config) and follow them.

    curl -X POST localhost:8000/api/jobs -H 'Authorization: Bearer $TOKEN' -d '{"hypothesis": "hyp-1a2b3c4d5e"}'
    curl localhost:8000/api/jobs/job-0123456789ab
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Query, Request
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, model_validator

from kb.server.auth import writer
from kb.server.text import Text

router = APIRouter(prefix="/api/jobs", tags=["jobs"])


class Submission(BaseModel):
    """One of `hypothesis` (approved) or `config` (runner/options.py names its keys), as `kb submit`."""
    model_config = ConfigDict(extra="forbid")
    hypothesis: Text | None = Field(None, description="an approved hypothesis: its plan is queued")
    config: dict[str, Any] | None = Field(None, description="a training config to run as one job")
    backend: Text = Field("local", description="local | ray | slurm | inline")
    scales: list[PositiveFloat] | None = Field(None, max_length=100, description="parameter counts to run at")
    seeds: int | None = Field(None, ge=1, description="seeds per side and scale")
    project: Text | None = Field(None, description="a config's project")
    name: Text | None = Field(None, description="a config's run name")
    max_attempts: int | None = Field(None, ge=1, le=1000, description="attempts per job before it fails")

    @model_validator(mode="after")
    def _names_are_for_configs(self):
        if self.hypothesis is not None and (self.project is not None or self.name is not None):
            raise ValueError("project and name are for a config; a hypothesis names its own")
        return self


def _runner(request: Request):
    k = request.app.state.kb
    if not hasattr(k, "submit"):     # the runner (runner/queue.py) is not in this install
        raise HTTPException(501, "jobs need the runner (KnowledgeBase.submit, runner/queue.py), "
                                 "which this install does not have")
    return k


@router.post("", dependencies=writer)
def submit(request: Request, body: Submission):
    """The jobs queued: a list of SPEC's Job, as `kb submit --json`."""
    k = _runner(request)
    options = body.model_dump(exclude={"hypothesis", "config"}, exclude_none=True)
    return k.submit(body.hypothesis, config=body.config, **options)


@router.get("")
def list_jobs(request: Request,
              status: Text | None = Query(None, description="queued, running, succeeded, failed, cancelled"),
              hypothesis: Text | None = Query(None)):
    """Jobs, oldest first, as `kb jobs --json`."""
    return _runner(request).jobs(status=status, hypothesis=hypothesis)


@router.get("/{job_id}")
def get_job(request: Request, job_id: Text):
    return _runner(request).job(job_id)


@router.post("/{job_id}/cancel", dependencies=writer)
def cancel(request: Request, job_id: Text):
    """Cancel a queued job now, or ask a running one to stop at its next check (`kb cancel`)."""
    return _runner(request).cancel(job_id)
