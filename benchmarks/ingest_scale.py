"""Ingest cost at scale: one run with a huge config, and one more run into a big project.

    python benchmarks/ingest_scale.py            # 5,000 and 20,000 config keys; 100 vs 10,000 runs
    python benchmarks/ingest_scale.py --quick    # 5,000 keys; 100 vs 1,000 runs
    python benchmarks/ingest_scale.py --json     # the figures as one JSON object, last line of stdout
    python benchmarks/ingest_scale.py --postgres postgresql://user@host/db   # Postgres too
                                                 # (or KB_BENCH_POSTGRES_URL; a scratch schema, dropped after)

Prints (1) the seconds `KnowledgeBase.ingest` takes for one run with N config keys, alone in
its project and beside a baseline it differs from in one key (so it forms an ablation there);
(2) the seconds per run of ingesting runs one call each (as `kb track` and the hooks do) into a
project that already holds 100, and one that holds 10,000 runs, in turn, with the part of it
spent in the ablation refresh, and the ratios. The project is a history of
experiments of ~8 runs each (a baseline, an lr sweep, a norm and a warmup change, seeds), and
every timed run joins an experiment, so each forms and changes ablations as a real one would;
the ablations a run joins have the same size at both scales, which is what a project's growth
leaves alone (one sweep that grows with the project costs in proportion to its size).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LRS = (1e-4, 3e-4, 6e-4, 1e-3, 2e-3)


@contextmanager
def knowledge_base(tmp: Path, name: str, postgres: str | None, schema: str | None = None):
    """A fresh KnowledgeBase: SQLite under tmp, or a scratch schema of the Postgres at `postgres`
    (dropped after); or, named by `schema`, a schema made if missing and kept (reused as it is)."""
    from kb.api import KnowledgeBase
    from kb.settings import Settings
    if not postgres:
        k = KnowledgeBase.open(Settings(home=tmp / name))
        try:
            yield k
        finally:
            k.close()
        return
    from sqlalchemy import create_engine, text
    admin = create_engine(postgres.replace("postgresql://", "postgresql+psycopg://", 1)
                          if postgres.startswith("postgresql://") else postgres)
    scratch = schema is None
    schema = schema or "bench_" + uuid.uuid4().hex[:12]
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
    sep = "&" if "?" in postgres else "?"
    k = KnowledgeBase.open(Settings(home=tmp / name, database_url=f"{postgres}{sep}options=-csearch_path%3D{schema}"))
    try:
        yield k
    finally:
        k.close()
        if scratch:
            with admin.begin() as conn:
                conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def write(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def timed_ingest(k, path: str) -> float:
    t = time.perf_counter()
    report = k.ingest(path, index=False)
    elapsed = time.perf_counter() - t
    assert not report.failed and report.added + report.updated == sum(1 for _ in open(path)), report.failed
    return elapsed


# ---- (1) one run, a huge config -------------------------------------------------------------


def big_config(keys: int, seed: int) -> dict:
    rng = random.Random(seed)
    return {f"block{i // 2}": {"width": rng.choice((64, 128, 256)), "act": rng.choice(("gelu", "relu"))}
            for i in range(0, keys, 2)}


def bench_big_config(tmp: Path, keys: int, postgres: str | None) -> dict:
    base = big_config(keys, seed=keys)
    variant = json.loads(json.dumps(base))
    variant["block7"]["width"] = 4096
    curve = {"val/loss": [[s, 3.0 + 1.0 / (1 + s)] for s in range(0, 200, 10)]}
    with knowledge_base(tmp, f"big-{keys}", postgres) as k:
        alone = timed_ingest(k, write(tmp / f"alone-{keys}.jsonl",
                                      [{"id": "alone", "project": "a", "config": base, "metrics": curve}]))
        k.ingest(write(tmp / f"base-{keys}.jsonl",
                       [{"id": "base", "project": "b", "config": base, "metrics": curve}]), index=False)
        beside = timed_ingest(k, write(tmp / f"variant-{keys}.jsonl",
                                       [{"id": "variant", "project": "b", "config": variant, "metrics": curve}]))
        [abl] = k.run("variant").ablations
        assert abl["factor"] == "config.block7.width", abl["factor"]
    print(f"config  one run, {keys:,} config keys: {alone:.2f} s alone, {beside:.2f} s beside its baseline "
          f"(one ablation found)")
    return {"keys": keys, "alone_s": round(alone, 3), "beside_baseline_s": round(beside, 3)}


# ---- (2) one more run into a big project ----------------------------------------------------


def experiment(e: int, rng: random.Random) -> list[dict]:
    """An experiment: a baseline, two more lrs, a norm change, a warmup change, two more seeds."""
    base = {"exp": e, "model": {"n_layer": rng.choice((4, 6, 8, 12)), "d_model": rng.choice((256, 384, 512, 768)),
                                "norm": "layernorm", "dropout": 0.0},
            "optim": {"lr": LRS[1], "beta2": rng.choice((0.95, 0.99)), "warmup": 500, "weight_decay": 0.1},
            "data": {"batch_size": rng.choice((128, 256, 512)), "mix": rng.choice(("web", "web+code"))}, "seed": 0}
    changes = [{}, {"optim": {"lr": LRS[0]}}, {"optim": {"lr": LRS[2]}}, {"model": {"norm": "rmsnorm"}},
               {"optim": {"warmup": 1000}}, {"seed": 1}, {"seed": 2}]
    return [record(e, i, base, change, rng) for i, change in enumerate(changes)]


def record(e: int, i: int, base: dict, change: dict, rng: random.Random) -> dict:
    cfg = json.loads(json.dumps(base))
    for k, v in change.items():
        if isinstance(v, dict):
            cfg[k].update(v)
        else:
            cfg[k] = v
    final = 3.0 + rng.gauss(0, 0.05)
    return {"id": f"e{e:05d}-{i}", "project": "history", "name": f"exp {e} run {i}", "config": cfg,
            "tags": ["baseline"] if i == 0 else [],
            "metrics": {"val/loss": [[s, final + 5.0 / (1 + s)] for s in range(0, 200, 10)]}}


class RefreshClock:
    """Seconds spent in the ablation refresh (kb.ablation_store.refresh_all, which the ingest
    looks up by name at its end), to tell it apart from the rest of an ingest."""

    def __init__(self):
        import kb.ablation_store as store
        self.store, self.inner, self.spent = store, store.refresh_all, []

    def __enter__(self):
        def refresh_all(engine):
            t = time.perf_counter()
            try:
                return self.inner(engine)
            finally:
                self.spent.append(time.perf_counter() - t)
        self.store.refresh_all = refresh_all
        return self

    def __exit__(self, *exc):
        self.store.refresh_all = self.inner


def fill(k, tmp: Path, size: int) -> tuple[list[dict], float]:
    rng = random.Random(size)
    history = [r for e in range(size // 7 + 1) for r in experiment(e, rng)][:size]
    t = time.perf_counter()
    k.ingest(write(tmp / f"history-{size}.jsonl", history), index=False)
    return history, time.perf_counter() - t


def new_run(history: list[dict], j: int, rng: random.Random) -> dict:
    """A new lr in a random experiment: it joins that experiment's lr sweep (an ablation of 4 configs)."""
    e = rng.randrange(len(history) // 7)
    return record(e, 100 + j, history[7 * e]["config"], {"optim": {"lr": 1e-3 + j * 1e-5}}, rng)


def bench_projects(tmp: Path, sizes: tuple[int, int], timed: int, postgres: str | None) -> dict:
    """Both projects filled, then runs ingested into each in turn (one call each), so what else
    the machine does weighs on both sizes alike."""
    out = {}
    with knowledge_base(tmp, f"project-{sizes[0]}", postgres) as small, \
            knowledge_base(tmp, f"project-{sizes[1]}", postgres) as large:
        kbs = {sizes[0]: small, sizes[1]: large}
        histories, times, refresh = {}, {n: [] for n in sizes}, {n: [] for n in sizes}
        for n, k in kbs.items():
            histories[n], filled = fill(k, tmp, n)
            out[n] = {"runs": n, "fill_s": round(filled, 1)}
        rng = random.Random(0)
        for j in range(timed):
            for n, k in kbs.items():
                new = new_run(histories[n], j, rng)
                with RefreshClock() as clock:
                    times[n].append(timed_ingest(k, write(tmp / f"new-{n}-{j}.jsonl", [new])))
                refresh[n] += clock.spent
                assert any(a["factor"] == "config.optim.lr" for a in k.run(new["id"]).ablations)
    for n in sizes:
        per_run, in_refresh = statistics.median(times[n]), statistics.median(refresh[n])
        out[n] |= {"per_run_ms": round(per_run * 1000, 1), "refresh_ms": round(in_refresh * 1000, 1)}
        print(f"project {n:,} runs already in it (filled in {out[n]['fill_s']:.1f} s): {per_run * 1000:.0f} ms "
              f"per run ingested, {in_refresh * 1000:.0f} ms of it the ablation refresh (medians of {timed}, "
              f"one call each)")
    return out


def run_all(tmp: Path, quick: bool, postgres: str | None, label: str) -> dict:
    print(f"-- {label}")
    keys = (5000,) if quick else (5000, 20000)
    sizes = (100, 1000) if quick else (100, 10000)
    out = {"config": [bench_big_config(tmp, n, postgres) for n in keys]}
    projects = bench_projects(tmp, sizes, 20 if quick else 40, postgres)
    small, large = projects[sizes[0]], projects[sizes[1]]
    ratio = large["per_run_ms"] / small["per_run_ms"]
    refresh_ratio = large["refresh_ms"] / small["refresh_ms"]
    print(f"project at {sizes[1]:,} runs / at {sizes[0]:,} runs: per-run ingest {ratio:.2f}, "
          f"ablation refresh {refresh_ratio:.2f}")
    out["project"] = {"small": small, "large": large, "ratio": round(ratio, 2), "refresh_ratio": round(refresh_ratio, 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON, the last line of stdout")
    ap.add_argument("--postgres", metavar="URL", default=os.environ.get("KB_BENCH_POSTGRES_URL"),
                    help="also measure on this Postgres (default: $KB_BENCH_POSTGRES_URL)")
    args = ap.parse_args()
    figures = {}
    with tempfile.TemporaryDirectory() as d:
        figures["sqlite"] = run_all(Path(d), args.quick, None, "SQLite")
        if args.postgres:
            figures["postgres"] = run_all(Path(d), args.quick, args.postgres, "Postgres")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
