"""`kb migrate --to URL`: a knowledge base moved into another database reads back the same (runs,
curves, ablations, notes, hypotheses, jobs), takes new writes there (PostgreSQL's id sequences
moved past the copied ids), answers searches after `kb reindex`, and a target already in use is
refused with nothing written. Every pair of SQLite and Postgres (when KB_TEST_DATABASE_URL is set).

    pytest tests/test_store_copy.py -q
"""
from __future__ import annotations

import json
import random

import pytest

from kb.api import KnowledgeBase
from kb.cli import main
from kb.settings import Settings
from tests.conftest import BACKENDS, database
from tests.test_field_terms import assert_terms_follow_fields
from tests.test_propose import PROJECT, lr_history

NOTE = "# Sweep notes\n\nThe 2.5e-3 runs diverged after warmup; we capped lr at 1e-3.\n"


@pytest.mark.slow
@pytest.mark.parametrize("target_backend", BACKENDS)
def test_a_knowledge_base_moves_whole_and_keeps_working(kb, tmp_path, target_backend, capsys):
    assert kb.ingest_records(lr_history(random.Random(5)), index=False).failed == []
    (tmp_path / "notes.md").write_text(NOTE)
    kb.ingest(str(tmp_path / "notes.md"), index=False)
    [hyp] = kb.propose(goal="lower val/loss", n=1, project=PROJECT)
    kb.approve(hyp["id"], by="ana", reason="worth a try")
    jobs = kb.submit(hyp["id"], backend="inline")
    before = {r.id: kb.run(r.id).as_dict() for r in kb.runs()}
    assert any(detail["ablations"] for detail in before.values())      # the copy has ablations to carry
    source_home = kb.settings.home
    with database(target_backend, tmp_path / "target") as url:
        argv = ["--home", str(source_home), "--database-url", str(kb.settings.sql_url), "migrate", "--to", url, "--json"]
        assert main(argv) == 0
        copied = json.loads(capsys.readouterr().out)["copied"]
        assert copied["run"] == len(before) and copied["metricseries"] > 0 and copied["note"] >= 1
        target = KnowledgeBase.open(Settings(home=tmp_path / "target-home", database_url=url))
        try:
            assert {r.id: target.run(r.id).as_dict() for r in target.runs()} == before
            assert target.hypothesis(hyp["id"]) == kb.hypothesis(hyp["id"])
            assert target.jobs() == kb.jobs() and {j["id"] for j in jobs} <= {j["id"] for j in target.jobs()}
            # new writes: curve points and ablation rows get ids past the copied ones
            extra = lr_history(random.Random(6))[0] | {"id": "after-move"}
            assert target.ingest_records([extra]).failed == []
            assert "after-move" in {r.id for r in target.runs()}
            if target.engine.dialect.name == "postgresql":      # the copied fields brought their terms
                assert assert_terms_follow_fields(target.engine)
            target.reindex()
            hits = target.search("diverged after warmup capped lr", limit=3, kind="note")
            assert hits and hits[0].payload.get("kind") == "note"
        finally:
            target.close()
        assert main(argv) == 1                            # in use now: refused, nothing written
        assert "already holds" in capsys.readouterr().err
        again = KnowledgeBase.open(Settings(home=tmp_path / "target-home", database_url=url))
        assert len(again.runs()) == len(before) + 1
        again.close()


def test_a_bad_target_url_is_an_input_error(kb, capsys):
    assert main(["--home", str(kb.settings.home), "migrate", "--to", "not a url"]) == 2
    assert "--to" in capsys.readouterr().err
