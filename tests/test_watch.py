"""`kb watch` / ingest.watch.Watcher on real files: logs, native JSONL, TensorBoard folders written
by SummaryWriter, a Trainer checkpoint and an offline W&B run, into the real database.

    pytest tests/test_watch.py -q
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ingest.watch import Watcher, units

KB = shutil.which("kb") or str(Path(sys.executable).parent / "kb")


def nanogpt_log(path: Path, last: int = 40) -> Path:
    path.write_text("".join(f"iter {i}: loss {4.0 / (1 + i):.4f}, time 10.0ms\n" for i in range(0, last + 1, 10)))
    return path


def age(path: Path, seconds: float) -> None:
    """Make every file under path look `seconds` old (what a finished run looks like later)."""
    then = time.time() - seconds
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(p, (then, then))


def tensorboard_run(folder: Path, steps: int = 5) -> Path:
    from torch.utils.tensorboard import SummaryWriter
    with SummaryWriter(folder) as w:
        for s in range(steps):
            w.add_scalar("train/loss", 3.0 - 0.1 * s, s)
    return folder


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    nanogpt_log(root / "a.log")
    (root / "b.jsonl").write_text(json.dumps({"id": "native-b", "config": {"optim": {"lr": 1e-3}},
                                              "metrics": {"train/loss": [[0, 3.0], [10, 2.0]]}}) + "\n")
    tensorboard_run(root / "tb" / "lr-1e-3")          # tb/ holds only folders: a folder of runs
    tensorboard_run(root / "tb" / "lr-3e-3")
    (root / "blob.bin").write_bytes(b"\0\1\2" * 100)   # no ingester reads it
    return root


def test_finished_runs_are_ingested_once(kb, runs):
    w = Watcher(kb, runs, quiet_seconds=0)
    assert [p.name for p in units(runs)] == ["a.log", "b.jsonl", "blob.bin", "lr-1e-3", "lr-3e-3"]
    first = w.scan_once()
    assert sorted(Path(i["path"]).name for i in first.ingested) == ["a.log", "b.jsonl", "lr-1e-3", "lr-3e-3"]
    assert all(i["added"] == 1 for i in first.ingested) and not first.failed
    assert [Path(p).name for p in first.ignored] == ["blob.bin"]
    assert kb.count()["runs"] == 4 and kb.run("native-b").config == {"optim": {"lr": 1e-3}}

    second = w.scan_once()
    assert second.ingested == [] and second.ignored == [] and second.unchanged == 5

    restarted = Watcher(kb, runs, quiet_seconds=0)     # state came back from KB_HOME/watch-state.json
    assert restarted.scan_once().ingested == []
    assert (Path(kb.settings.home) / "watch-state.json").is_file()


def test_a_run_being_written_waits_until_quiet(kb, tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    log = nanogpt_log(root / "live.log", last=20)
    w = Watcher(kb, root, quiet_seconds=60)
    report = w.scan_once()
    assert report.ingested == [] and report.waiting == [str(log)]
    assert kb.count()["runs"] == 0
    age(log, 120)
    done = w.scan_once()
    assert [Path(i["path"]).name for i in done.ingested] == ["live.log"] and done.ingested[0]["reason"] == "quiet"
    run_id = done.ingested[0]["ids"][0]
    assert [p[0] for p in kb.run(run_id).metrics["train/loss"]] == [0, 10, 20]

    with log.open("a") as fh:                          # the run resumed and wrote more
        fh.write("iter 30: loss 0.1290, time 10.0ms\n")
    assert w.scan_once().waiting == [str(log)]
    age(log, 120)
    again = w.scan_once()
    assert again.ingested[0]["updated"] == 1
    assert [p[0] for p in kb.run(run_id).metrics["train/loss"]] == [0, 10, 20, 30]


def test_done_marker_ends_a_run_before_it_is_quiet(kb, tmp_path):
    root = tmp_path / "runs"
    (root / "exp1").mkdir(parents=True)
    nanogpt_log(root / "exp1" / "train.log")
    w = Watcher(kb, root, quiet_seconds=600)
    assert w.scan_once().waiting == [str(root / "exp1")]
    (root / "exp1" / "DONE").touch()
    report = w.scan_once()
    assert report.ingested[0]["reason"] == "marker DONE" and report.ingested[0]["added"] == 1


def test_trainer_checkpoint_at_max_steps_is_an_end_marker(kb, tmp_path):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (16, 16))
    data = [{"input_ids": x, "labels": x} for x in ids]
    root = tmp_path / "runs"
    args = TrainingArguments(output_dir=str(root / "gpt-tiny"), max_steps=4, logging_steps=1, use_cpu=True,
                             report_to=[], per_device_train_batch_size=2, save_strategy="steps", save_steps=2,
                             disable_tqdm=True)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32))
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    w = Watcher(kb, root, quiet_seconds=600)
    assert [p.name for p in units(root)] == ["gpt-tiny"]          # checkpoints are not runs of their own
    report = w.scan_once()
    assert report.ingested and report.ingested[0]["reason"] == "trainer_state.json at max_steps"
    run = kb.run(report.ingested[0]["ids"][0])
    losses = [[e["step"], e["loss"]] for e in trainer.state.log_history if "loss" in e]
    assert [p[:2] for p in run.metrics["train/loss"]] == losses and run.status == "completed"


WANDB_WRITER = textwrap.dedent("""
    import wandb
    run = wandb.init(project="watch", name="wb-run", config={"lr": 0.01})
    for step in range(5):
        wandb.log({"train/loss": 2.0 - 0.1 * step}, step=step)
    wandb.finish()
""")


def test_wandb_exit_record_is_an_end_marker(kb, tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "wb"
    out.mkdir()
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(out), WANDB_SILENT="true")
    subprocess.run([sys.executable, "-c", WANDB_WRITER], env=env, check=True, timeout=300, capture_output=True)
    root = out / "wandb"
    found = units(root)                              # wandb/ is a folder of run folders
    assert len(found) == 1 and found[0].name.startswith("offline-run-")
    report = Watcher(kb, root, quiet_seconds=600).scan_once()
    assert report.ingested and report.ingested[0]["reason"] == "wandb exit record"
    run = kb.run(report.ingested[0]["ids"][0])
    assert run.name == "wb-run" and [p[0] for p in run.metrics["train/loss"]] == [0, 1, 2, 3, 4]


def test_watch_cli_once(tmp_path, database_url, runs):
    env = dict(os.environ, KB_HOME=str(tmp_path / "home"), KB_DATABASE_URL=database_url, HF_HUB_OFFLINE="1")
    cmd = [KB, "watch", str(runs), "--once", "--quiet-seconds", "0", "--no-index", "--json"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert len(report["ingested"]) == 4 and report["unchanged"] == 0
    second = json.loads(subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout)
    assert second["ingested"] == [] and second["unchanged"] == 5
    (runs / "bad.jsonl").write_text('{"config": {"a": 1}, "scale": {"params": "many"}}\n')
    bad = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "bad.jsonl:1: scale.params" in bad.stderr
