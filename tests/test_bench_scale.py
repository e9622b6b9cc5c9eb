"""benchmarks/scale.py at a tiny size (100 then 200 runs of 20 points, SQLite only, no MLflow):
its JSON's shape, that the filters select about the fractions they are named for, that the
planner answered every question, that the index holds every run, and that the plot is written;
benchmarks/bulk_end.py at its smallest size, on Postgres where the suite has one.

    pytest tests/test_bench_scale.py -q
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import scale  # noqa: E402
from scale_runs import FILTERS, make_run  # noqa: E402


def test_runs_are_the_same_on_every_call_and_filters_name_their_values():
    assert make_run(7, points=20) == make_run(7, points=20)
    run = make_run(7, points=20)
    assert sum(len(p) for p in run["metrics"].values()) == 20
    where = FILTERS["1%"].kb_where(3)
    assert where.count(" and ") == 1 and where.startswith("config.optim.lr = ")
    assert FILTERS["1%"].kb_where(3) != FILTERS["1%"].kb_where(4)


def test_the_sweep_filter_holds_ten_runs_of_one_project_at_every_size():
    from scale_runs import sweep_tag
    runs = [make_run(i, points=4) for i in range(500)]
    sweep = FILTERS["10 runs"]
    asked = {sweep.tag(r) for r in range(30)}
    assert len(asked) > 10
    for tag in asked:
        members = [r for r in runs if tag in r["tags"]]
        assert len(members) == 10 and len({r["project"] for r in members}) == 1
    assert sweep.kb_where(0).startswith("tags.") and sweep.kb_where(0).endswith(" = true")
    assert sweep_tag(500_000) not in {sweep_tag(i) for i in range(500)}     # new runs, new sweeps


@pytest.mark.slow
def test_scale_benchmark_prints_its_figures_as_json(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KB_BENCH_POSTGRES_URL", raising=False)
    png = tmp_path / "growth.png"
    scale.main(["--sizes", "100,200", "--points-per-run", "20", "--mlflow-cap-s", "0", "--repeats", "3",
                "--ask-repeats", "1", "--real-cards", "16", "--plot", str(png), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert set(out) == {"setup", "measured", "stores", "targets"}
    assert list(out["stores"]) == ["sqlite"]
    steps = out["stores"]["sqlite"]["steps"]
    assert [s["runs"] for s in steps] == [100, 200]
    for step in steps:
        assert step["ingest"]["runs"] == 100 and step["ingest"]["points_per_s"] > 0
        assert 0 <= step["ingest"]["end_seconds"] <= step["ingest"]["seconds"]
        assert set(step["query"]) == set(FILTERS)
        assert all(q["p50_ms"] > 0 and q["p95_ms"] >= q["p50_ms"] for q in step["query"].values())
        assert 0.3 < step["query"]["50%"]["fraction"] < 0.7
        assert step["query"]["10%"]["fraction"] < 0.25
        assert 1 <= step["query"]["10 runs"]["matches"] <= 10       # sweeps are whole from 480 runs
        assert step["retrieval"]["chunks"] >= step["runs"] and step["retrieval"]["real_embeddings"] == 16
        assert step["ask"]["planned"] == step["ask"]["questions"] == 5
        assert step["sql_bytes_per_run"] > 0 and step["peak_rss_mb"] > 0
    growth = out["stores"]["sqlite"]["growth"]
    assert {"ingest_points_per_s", "runs_p50_ms[1%]", "retrieval_p50_ms", "ask_p50_ms"} <= set(growth)
    assert all("projection_at_1m" in g for g in growth.values())
    assert any(name.startswith("sqlite: kb runs --where") for name in out["targets"])
    assert png.stat().st_size > 10_000

    # a store measured again in a later run replaces its figures; the table and targets follow
    first, later = tmp_path / "first.json", tmp_path / "later.json"
    first.write_text("table\n" + json.dumps(out))
    again = json.loads(json.dumps(out))
    again["stores"]["sqlite"]["steps"][-1]["query"]["1%"]["p50_ms"] = 99.0
    again["stores"]["postgres"] = again["stores"]["sqlite"]
    later.write_text(json.dumps(again) + "\n")
    scale.main(["--combine", str(first), str(later), "--plot", str(tmp_path / "both.png"), "--json"])
    both = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(both["stores"]) == ["sqlite", "postgres"]
    assert both["stores"]["sqlite"]["steps"][-1]["query"]["1%"]["p50_ms"] == 99.0
    assert [c["file"] for c in both["setup"]["combined"]] == [str(first), str(later)]
    assert any(name.startswith("postgres: kb runs --where") for name in both["targets"])
    (tmp_path / "torn.json").write_text("not json\n")
    with pytest.raises(SystemExit, match="torn.json: last line is not the JSON"):
        scale.main(["--combine", str(tmp_path / "torn.json")])


def test_growth_fits_log_linear_and_flags_faster_than_log_n():
    def steps(ys):
        return [{"runs": n, "ingest": {"points_per_s": 1000}, "query": {"1%": {"p50_ms": y}}}
                for n, y in zip((1000, 10000, 100000), ys)]
    logn = scale.growth(steps([1 + math.log(n) for n in (1000, 10000, 100000)]))["runs_p50_ms[1%]"]
    assert logn["projection_at_1m"] == pytest.approx(1 + math.log(1_000_000), abs=1e-3)
    assert logn["within_log_n"]
    linear = scale.growth(steps([1.0, 10.0, 100.0]))["runs_p50_ms[1%]"]
    assert linear["power_exponent"] == pytest.approx(1.0) and not linear["within_log_n"]
    assert linear["power_law_at_1m"] == pytest.approx(1000.0)


@pytest.mark.skipif(not os.environ.get("KB_TEST_DATABASE_URL"), reason="bulk_end.py measures Postgres only")
def test_bulk_end_benchmark_prints_both_ways_and_their_ratio(capsys, monkeypatch):
    import bulk_end
    monkeypatch.setattr(sys, "argv", ["bulk_end.py", "--postgres", os.environ["KB_TEST_DATABASE_URL"],
                                      "--runs-per-project", "100", "--repeats", "1", "--json"])
    bulk_end.main()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    [size] = out["sizes"]
    assert size["runs_per_project"] == 100 and size["projects"] == 12
    assert size["one at a time"] > 0 and size["side by side"] > 0
    assert size["ratio"] == pytest.approx(size["one at a time"] / size["side by side"], rel=0.01)
