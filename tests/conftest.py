"""Shared fixtures: a fresh real database per test (SQLite, and Postgres when KB_TEST_DATABASE_URL
names one), real embedded Qdrant under tmp_path, and the real MiniLM model loaded once."""
from __future__ import annotations

import os
import uuid
from contextlib import contextmanager

import pytest
from sqlalchemy import text

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

PG_URL = os.environ.get("KB_TEST_DATABASE_URL")
BACKENDS = ["sqlite"] + (["postgres"] if PG_URL else [])


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true",
                     help="fuzz tests run 10,000+ cases each (KB_FUZZ_EXAMPLES, unless set)")


def pytest_configure(config):
    if config.getoption("--long"):
        os.environ.setdefault("KB_FUZZ_EXAMPLES", "10000")
    try:
        import torch
        torch.set_num_threads(1)     # two threads collapse when another process holds a core
    except ImportError:
        pass


@contextmanager
def database(backend: str, folder):
    """A fresh, empty database URL: a new SQLite file, or a new Postgres schema dropped afterwards."""
    if backend == "sqlite":
        yield f"sqlite:///{folder / 'kb.sqlite'}"
        return
    from sqlalchemy import create_engine
    schema = "t_" + uuid.uuid4().hex[:12]
    admin = create_engine(PG_URL.replace("postgresql://", "postgresql+psycopg://", 1)
                          if PG_URL.startswith("postgresql://") else PG_URL)
    with admin.begin() as conn:
        conn.execute(text(f'create schema "{schema}"'))
    sep = "&" if "?" in PG_URL else "?"
    try:
        yield f"{PG_URL}{sep}options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'drop schema "{schema}" cascade'))
        admin.dispose()


@pytest.fixture(params=BACKENDS)
def database_url(request, tmp_path):
    with database(request.param, tmp_path) as url:
        yield url


@pytest.fixture
def engine(database_url):
    from kb.db import make_engine, migrate
    eng = make_engine(database_url)
    migrate(eng)
    yield eng
    eng.dispose()


@pytest.fixture
def settings(tmp_path, database_url):
    from kb.settings import Settings
    return Settings(home=tmp_path / "home", database_url=database_url)


@pytest.fixture
def kb(settings):
    """A KnowledgeBase on a fresh real database, with an embedded index under tmp_path."""
    from kb.api import KnowledgeBase
    k = KnowledgeBase.open(settings)
    yield k
    k.close()
