"""Chinchilla's L(N, D) refitted from Epoch AI's reconstruction of its 240 runs, beside Epoch's own.

    python benchmarks/scaling_chinchilla.py               # ours and Epoch's side by side, fit time
    python benchmarks/scaling_chinchilla.py --json
    python benchmarks/scaling_chinchilla.py --starts 4500 # L-BFGS from every grid start (~4 min)

The points (../shared/data/chinchilla/points.csv, see its README) go in as runs through the real
table ingester into a fresh SQLite knowledge base, and the fit runs over the runs a query selects
(`config.excluded_by_epoch = 0`: the 240 that Epoch keeps), as `kb scaling fit --y loss --form
chinchilla --where ...` does. Epoch's refit (Besiroglu et al. 2024) is the reference: each of its
values should fall within our bootstrap interval, and ours within Epoch's. Exits 0 with a message
where the data folder is absent.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DATA = ROOT.parent / "shared" / "data" / "chinchilla"
WHERE = "config.excluded_by_epoch = 0"
# Besiroglu, Erdil, Barnett, You 2024 (arXiv 2404.10102): the refit and its 95% bootstrap intervals
EPOCH = {"E": (1.817, 1.769, 1.871), "A": (482.0, 285.0, 744.0), "alpha": (0.3478, 0.317, 0.373),
         "B": (2085.4, 1042.0, 5810.0), "beta": (0.3658, 0.331, 0.415)}
# their replication of Approach 3 as the paper describes it (Huber δ 1e-3, L-BFGS, 4,500 starts)
EPOCH_GRID = {"E": 1.8172, "A": 477.8, "alpha": 0.3473, "B": 2143.9, "beta": 0.3672}


def run(data: Path, draws: int, seed: int, starts: int) -> dict:
    from kb.api import KnowledgeBase
    from kb.scaling_points import fit_runs
    from kb.settings import Settings

    with tempfile.TemporaryDirectory() as home:
        k = KnowledgeBase.open(Settings(home=Path(home)))
        try:
            t = time.perf_counter()
            report = k.ingest(str(data / "points.csv"), format="table", index=False)
            ingest_s = time.perf_counter() - t
            runs = k.runs(where=WHERE)
            t = time.perf_counter()
            law = fit_runs(runs, y="loss", form="chinchilla", draws=draws, seed=seed, where=WHERE, starts=starts)
            fit_s = time.perf_counter() - t
        finally:
            k.close()
    ours = law.to_json()["params"]
    rows = {}
    for name, (value, low, high) in EPOCH.items():
        o = ours[name]
        rows[name] = {"ours": o, "epoch": {"value": value, "low": low, "high": high},
                      "epoch_grid": EPOCH_GRID[name],
                      "epoch_in_ours": o["low"] <= value <= o["high"],
                      "ours_in_epoch": low <= o["value"] <= high}
    optimal = {k: v.as_dict() for k, v in law.compute_optimal(5.76e23).items()}   # Gopher's budget
    return {"runs_ingested": report.added + report.unchanged + report.updated, "n": len(law.runs),
            "draws": draws, "seed": seed, "starts": starts, "ingest_s": round(ingest_s, 2),
            "fit_s": round(fit_s, 2), "residual": law.residual(), "params": rows,
            "compute_optimal_5.76e23": optimal,
            "all_within": all(r["epoch_in_ours"] and r["ours_in_epoch"] for r in rows.values())}


def main() -> int:
    from kb.scaling import DRAWS, REFINED_STARTS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA, help="folder holding points.csv")
    ap.add_argument("--bootstrap", type=int, default=DRAWS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--starts", type=int, default=REFINED_STARTS, help="grid starts L-BFGS runs from")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not (args.data / "points.csv").is_file():
        print(f"skipped: no Chinchilla points at {args.data / 'points.csv'}")
        return 0
    out = run(args.data, args.bootstrap, args.seed, args.starts)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{out['n']} of {out['runs_ingested']} runs ({WHERE}); {out['draws']} bootstrap draws, "
          f"L-BFGS-B from the best {out['starts']} of 4,500 grid starts")
    print(f"{'':6} {'ours':>9} {'ours 95% interval':>21}   {'Epoch':>8} {'Epoch 95% interval':>19}"
          f" {'Epoch grid':>10}  within")
    for name, r in out["params"].items():
        o, e = r["ours"], r["epoch"]
        print(f"{name:6} {o['value']:9.4g} {o['low']:10.4g}-{o['high']:<10.4g}   {e['value']:8.4g} "
              f"{e['low']:9.4g}-{e['high']:<9.4g} {r['epoch_grid']:10.4g}  "
              f"{'yes' if r['epoch_in_ours'] and r['ours_in_epoch'] else 'NO'}")
    opt = out["compute_optimal_5.76e23"]
    print(f"compute-optimal at 5.76e23 FLOPs: N {opt['params']['value']:.3g} "
          f"({opt['params']['low']:.3g}-{opt['params']['high']:.3g}), D {opt['tokens']['value']:.3g}, "
          f"{opt['tokens_per_param']['value']:.1f} tokens/param "
          f"({opt['tokens_per_param']['low']:.1f}-{opt['tokens_per_param']['high']:.1f})")
    print(f"ingest {out['ingest_s']:.2f} s; fit {out['fit_s']:.2f} s (grid + L-BFGS + bootstrap); "
          f"residual rmse(log) {out['residual']['rmse_log']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
