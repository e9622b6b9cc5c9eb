"""CPU of an ingest's two single-threaded parts, this checkout against another commit, in one run.

    python benchmarks/ingest_cpu.py --against 5d57f39            # prepare and rebuild, both versions
    python benchmarks/ingest_cpu.py --against 5d57f39 --postgres postgresql://postgres@127.0.0.1/test
    python benchmarks/ingest_cpu.py --json                        # this checkout only, JSON last line

- prepare: what an ingest worker does per run (read a JSONL line, validate it, derive curve stats,
  anomalies, failures, field rows, card and packed curves: NativeIngester.read + kb.runs.prepare_run),
  over --runs runs of benchmarks/synth.py (3 curves x 200 points), CPU time per run, the best of
  --passes passes in one process;
- rebuild: kb.ablation_store.rebuild of three projects of benchmarks/scale_runs.py runs (--rebuild-runs
  in the store, 12 projects), each in a transaction rolled back, wall time, the best of --passes.

Each version runs in its own child process importing that version's code (a git worktree for
--against, removed after); the data comes from this checkout's generators, so both see the same
runs. The versions take turns --repeats times, so load elsewhere weighs on both; the figure of a
version is its best turn, and the ratio is the other version's over this checkout's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REBUILT = ("gpt-small", "lr-sweep", "distill")


def child_prepare(n: int, passes: int) -> dict:
    from ingest_scale import write
    from synth import make_runs

    from ingest.native import NativeIngester
    from kb.runs import prepare_run
    path = write(Path(tempfile.mkdtemp()) / "runs.jsonl", make_runs(n))
    reader = NativeIngester()

    def once() -> float:
        t = time.process_time()
        for item in reader.read(path):
            prepare_run(item.record, item.source_kind, item.source_uri)
        return time.process_time() - t
    once()          # imports, caches
    return {"prepare_ms_per_run": round(min(once() for _ in range(passes)) / n * 1000, 4)}


def child_rebuild(n: int, passes: int, postgres: str | None) -> dict:
    from ingest_scale import knowledge_base
    from scale_runs import make_run

    from kb import ablation_store
    with knowledge_base(Path(tempfile.mkdtemp()), "kb", postgres) as k:
        for start in range(0, n, 1000):
            k.ingest_records([make_run(i) for i in range(start, min(n, start + 1000))], index=False)

        def once() -> float:
            t = time.perf_counter()
            for project in REBUILT:
                with k.engine.connect() as conn:
                    tx = conn.begin()
                    ablation_store.rebuild(conn, project)
                    tx.rollback()
            return time.perf_counter() - t
        once()
        return {"rebuild_s": round(min(once() for _ in range(passes)), 4)}


def run_child(root: Path, args, what: str) -> dict:
    cmd = [sys.executable, str(HERE / "ingest_cpu.py"), "--child", what, "--root", str(root),
           "--runs", str(args.runs), "--rebuild-runs", str(args.rebuild_runs), "--passes", str(args.passes)]
    if what == "rebuild-pg":
        cmd += ["--postgres", args.postgres]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{what} at {root}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", metavar="REV", help="a commit to measure beside this checkout")
    ap.add_argument("--runs", type=int, default=1000, help="runs prepared per pass")
    ap.add_argument("--rebuild-runs", type=int, default=6000, help="runs in the store whose projects are rebuilt")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2, help="turns each version takes")
    ap.add_argument("--postgres", metavar="URL", default=os.environ.get("KB_BENCH_POSTGRES_URL"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", choices=("prepare", "rebuild", "rebuild-pg"), help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        sys.path[:0] = [str(args.root), str(HERE)]
        if args.child == "prepare":
            print(json.dumps(child_prepare(args.runs, args.passes)))
        else:
            print(json.dumps(child_rebuild(args.rebuild_runs, args.passes,
                                           args.postgres if args.child == "rebuild-pg" else None)))
        return

    repo = HERE.parent
    versions = {"this checkout": repo}
    worktree = None
    if args.against:
        worktree = Path(tempfile.mkdtemp()) / "against"
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(worktree), args.against],
                       check=True, capture_output=True)
        versions[args.against] = worktree
    kinds = ["prepare", "rebuild"] + (["rebuild-pg"] if args.postgres else [])
    best: dict[str, dict[str, float]] = {v: {} for v in versions}
    try:
        for _ in range(args.repeats):
            for kind in kinds:
                for name, root in versions.items():
                    for key, value in run_child(root, args, kind).items():
                        key = key.replace("rebuild_s", "rebuild_pg_s") if kind == "rebuild-pg" else key
                        best[name][key] = min(value, best[name].get(key, value))
    finally:
        if worktree:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(worktree)], capture_output=True)
    labels = {"prepare_ms_per_run": f"prepare, ms CPU a run ({args.runs} synth runs)",
              "rebuild_s": f"rebuild of 3 of 12 projects, s ({args.rebuild_runs} runs, SQLite)",
              "rebuild_pg_s": f"rebuild of 3 of 12 projects, s ({args.rebuild_runs} runs, Postgres)"}
    result: dict = {"versions": best}
    for key, label in labels.items():
        if key not in best["this checkout"]:
            continue
        line = f"{label}: this checkout {best['this checkout'][key]}"
        if args.against:
            theirs = best[args.against][key]
            ratio = round(theirs / best["this checkout"][key], 3)
            result.setdefault("ratio_against", {})[key] = ratio
            line += f", {args.against} {theirs}: {ratio}x"
        print(line)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
