"""Ablations found on ingest: one-key differences, seed spread, tag ablations; shown and queryable."""
from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st
from sqlalchemy import text

from fuzzing import examples


def run(rid, final, *, norm="layernorm", lr=6e-4, seed=0, tags=(), project="p", extra=None):
    cfg = {"model": {"n_layer": 4, "norm": norm}, "optim": {"lr": lr}, "seed": seed} | (extra or {})
    return {"id": rid, "project": project, "config": cfg, "tags": list(tags),
            "metrics": {"val/loss": [[0, 9.0], [100, final]]}}


def ingest(kb, tmp_path, records):
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return kb.ingest(str(path), index=False)


def test_one_key_difference_with_seeds_is_an_ablation_with_spread(kb, tmp_path):
    records = [run(f"ln-{s}", 3.00 + 0.01 * s, seed=s, tags=["baseline"]) for s in range(3)]
    records += [run(f"rms-{s}", 2.90 + 0.01 * s, norm="rmsnorm", seed=s) for s in range(3)]
    records += [run("tiny-gain", 2.995, norm="scalenorm")]
    ingest(kb, tmp_path, records)
    detail = kb.run("rms-1")
    [abl] = [a for a in detail.ablations if a["factor"] == "config.model.norm"]
    assert abl["baseline_run"] == "ln-0" and abl["metric"] == "val/loss"
    by_value = {v["value"]: v for v in abl["variants"]}
    assert by_value["layernorm"]["baseline"] and by_value["layernorm"]["seeds"] == 3
    assert abs(by_value["rmsnorm"]["delta"] - (-0.10)) < 1e-9
    assert abs(abl["effect"]["seed_sigma"] - 0.01) < 1e-9
    assert by_value["rmsnorm"]["exceeds_seed_spread"] is True       # 0.10 > 2 sigma
    assert by_value["scalenorm"]["exceeds_seed_spread"] is False    # 0.005 is inside the noise
    assert abl["effect"]["best"] == "rms-0"
    found = {r.id for r in kb.runs(where="ablations.norm.role = 'variant' and ablations.norm.exceeds_seed_spread = true")}
    assert found == {"rms-0", "rms-1", "rms-2"}
    assert {r.id for r in kb.runs(where="ablations.norm.delta < 0")} == {"rms-0", "rms-1", "rms-2", "tiny-gain"}


def test_seeds_whose_spread_passes_the_float_limit_leave_the_ablation_without_a_noise_verdict(kb, tmp_path):
    """Two seeds at -1e300 and 1e300: their variance (exact, by fractions) overflowed converting
    back to a float, inside the ablation refresh, so the ingest failed and every later one with it
    (found by tests/test_fuzz_native.py). Such a spread is no noise estimate: stored as none, on
    both databases (Postgres's JSON has no infinity), and so is a difference past the limit."""
    records = [run("huge-0", -1e300, seed=0), run("huge-1", 1e300, seed=1), run("other", 2.9, norm="rmsnorm"),
               run("far", 1.7e308, norm="scalenorm"), run("far-other", -1.7e308, norm="scalenorm", lr=1e-2)]
    report = ingest(kb, tmp_path, records)
    assert report.added == 5 and not report.failed
    [abl] = [a for a in kb.run("other").ablations if a["factor"] == "config.model.norm"]
    assert abl["effect"]["seed_sigma"] is None
    assert {v["value"]: v["exceeds_seed_spread"] for v in abl["variants"]}["rmsnorm"] is None
    [lr] = [a for a in kb.run("far").ablations if a["factor"] == "config.optim.lr"]
    assert [v["delta"] for v in lr["variants"] if not v["baseline"]] == [None]       # 1.7e308 - -1.7e308
    assert ingest(kb, tmp_path, [run("later", 3.0, lr=1e-3)]).added == 1     # the queue is not stuck


def test_two_key_difference_is_not_a_single_factor_ablation(kb, tmp_path):
    ingest(kb, tmp_path, [run("a", 3.0), run("b", 2.9, norm="rmsnorm", lr=1e-3)])
    assert kb.run("a").ablations == []
    assert kb.runs(where="ablations exists") == []


