"""kb.record(kind, id) and the failure listings (kb/record_views.py), on SQLite and Postgres: what
a citation link opens and what the UI's Failures tab lists.

    pytest tests/test_record_views.py -q
"""
from __future__ import annotations

import pytest

from kb.errors import NotFound
from tests.test_ui_runs import DIVERGED, EVIDENCE, lr_sweep


def test_records_by_kind_and_id(kb, tmp_path):
    kb.ingest_records(lr_sweep(), index=False)
    doc = tmp_path / "postmortem.md"
    doc.write_text(f"# LR 5e-3 postmortem\n\nRun {DIVERGED} went NaN at step 300; lr 5e-3 is too high.\n")
    note_id = kb.ingest(str(doc), project="sweep", index=False).ids[0]

    note = kb.record("note", note_id)
    assert note["title"].startswith("LR 5e-3 postmortem") and "went NaN" in note["text"]
    assert note["source"]["uri"].endswith("postmortem.md") and note["mentions"] == [DIVERGED]

    failure = kb.failures()[0]
    assert kb.record("failure", failure["id"]) == failure
    assert failure["run_id"] == DIVERGED and failure["kind"] == "diverged" and failure["step"] == 300
    assert failure["evidence"].splitlines() == EVIDENCE and failure["run_status"] == "diverged"

    run = kb.record("run", "lr0.001-s0")
    assert run["id"] == "lr0.001-s0" and run["metrics"]["val/loss"][0][0] == 0
    ablation_id = run["ablations"][0]["id"]
    ablation = kb.record("ablation", ablation_id)
    assert ablation["factor"] == "config.optim.lr" and ablation["metric"] == "val/loss"
    assert {v["value"] for v in ablation["variants"]} >= {1e-4, 2e-4, 4e-4, 1e-3}

    for kind, ref in (("note", "nope"), ("ablation", "nope"), ("failure", "999"), ("failure", "x"), ("run", "nope"),
                      ("hypothesis", "h")):
        with pytest.raises(NotFound):
            kb.record(kind, ref)


def test_failures_and_anomalies_across_runs(kb):
    kb.ingest_records(lr_sweep(), index=False)
    assert kb.failure_counts() == {"failures": {"diverged": 1}, "anomalies": {"divergence": 1}}
    assert kb.failure_counts(project="other") == {"failures": {}, "anomalies": {}}
    assert [f["run_id"] for f in kb.failures(kind="diverged", project="sweep")] == [DIVERGED]
    assert kb.failures(kind="oom") == [] and kb.failures(project="other") == []
    anomaly, = kb.anomalies()
    assert anomaly["run_id"] == DIVERGED and anomaly["key"] == "val/loss" and anomaly["step"] == 300
    assert kb.anomalies(kind="plateau") == [] and len(kb.anomalies(limit=1)) == 1
