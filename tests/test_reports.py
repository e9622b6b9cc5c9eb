"""Experiment reports (kb/reports.py, `kb report`) on SQLite and Postgres: every id a report cites
exists, and the report carries the noise-aware verdict (kb.verdicts.compare) and, where the change
was measured at several scales, the scale transfer.

    pytest tests/test_reports.py -q
"""
from __future__ import annotations

import json
import random
import re

import pytest

from kb.cli import main
from kb.errors import InsufficientData, NotFound, QueryError
from kb.hypotheses import apply_change
from tests.test_propose import PROJECT, lr_history, lr_run

NOISE = 0.004


def norm_runs(rng: random.Random) -> list[dict]:
    """RMSNorm against LayerNorm in one project at two scales, three seeds each; rmsnorm is better
    by 0.05 at 1e7 params and 0.03 at 1e8. One rmsnorm run at 1e8 diverged."""
    out = []
    for params, layers, gain in ((10_000_000, 4, 0.05), (100_000_000, 12, 0.03)):
        for norm in ("layernorm", "rmsnorm"):
            for seed in range(3):
                final = 3.4 - 0.2 * (layers / 4) - (gain if norm == "rmsnorm" else 0.0) + rng.gauss(0, NOISE)
                out.append({"id": f"{norm}-{layers}L-s{seed}", "project": "norms", "scale": {"params": params},
                            "config": {"model": {"n_layer": layers, "norm": norm}, "optim": {"lr": 6e-4},
                                       "seed": seed},
                            "metrics": {"val/loss": [[0, 9.0], [500, final + 0.4], [1000, round(final, 6)]]}})
    out.append({"id": "rmsnorm-12L-lr3e-3", "project": "norms", "scale": {"params": 100_000_000}, "status": "diverged",
                "config": {"model": {"n_layer": 12, "norm": "rmsnorm"}, "optim": {"lr": 3e-3}, "seed": 0},
                "metrics": {"val/loss": [[0, 9.0], [400, "NaN"]]},
                "failure": {"kind": "diverged", "step": 400, "message": "loss is NaN"}})
    return out


def existing_ids(kb) -> set[str]:
    from sqlalchemy import select

    from kb.models import Ablation
    with kb.engine.connect() as conn:
        ablations = set(conn.execute(select(Ablation.id)).scalars())
    return {r.id for r in kb.runs()} | ablations | {h["id"] for h in kb.hypotheses()}


def citations(text: str) -> set[str]:
    return set(re.findall(r"\[([^\[\]\s]+)\]", text))


def test_ablation_report_cites_what_exists_with_verdict_and_transfer(kb, tmp_path):
    kb.ingest_records(norm_runs(random.Random(0)), index=False)
    ablation = next(a for a in kb.run("rmsnorm-4L-s0").ablations if a["factor"] == "config.model.norm")
    report = kb.report(ablation["id"], out=tmp_path / "out", html=True)
    text = report.markdown.read_text()
    cited = citations(text)
    assert cited and cited <= existing_ids(kb), cited - existing_ids(kb)
    assert set(report.cited) == cited
    assert ablation["id"] in cited and {f"rmsnorm-4L-s{s}" for s in range(3)} <= cited
    verdict = next(v for v in report.verdicts if v.get("outcome") in ("better", "worse", "inconclusive")
                   and v["what"] != "scale transfer")
    assert verdict["outcome"] == "better" and "Verdict on config.model.norm = rmsnorm" in text and "**better**" in text
    low, high = verdict["interval"]
    assert low < verdict["delta"] < high < 0
    assert "## Scale transfer" in text
    transfer = next(v for v in report.verdicts if v["what"] == "scale transfer")
    assert transfer["target"] == pytest.approx(1e9) and transfer["outcome"] in (
        "holds", "grows", "shrinks", "vanishes", "reverses", "inconclusive")
    assert "diverged at step 400: loss is NaN [rmsnorm-12L-lr3e-3]" in text     # the variant level failed elsewhere
    assert (report.markdown.parent / "curves.png").stat().st_size > 1000
    page = report.html.read_text()
    assert "plotly" in page and "<table>" in page and (report.html.parent / "plotly.min.js").exists()


def test_hypothesis_report_before_and_after_its_runs(kb, tmp_path):
    rng = random.Random(7)
    kb.ingest_records(lr_history(rng), index=False)
    for _ in range(3):           # a later round raises lr to within 4x of a diverged run
        h = kb.propose(n=1, project=PROJECT)[0]
        if h["risks"]:
            break
        config = apply_change(kb.run(h["baseline_run"]).config, h["change"])
        config.pop("seed", None)
        kb.ingest_records([lr_run(f"{h['id']}-s{s}", config, s, rng, hypothesis=h["id"]) for s in (0, 1)],
                          index=False)
    assert h["risks"], "no proposal came near the diverged runs"
    before = kb.report(h["id"], out=tmp_path).markdown.read_text()
    assert "Not tested yet" in before and citations(before) <= existing_ids(kb)
    assert all(c in before for r in h["risks"] for c in citations(r))     # its risks, cited
    config = apply_change(kb.run(h["baseline_run"]).config, h["change"])
    config.pop("seed", None)
    kb.ingest_records([lr_run(f"{h['id']}-s{s}", config, s, rng, hypothesis=h["id"]) for s in (0, 1)], index=False)
    report = kb.report(h["id"], out=tmp_path)
    after = report.markdown.read_text()
    assert citations(after) <= existing_ids(kb)
    assert f"[{h['id']}-s0]" in after and f"[{h['baseline_run']}]" in after
    assert re.search(r"Verdict on .*: \*\*(better|worse|inconclusive)\*\*", after)
    assert report.verdicts[0]["outcome"] in ("better", "worse", "inconclusive")


def test_where_report_and_bad_requests(kb, tmp_path):
    kb.ingest_records(norm_runs(random.Random(1)), index=False)
    report = kb.report(where="project = 'norms' and scale.params < 5e7", out=tmp_path)
    text = report.markdown.read_text()
    assert citations(text) <= existing_ids(kb) and "model.norm=rmsnorm" in text
    assert "Verdict on the best configuration against the runner-up: **better**" in text
    with pytest.raises(QueryError, match="one thing"):
        kb.report("x", where="status = 'completed'", out=tmp_path)
    with pytest.raises(NotFound, match="no ablation or hypothesis 'abl-nope'"):
        kb.report("abl-nope", out=tmp_path)
    with pytest.raises(InsufficientData, match="no run matches"):
        kb.report(where="project = 'nope'", out=tmp_path)


def test_cli_report_json(settings, tmp_path, capsys):
    from kb.api import KnowledgeBase
    with KnowledgeBase.open(settings) as k:
        k.ingest_records(norm_runs(random.Random(2)), index=False)
    args = ["--home", str(settings.home), "--database-url", settings.database_url]
    capsys.readouterr()
    assert main([*args, "report", "--where", "project = 'norms'", "--out", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"markdown", "html", "figures", "cited", "verdicts"} and out["html"] is None
    assert out["markdown"].endswith("report.md") and out["cited"]
    assert main([*args, "report", "--out", str(tmp_path)]) == 2
    assert "one thing" in capsys.readouterr().err