def test_tagged_runs_form_an_ablation_even_when_several_keys_differ(kb, tmp_path):
    records = [run("base", 3.0, tags=["ablation:recipe", "baseline"]),
               run("new", 2.8, norm="rmsnorm", lr=1e-3, tags=["ablation:recipe"])]
    ingest(kb, tmp_path, records)
    [abl] = kb.run("new").ablations
    assert abl["factor"] == "recipe" and abl["baseline_run"] == "base"
    new = next(v for v in abl["variants"] if v["run"] == "new")
    assert new["value"] == {"model.norm": "rmsnorm", "optim.lr": 1e-3}
    assert abs(new["delta"] + 0.2) < 1e-9
    assert {r.id for r in kb.runs(where="ablations.recipe.role = 'variant'")} == {"new"}


def test_ablations_follow_updates_and_stay_per_project(kb, tmp_path):
    ingest(kb, tmp_path, [run("x1", 3.0), run("x2", 2.9, lr=1e-3), run("y1", 3.0, project="other")])
    assert len(kb.run("x1").ablations) == 1 and kb.run("y1").ablations == []
    ingest(kb, tmp_path, [run("x1", 3.0), run("x2", 2.9, lr=1e-3, norm="rmsnorm"), run("y1", 3.0, project="other")])
    assert kb.run("x1").ablations == []


def test_an_ablation_keeps_its_id_as_runs_join_it_so_citations_of_it_hold(kb, tmp_path):
    ingest(kb, tmp_path, [run("b0", 3.0), run("v0", 2.9, lr=1e-3)])
    [first] = kb.run("v0").ablations
    ingest(kb, tmp_path, [run("b1", 3.02, seed=1), run("w0", 2.95, lr=2e-3)])       # a seed, a variant
    [now] = kb.run("v0").ablations
    assert now["id"] == first["id"] and {v["value"] for v in now["variants"]} == {6e-4, 1e-3, 2e-3}
    assert kb.report(first["id"], out=tmp_path / "r").markdown.exists()       # what cited it finds it
    assert {r.id for r in kb.runs(where=f"ablations.lr.id = '{first['id']}'")} == {"b0", "b1", "v0", "w0"}
    # the same configs in another project are another ablation
    ingest(kb, tmp_path, [run("o0", 3.0, project="other"), run("o1", 2.9, lr=1e-3, project="other")])
    assert kb.run("o1").ablations[0]["id"] != first["id"]


def test_ablations_recorded_before_0014_are_renamed_by_the_next_refresh(kb, tmp_path):
    ingest(kb, tmp_path, [run("b0", 3.0), run("v0", 2.9, lr=1e-3)])
    [abl] = kb.run("v0").ablations
    with kb.engine.begin() as conn:         # as an older version left it: an id of its members
        links = conn.execute(text("SELECT run_id FROM ablationrun")).scalars().all()
        conn.execute(text("DELETE FROM ablationrun"))
        conn.execute(text("UPDATE ablation SET id = 'abl-config.optim.lr-0123456789'"))
        for rid in links:
            conn.execute(text("INSERT INTO ablationrun (run_id, ablation_id) VALUES (:r, 'abl-config.optim.lr-0123456789')"),
                         {"r": rid})
        conn.execute(text("INSERT INTO ablationpending (project) SELECT DISTINCT project FROM run"))    # 0014
    from kb.ablation_store import refresh_all
    refresh_all(kb.engine)
    assert [a["id"] for a in kb.run("v0").ablations] == [abl["id"]]
    assert {r.id for r in kb.runs(where=f"ablations.lr.id = '{abl['id']}'")} == {"b0", "v0"}


# ---- incremental refresh: the same ablations as a recomputation from scratch ---------------------

KEYS = {"a": {"x": (1, 2)}, "b": {"x": ("u", "v")}, "y": (0.1, 0.2, 0.3), "z": (True, None)}


