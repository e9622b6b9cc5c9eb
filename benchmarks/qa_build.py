"""The generated QA history (benchmarks/qa_history.py) as the files a team would have, ingested
the real way: runs.jsonl and notes/*.md through KnowledgeBase.ingest; an MLflow SQLite store written
by MlflowClient and a TensorBoard tree written by torch's SummaryWriter, both through `kb ingest`.

    build(kb, make_history("ci"), tmp_path / "sources")
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.qa_history import EPOCH, MLFLOW_PROJECT, TB_PROJECT, History

# the installed `kb` beside this interpreter, else the same entry point through -c
_KB = Path(sys.executable).with_name("kb")
KB_COMMAND = [str(_KB)] if _KB.exists() else [sys.executable, "-c", "from kb.cli import run; run()"]


def write_files(h: History, folder: Path) -> dict[str, Path]:
    """runs.jsonl, notes/*.md, an MLflow SQLite store and a TensorBoard tree, under `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    runs = folder / "runs.jsonl"
    runs.write_text("".join(json.dumps(r) + "\n" for r in h.records))
    notes = folder / "notes"
    notes.mkdir(exist_ok=True)
    for name, text in h.notes.items():
        (notes / name).write_text(text)
    mlflow_db = folder / "mlflow.db"
    if not mlflow_db.exists():
        _write_mlflow(h.mlflow, mlflow_db)
    tb = folder / TB_PROJECT
    if not tb.exists():
        _write_tensorboard(h.tensorboard, tb)
    return {"runs": runs, "notes": notes, "mlflow": mlflow_db, "tensorboard": tb}


def _write_mlflow(runs: list[dict], path: Path) -> None:
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient
    tmp = path.with_suffix(".partial")
    tmp.unlink(missing_ok=True)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp}")
    exp = client.create_experiment(MLFLOW_PROJECT, artifact_location=str(path.parent / "mlflow-artifacts"))
    t0 = int(EPOCH.timestamp() * 1000)
    for i, r in enumerate(runs):
        run = client.create_run(exp, run_name=r["name"], start_time=t0 + i * 3_600_000)
        metrics = [Metric(k, float(v), t0 + i * 3_600_000 + s, s) for k, pts in r["metrics"].items() for s, v in pts]
        client.log_batch(run.info.run_id, metrics=metrics, params=[Param(k, str(v)) for k, v in r["params"].items()])
        client.set_terminated(run.info.run_id, status=r["status"])
    tmp.rename(path)


def _write_tensorboard(runs: list[dict], root: Path) -> None:
    from tensorboard.plugins.hparams.summary_v2 import hparams_pb
    from torch.utils.tensorboard import SummaryWriter
    tmp = root.with_name(root.name + ".partial")
    for r in runs:
        with SummaryWriter(str(tmp / r["name"])) as w:
            w.file_writer.add_summary(hparams_pb(r["hparams"]))
            for key, pts in r["metrics"].items():
                for step, value in pts:
                    w.add_scalar(key, value, global_step=step, walltime=EPOCH.timestamp() + step)
    tmp.rename(root)


def build(kb, h: History, folder: Path) -> dict:
    """Write the history's files and ingest them: MLflow and TensorBoard through `kb ingest` (a
    subprocess on the same store), the native runs and notes through KnowledgeBase.ingest; then
    index everything. Returns the ingest reports."""
    paths = write_files(h, folder)
    env = dict(os.environ, KB_HOME=str(kb.settings.home))
    if kb.settings.database_url:
        env["KB_DATABASE_URL"] = kb.settings.database_url
    kb.release_index()        # the subprocess may want the embedded index
    reports = {}
    for label in ("mlflow", "tensorboard"):
        target = f"sqlite:///{paths['mlflow']}" if label == "mlflow" else str(paths[label])
        proc = subprocess.run([*KB_COMMAND, "ingest", target, "--json"], env=env,
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"kb ingest {target} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
        reports[label] = json.loads(proc.stdout)
    reports["native"] = kb.ingest(str(paths["runs"]), index=False).as_dict()
    reports["notes"] = kb.ingest(str(paths["notes"]), index=False).as_dict()
    for label, rep in reports.items():
        if rep["failed"]:
            raise RuntimeError(f"{label} ingest failed: {rep['failed'][:3]}")
    kb.sync_index()
    return reports