def _config(draw_value, keep) -> dict:
    """A small config over KEYS: nested `a.x` and `b.x` share the name x; some keys left out."""
    out = {}
    for k, v in KEYS.items():
        if not keep(k):
            continue
        out[k] = {kk: draw_value(vv) for kk, vv in v.items()} if isinstance(v, dict) else draw_value(v)
    return out


@st.composite
def histories(draw):
    """Batches of records into projects p and q: new runs and rewrites of earlier ones (another
    config, loss, tags, or project), so runs join, leave and move between ablations."""
    batches, ids = [], []
    for _ in range(draw(st.integers(1, 4))):
        batch = []
        for _ in range(draw(st.integers(1, 6))):
            rid = draw(st.sampled_from(ids)) if ids and draw(st.booleans()) else f"r{len(ids)}"
            if rid not in ids:
                ids.append(rid)
            cfg = _config(lambda vals: draw(st.sampled_from(vals)), lambda k: draw(st.integers(0, 5)) > 0)
            cfg["seed"] = draw(st.integers(0, 1))
            tags = draw(st.lists(st.sampled_from(["ablation:x", "ablation:y", "ablation:recipe", "baseline"]),
                                 max_size=3))
            batch.append({"id": rid, "project": draw(st.sampled_from(["p", "q"])), "config": cfg, "tags": tags,
                          "metrics": {"val/loss": [[0, 9.0], [10, draw(st.sampled_from([2.5, 2.75, 3.0]))]]}})
        batches.append(batch)
    return batches


def _state(kb, project):
    from kb.ablation_store import snapshot
    with kb.engine.connect() as conn:
        return snapshot(conn, project)


def _rebuilt(kb, project):
    from kb.ablation_store import rebuild
    with kb.engine.begin() as conn:
        rebuild(conn, project)
    return _state(kb, project)


def reference(runs: list[dict]) -> set[tuple]:
    """The definition, written plainly: (factor, member ids) of every config ablation, each pair
    of configs compared key by key (no hashes, no buckets)."""
    def sig(r):
        from kb.fields import canonical, leaves
        return {canonical(p): json.dumps(v) for p, v in leaves(r["config"]) if p[-1] != "seed"}
    sigs = {r["id"]: sig(r) for r in runs}
    out = set()
    for k in sorted({k for s in sigs.values() for k in s}):
        classes: dict[str, set] = {}
        for rid, s in sigs.items():
            rest = json.dumps({kk: v for kk, v in s.items() if kk != k}, sort_keys=True)
            classes.setdefault(rest, set()).add(rid)
        for members in classes.values():
            values = {sigs[m].get(k) for m in members}
            if len(values) >= 2:
                out.add((f"config.{k}", frozenset(members)))
    return out


# the incremental refresh against a rebuild that writes its bucket rows from a thread (as a
# project of THREADED_REBUILD_MIN runs does), a whole rebuild against one that does not, and
# each batch as a bulk load (every project mostly queued is rebuilt, side by side on Postgres)
@pytest.mark.parametrize("rebuild_max,threaded_min,bulk", [(0, 0, False), (5000, 10**9, False), (0, 10**9, True)],
                         ids=["incremental", "whole-when-mostly-new", "bulk"])
@hsettings(max_examples=examples(15), deadline=None, suppress_health_check=list(HealthCheck))
@given(history=histories())
def test_incremental_refresh_equals_recomputation(kb, history, rebuild_max, threaded_min, bulk, monkeypatch):
    import kb.ablation_store as store
    import kb.ablation_bulk as side_by_side
    monkeypatch.setattr(store, "WHOLE_REBUILD_MAX", rebuild_max)    # 0: never rebuilt whole
    monkeypatch.setattr(store, "THREADED_REBUILD_MIN", threaded_min)
    monkeypatch.setattr(side_by_side, "SIDE_BY_SIDE_MIN", 1)
    with kb.engine.begin() as conn:          # one database for every example: start each empty
        for table in ("ablationrun", "ablation", "ablationsig", "ablationpending", "runfield", "run"):
            conn.execute(text(f"DELETE FROM {table}"))
    latest: dict[str, dict] = {}
    for batch in history:
        with kb.bulk() if bulk else contextlib.nullcontext():
            report = kb.ingest_records(batch, index=False)
        assert report.failed == []
        for r in batch:
            latest[r["id"]] = r
        for project in ("p", "q"):
            incremental = _state(kb, project)
            assert incremental == _rebuilt(kb, project)
            runs = [r for r in latest.values() if r["project"] == project]
            stored = {(a["factor"], frozenset(x for v in a["variants"] for x in v["runs"]))
                      for a in incremental["ablations"].values() if a["bucket"] is not None}
            assert stored == reference(runs)


def test_a_run_queued_before_a_crash_is_refreshed_by_the_next_ingest(kb, tmp_path):
    """Runs committed but never refreshed (the process died in between) are taken up later."""
    from kb.db import WriteBatch
    from kb.records import parse_run
    from kb.runs import write_run
    with WriteBatch(kb.engine) as batch:       # the ingest's write, with no refresh after it
        for rec in (run("c1", 3.0), run("c2", 2.9, lr=1e-3)):
            with batch.record() as s:
                write_run(s, parse_run(rec), "native", "crashed.jsonl")
    assert kb.run("c1").ablations == []
    ingest(kb, tmp_path, [run("other", 3.0, project="elsewhere")])
    assert [a["factor"] for a in kb.run("c1").ablations] == ["config.optim.lr"]
    assert _state(kb, "p") == _rebuilt(kb, "p")


def test_a_bulk_load_is_refreshed_in_several_transactions(kb, tmp_path, monkeypatch):
    """refresh_all takes the queue REFRESH_BATCH entries at a time (SQLite's write lock is held
    about a second at a time); the ablations come out whole all the same."""
    import kb.ablation_store as store
    monkeypatch.setattr(store, "REFRESH_BATCH", 2)
    monkeypatch.setattr(store, "WHOLE_REBUILD_MAX", 0)      # the incremental path, batch by batch
    records = [run(f"b{s}-{lr}-{norm}", 3.0 - lr * 100 + 0.01 * s, lr=lr, seed=s, norm=norm)
               for s in range(2) for lr in (1e-3, 2e-3) for norm in ("layernorm", "rmsnorm")]
    ingest(kb, tmp_path, records + [run("tagged", 2.0, lr=5e-3, tags=["ablation:recipe"]),
                                    run("tagged2", 2.1, norm="x", tags=["ablation:recipe"])])
    with kb.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM ablationpending")).scalar() == 0
    state = _state(kb, "p")
    assert len(state["ablations"]) == 5 and state == _rebuilt(kb, "p")


def test_a_project_mostly_queued_is_rebuilt_whole_in_one_refresh(kb, tmp_path):
    """A bulk load of a new project: the first refresh rebuilds it and takes all its entries; a
    project with one run queued among many is refreshed incrementally, its one entry taken."""
    from kb.ablation_store import refresh
    from kb.db import WriteBatch
    from kb.records import parse_run
    from kb.runs import write_run
    ingest(kb, tmp_path, [run(f"old{i}", 3.0 - i / 100, lr=1e-4 * (i + 1)) for i in range(4)])

    def queue(records):                         # written and queued, not yet refreshed
        with WriteBatch(kb.engine) as batch:
            for rec in records:
                with batch.record() as s:
                    write_run(s, parse_run(rec), "native", "bulk.jsonl")

    queue([run(f"new{i}", 3.0 - i / 100, lr=1e-4 * (i + 1), project="fresh") for i in range(4)]
          + [run("old-rms", 2.95, norm="rmsnorm")])
    pending = lambda conn: conn.execute(text("SELECT count(*) FROM ablationpending")).scalar()  # noqa: E731
    with kb.engine.begin() as conn:
        assert pending(conn) == 5
        assert refresh(conn, 1) == 1            # one entry read: "fresh"'s four taken with it
        assert pending(conn) == 1
        assert refresh(conn) == 1 and pending(conn) == 0
    for project in ("fresh", "p"):
        state = _state(kb, project)
        assert state["ablations"] and state == _rebuilt(kb, project)


def test_a_run_moved_into_a_project_a_bulk_load_rebuilds_leaves_its_old_ablations(kb):
    """The rebuild of the project a run moved to leaves the old project's ablations alone; the
    run's membership there is refreshed away all the same."""
    with kb.bulk():
        kb.ingest_records([run("a1", 3.0), run("a2", 2.9, lr=1e-3), run("a3", 2.8, lr=2e-3)], index=False)
    with kb.bulk():     # "b" is all new: rebuilt whole
        kb.ingest_records([run("a1", 3.0, project="b"), run("b2", 2.9, lr=1e-3, project="b"),
                           run("b3", 2.9, lr=3e-3, project="b")], index=False)
    [old] = _state(kb, "p")["ablations"].values()
    assert sorted(r for v in old["variants"] for r in v["runs"]) == ["a2", "a3"]
    assert _state(kb, "p") == _rebuilt(kb, "p") and _state(kb, "b") == _rebuilt(kb, "b")
    [held] = kb.run("a1").ablations
    assert {r for v in held["variants"] for r in v["runs"]} == {"a1", "b2", "b3"}


@pytest.mark.parametrize("forked", [True, False], ids=["processes", "threads"])
def test_big_projects_of_a_bulk_load_are_rebuilt_side_by_side_on_postgres(kb, monkeypatch, tmp_path, forked):
    """Postgres: two workers (forked processes, or threads where a fork is unsafe) rebuild the big
    mostly-new projects; one linked to another by a moved run, and one whose rebuild failed
    there, are rebuilt after, alone. SQLite: one at a time. Either way, as a serial rebuild."""
    import os
    import threading

    import kb.ablation_bulk as side_by_side
    import kb.ablation_store as store
    from sqlalchemy.exc import IntegrityError
    monkeypatch.setattr(side_by_side, "SIDE_BY_SIDE_MIN", 20)
    safe = side_by_side.fork_is_safe
    monkeypatch.setattr(side_by_side, "fork_is_safe", lambda: forked and safe())
    with kb.bulk():
        kb.ingest_records(_sweep("old-", 30, "old"), index=False)
    assert kb.run("old-5").ablations
    log = tmp_path / "rebuilds.txt"              # written by the workers, whichever process they are
    here, inner = os.getpid(), store.rebuild

    def rebuild(conn, project):
        beside = os.getpid() != here or threading.current_thread().name.startswith("kb-rebuild")
        with open(log, "a") as f:
            f.write(f"{project} {beside} {os.getpid()}\n")
        if project == "conflict" and beside:
            raise IntegrityError("COPY runfield", None, Exception("duplicate key"))     # as a writer's would
        return inner(conn, project)
    monkeypatch.setattr(side_by_side, "rebuild", rebuild)
    monkeypatch.setattr(store, "rebuild", rebuild)
    with kb.bulk():
        moved = run("old-5", 2.5, lr=1e-4, seed=99, project="moved-to")       # an "old" run until now
        kb.ingest_records(_sweep("x-", 40, "x") + _sweep("y-", 30, "y") + _sweep("c-", 25, "conflict")
                          + _sweep("m-", 30, "moved-to") + [moved] + _sweep("s-", 5, "small"), index=False)
    projects = ("x", "y", "conflict", "moved-to", "old", "small")
    rebuilt = [line.split() for line in log.read_text().splitlines()]
    how = {p: [beside == "True" for q, beside, _ in rebuilt if q == p] for p in projects}
    if kb.engine.dialect.name == "postgresql":
        assert how["x"] == how["y"] == [True] and how["conflict"] == [True, False]     # redone alone
        assert {pid != str(here) for _, beside, pid in rebuilt if beside == "True"} == {forked}
    else:
        assert how["x"] == how["y"] == how["conflict"] == [False]
    assert how["moved-to"] == how["small"] == [False] and how["old"] == []
    with kb.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM ablationpending")).scalar() == 0
    monkeypatch.setattr(store, "rebuild", inner)
    for project in projects:
        assert _state(kb, project) == _rebuilt(kb, project), project
    assert "old-5" not in {r for a in _state(kb, "old")["ablations"].values() for v in a["variants"] for r in v["runs"]}


def test_a_queued_project_is_recomputed_whole(kb, tmp_path):
    """What migration 0007 does for the ablations found before it: the project is queued whole."""
    from kb.ablation_store import queue_project, refresh
    ingest(kb, tmp_path, [run("w1", 3.0), run("w2", 2.9, lr=1e-3), run("w3", 2.8, norm="rmsnorm")])
    before = _state(kb, "p")
    with kb.engine.begin() as conn:            # as an older version left it: no buckets, no members
        for table in ("ablationrun", "ablationsig"):
            conn.execute(text(f"DELETE FROM {table}"))
        queue_project(conn, "p")
    with kb.engine.begin() as conn:
        assert refresh(conn) == 1
    assert _state(kb, "p") == before and before["members"] and before["sigs"]


@pytest.mark.slow
def test_a_run_with_20000_config_keys_ingests_with_its_ablations(kb, tmp_path):
    """Finding 8: ablations were found in time quadratic in config size (minutes at 20,000 keys)."""
    base = {f"layer{i}": {"width": 64 + i % 7, "act": "gelu"} for i in range(10_000)}   # 20,000 leaves
    records = []
    for rid, change, loss in (("base", {}, 3.0), ("wide", {"layer17": {"width": 512}}, 2.9),
                              ("relu", {"layer9999": {"act": "relu"}}, 3.1), ("twice", {"layer1": {"width": 1}, "layer2": {"width": 1}}, 3.3)):
        cfg = {k: dict(v, **change.get(k, {})) for k, v in base.items()}
        records.append({"id": rid, "project": "big", "config": cfg, "tags": ["baseline"] if rid == "base" else [],
                        "metrics": {"val/loss": [[0, 9.0], [100, loss]]}})
    ingest(kb, tmp_path, records)
    factors = {a["factor"]: a for a in kb.run("base").ablations}
    assert set(factors) == {"config.layer17.width", "config.layer9999.act"}
    wide = factors["config.layer17.width"]
    assert wide["baseline_run"] == "base" and {v["value"] for v in wide["variants"]} == {67, 512}
    assert kb.run("twice").ablations == []                  # two keys differ: no ablation
    assert {r.id for r in kb.runs(where="ablations.act.role = 'variant'")} == {"relu"}


@pytest.mark.parametrize("name", ["lr", "x.y", "wéird key", "ablations"])
def test_the_field_keys_a_refresh_reads_are_those_run_fields_writes(name):
    """The refresh reads a member's stored fields of one name by these keys, so they must be
    every key kb.ablations.run_fields can write for that name, whatever its values."""
    from kb.ablation_store import _field_keys
    from kb.ablations import run_fields
    from kb.fields import field_tuples
    for delta, exceeds in ((None, None), (0.25, True)):
        ablation = {"id": "abl-1", "factor": f"config.{name}" if name != "x.y" else name, "bucket": 1,
                    "variants": [{"runs": ["r1"], "baseline": True, "delta": delta, "exceeds_seed_spread": exceeds}]}
        written = field_tuples("r1", {"ablations": run_fields([ablation])["r1"]})
        assert sorted(key for _, key, *_ in written) == sorted(_field_keys(name))


def test_a_run_joining_one_ablation_leaves_its_members_other_fields_alone(kb, tmp_path):
    """The refresh redoes a member's fields of the changed ablation's name alone: its fields of
    other names stay as they were, and the store still equals a recomputation from scratch."""
    base = [run("b", 3.0), run("n", 2.9, norm="rmsnorm"), run("l", 2.8, lr=1e-3)]
    ingest(kb, tmp_path, base)
    norm_fields = text("SELECT key, text FROM runfield WHERE run_id = 'b' AND key LIKE 'ablations.norm.%'")
    with kb.engine.connect() as conn:
        before = dict(conn.execute(norm_fields).all())
    ingest(kb, tmp_path, [run("l2", 2.7, lr=3e-3)])          # joins b's lr ablation only
    with kb.engine.connect() as conn:
        after = dict(conn.execute(norm_fields).all())
    assert before == after and before
    assert {a["factor"] for a in kb.run("l2").ablations} == {"config.optim.lr"}
    assert _state(kb, "p") == _rebuilt(kb, "p")


# ---- KnowledgeBase.bulk: many calls, one refresh -------------------------------------------------

def _sweep(prefix: str, n: int, project: str = "p") -> list[dict]:
    return [run(f"{prefix}{i}", 3.0 - i / 100, lr=[1e-4, 3e-4, 1e-3][i % 3], seed=i // 3,
                norm=["layernorm", "rmsnorm"][i % 2], project=project) for i in range(n)]


def _pending(kb) -> int:
    with kb.engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM ablationpending")).scalar()


def test_a_bulk_block_refreshes_ablations_once_at_its_end(kb, monkeypatch):
    """Inside the block runs are stored and found, their ablations wait; at its end each mostly
    new project is rebuilt whole in a transaction of its own, whatever its size (the cap is set
    to 1 here), and the store equals a recomputation from scratch."""
    import kb.ablation_store as store
    monkeypatch.setattr(store, "WHOLE_REBUILD_MAX", 1)
    rebuilt, calls = [], [0]          # (project, the refresh call, i.e. transaction, it was in)
    real_rebuild, real_refresh = store.rebuild, store.refresh
    monkeypatch.setattr(store, "rebuild", lambda conn, p: rebuilt.append((p, calls[0])) or real_rebuild(conn, p))

    def counted(*args, **kwargs):
        calls[0] += 1
        return real_refresh(*args, **kwargs)
    monkeypatch.setattr(store, "refresh", counted)
    kb.ingest_records(_sweep("old", 3), index=False)              # one call: refreshed at once
    assert kb.run("old0").ablations and _pending(kb) == 0
    rebuilt.clear()
    with kb.bulk():
        kb.ingest_records(_sweep("a", 6), index=False)
        kb.ingest_records(_sweep("b", 6) + _sweep("q", 4, project="q"), index=False)
        assert {r.id for r in kb.runs(where="config.optim.lr = 0.0003")} >= {"a1", "b1", "b4"}
        assert kb.run("a1").ablations == [] and _pending(kb) == 16
    assert _pending(kb) == 0
    # each whole (15 of p's 18 runs are new), each in a refresh transaction of its own
    assert [p for p, _ in rebuilt] == ["p", "q"] and rebuilt[0][1] != rebuilt[1][1]
    for project in ("p", "q"):
        state = _state(kb, project)
        assert state["ablations"] and state == _rebuilt(kb, project)


def test_a_bulk_block_that_fails_still_refreshes_what_it_wrote(kb):
    with pytest.raises(RuntimeError, match="interrupted"):
        with kb.bulk():
            kb.ingest_records(_sweep("a", 6), index=False)
            with kb.bulk():                         # nested: the outer block's end does it
                kb.ingest_records(_sweep("b", 3), index=False)
            assert _pending(kb) == 9
            raise RuntimeError("interrupted")
    assert _pending(kb) == 0 and kb.run("b1").ablations
    assert _state(kb, "p") == _rebuilt(kb, "p")


def test_a_bulk_block_defers_only_its_own_thread_s_calls(kb):
    import threading
    with kb.bulk():
        kb.ingest_records(_sweep("a", 3), index=False)
        other = threading.Thread(target=kb.ingest_records, args=(_sweep("t", 3, project="t"),),
                                 kwargs={"index": False})
        other.start()
        other.join()
        # the other thread's call refreshed the queue as it ended: this block's runs with it
        assert _pending(kb) == 0 and kb.run("t0").ablations
        kb.ingest_records(_sweep("b", 3), index=False)
        assert _pending(kb) == 3
    assert _pending(kb) == 0 and _state(kb, "p") == _rebuilt(kb, "p")
