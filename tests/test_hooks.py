"""Post-run hooks on real components: `kb track` through the installed console script on real
training-like subprocesses, `k.track(...)`, a real HF Trainer with KBCallback and a real
Lightning fit with KBLightningCallback, all stored in the real database.

    pytest tests/test_hooks.py -q
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

KB = shutil.which("kb") or str(Path(sys.executable).parent / "kb")

NANOGPT = """
import math, os, signal, sys, time
print("Overriding: learning_rate = 0.0006")
print("n_layer = 2")
for it in range(0, {last} + 1, 10):
    loss = {loss_expr}
    print(f"iter {{it}}: loss {{loss:.4f}}, time 12.5ms, mfu 1.00%")
{tail}
"""


@pytest.fixture
def env(tmp_path, database_url):
    # TMPDIR: kb track keeps each full log in the temp folder; keep the test's there
    return dict(os.environ, KB_HOME=str(tmp_path / "home"), KB_DATABASE_URL=database_url, HF_HUB_OFFLINE="1",
                TMPDIR=str(tmp_path))


def script(tmp_path: Path, last: int = 40, loss_expr: str = "4.0 / (1 + it)", tail: str = "") -> Path:
    path = tmp_path / "train.py"
    path.write_text(NANOGPT.format(last=last, loss_expr=loss_expr, tail=textwrap.dedent(tail)))
    return path


def track(env, cwd, *args, json_out=True):
    flags = ["--no-index", "--json"] if json_out else ["--no-index"]
    return subprocess.run([KB, "track", *flags, *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)


def stored_meta(kb, run_id: str) -> dict:
    from sqlmodel import Session
    from kb.models import Run
    with Session(kb.engine) as s:
        return s.get(Run, run_id).meta


def stored_id(proc) -> str:
    return re.search(r"stored run (\S+)", proc.stderr).group(1)


# ---- kb track ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_track_completed_streams_output_and_stores_the_curve(env, tmp_path, kb):
    path = script(tmp_path)
    proc = track(env, tmp_path, "--project", "nano", "--", sys.executable, str(path), json_out=False)
    assert proc.returncode == 0, proc.stderr
    assert "iter 40: loss 0.0976" in proc.stdout          # the child's output went through, live
    run = kb.run(stored_id(proc))
    assert run.status == "completed" and run.project == "nano" and run.name == "train"
    assert [p[:2] for p in run.metrics["train/loss"]] == [[it, round(4.0 / (1 + it), 4)] for it in range(0, 41, 10)]
    assert run.config["learning_rate"] == 0.0006 and run.config["n_layer"] == 2
    assert run.code["argv"] == [sys.executable, str(path)] and run.code["host"] and run.code["cwd"] == str(tmp_path)
    assert run.source["kind"] == "track" and run.source["uri"].startswith("track://")
    assert run.failures == []
    meta = stored_meta(kb, run.id)               # RunView has no meta: read the row
    log = tmp_path / f"kb-track-{run.id}.log"    # the whole log, kept; the record holds its tail
    assert meta["log_path"] == str(log) and log.read_text() == proc.stdout
    assert meta["log_tail"].splitlines()[-1].startswith("iter 40: loss 0.0976")
    assert meta["exit_code"] == 0 and meta["hook"] == "kb track" and meta["duration_s"] >= 0
    detail = json.loads(subprocess.run([KB, "show", run.id, "--json"], capture_output=True, text=True,
                                       env=env, check=True).stdout)
    assert detail["id"] == run.id


SPEEDRUN = """
import sys
with open(sys.argv[0]) as f:
    code = f.read()
print(code)                        # speedrun-style: the script prints itself first, for the record
print("=" * 100)
from dataclasses import dataclass

@dataclass
class Hyperparameters:
    batch_size: int = 8*64*1024
    num_iterations: int = 30
    cooldown_frac: float = 0.4
args = Hyperparameters()
self_note = "config.n_head"
for step in range(0, args.num_iterations + 1, 10):
    print(f"step:{step}/{args.num_iterations} val_loss:{4.0 - step / 100:.4f} train_time:{step * 100}ms")
"""


def test_track_keeps_a_printed_script_as_code_not_config(env, tmp_path, kb):
    path = tmp_path / "train_gpt.py"
    path.write_text(SPEEDRUN)
    proc = track(env, tmp_path, "--", sys.executable, str(path))
    assert proc.returncode == 0, proc.stderr
    run = kb.run(stored_id(proc))
    assert run.code["source"].strip() == SPEEDRUN.strip() and len(run.code["source_sha256"]) == 64
    assert run.code["argv"] == [sys.executable, str(path)]
    assert run.config == {"batch_size": 524288, "num_iterations": 30, "cooldown_frac": 0.4}
    assert [p[1] for p in run.metrics["val/loss"]] == [4.0, 3.9, 3.8, 3.7]


def test_track_nan_loss_is_diverged_with_step_and_evidence(env, tmp_path, kb):
    path = script(tmp_path, last=50, loss_expr="float('nan') if it >= 30 else 4.0 / (1 + it)")
    proc = track(env, tmp_path, "--", sys.executable, str(path))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)                      # --json: stdout is the report only
    assert out["status"] == "diverged" and out["exit_code"] == 0
    run = kb.run(out["id"])
    assert run.status == "diverged"
    reported = [f for f in run.failures if f["origin"] == "reported"][0]
    assert reported["kind"] == "diverged" and reported["step"] == 30
    assert "iter 30: loss nan" in reported["evidence"] and "iter 20: loss" in reported["evidence"]
    assert "iter 30: loss nan" in proc.stderr           # child output on stderr under --json


def test_track_exception_is_failed_and_exit_code_is_the_scripts(env, tmp_path, kb):
    path = script(tmp_path, last=20, tail="""
        def step():
            raise ValueError("bad batch 7")
        step()
    """)
    direct = subprocess.run([sys.executable, str(path)], capture_output=True, cwd=tmp_path)
    proc = track(env, tmp_path, "--name", "crashy", "--", sys.executable, str(path))
    assert direct.returncode == 1 and proc.returncode == direct.returncode
    run = kb.run(json.loads(proc.stdout)["id"])
    assert run.status == "failed" and run.name == "crashy"
    f = run.failures[0]
    assert f["kind"] == "exception" and f["message"] == "ValueError: bad batch 7" and f["step"] == 20
    assert "Traceback (most recent call last)" in f["evidence"] and "in step" in f["evidence"]
    assert run.source["kind"] == "track"


def test_track_killed_by_signal(env, tmp_path, kb):
    path = script(tmp_path, last=10, tail="os.kill(os.getpid(), signal.SIGKILL)")
    proc = track(env, tmp_path, "--", sys.executable, str(path))
    assert proc.returncode == 128 + signal.SIGKILL
    run = kb.run(json.loads(proc.stdout)["id"])
    assert run.status == "killed"
    assert run.failures[0]["kind"] == "killed" and "SIGKILL" in run.failures[0]["message"]
    assert run.failures[0]["step"] == 10


@pytest.mark.slow
def test_ctrl_c_is_forwarded_and_the_run_is_killed(env, tmp_path, kb):
    path = script(tmp_path, last=0, tail="""
        for it in range(1, 10000):
            print(f"iter {it}: loss {1.0 / it:.4f}")
            time.sleep(0.05)
    """)
    proc = subprocess.Popen([KB, "track", "--no-index", "--json", "--", sys.executable, str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    for line in proc.stderr:                    # the child's output, echoed to stderr under --json
        if line.startswith("iter 3:"):
            break
    os.kill(proc.pid, signal.SIGINT)            # what a terminal's Ctrl-C does to kb track
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    run = kb.run(json.loads(out)["id"])
    assert run.status == "killed"
    assert run.failures[0]["kind"] == "killed" and "forwarded SIGINT" in run.failures[0]["message"]
    assert run.metrics["train/loss"][-1][0] >= 3


@pytest.mark.slow
def test_track_config_file_is_merged_and_a_bad_one_is_named(env, tmp_path, kb):
    path = script(tmp_path, last=10)
    (tmp_path / "cfg.yaml").write_text("optim:\n  lr: 0.0003\nn_layer: 12\n")
    proc = track(env, tmp_path, "--config", "cfg.yaml", "--", sys.executable, str(path))
    assert proc.returncode == 0, proc.stderr
    run = kb.run(json.loads(proc.stdout)["id"])
    assert run.config["optim"] == {"lr": 0.0003}
    assert run.config["n_layer"] == 12 and run.config["learning_rate"] == 0.0006    # the file wins
    (tmp_path / "bad.json").write_text('{"a": 1,,}')
    bad = track(env, tmp_path, "--config", "bad.json", "--", sys.executable, str(path))
    assert bad.returncode == 2 and "bad.json:1" in bad.stderr and "invalid JSON" in bad.stderr
    assert kb.count()["runs"] == 1                     # nothing was run for the bad config


@pytest.mark.slow
def test_track_a_command_that_prints_nothing_is_still_remembered(env, tmp_path, kb):
    proc = track(env, tmp_path, "--", sys.executable, "-c", "import sys; sys.exit(3)")
    assert proc.returncode == 3
    run = kb.run(json.loads(proc.stdout)["id"])
    assert run.status == "failed" and run.failures[0]["message"] == "exited with code 3"
    assert "sys.exit(3)" in run.config["command"]
    missing = track(env, tmp_path, "--", str(tmp_path / "no-such-program"))
    assert missing.returncode == 127 and "cannot run" in missing.stderr


@pytest.mark.slow
def test_track_while_another_process_holds_the_index(env, tmp_path, kb):
    kb.index                                         # this process now holds the embedded index
    path = script(tmp_path, last=20)
    proc = subprocess.run([KB, "track", "--json", "--", sys.executable, str(path)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    run_id = json.loads(proc.stdout)["id"]
    assert kb.run(run_id).status == "completed"
    assert kb.pending_index() == 1                   # SQL has it; vectors wait for the index holder
    kb.sync_index()
    assert kb.pending_index() == 0
    assert run_id in {h.payload.get("ref_id") for h in kb.search("train run loss", limit=5)}


# ---- k.track ------------------------------------------------------------------------------------

def test_context_manager_stores_a_completed_run(kb):
    with kb.track(project="ctx", config={"optim": {"lr": 1e-3}}, name="ctx-run", index=False,
                  tags=["smoke"]) as run:
        assert run.id.startswith("ctx-run-")             # known on entry
        for _ in range(5):
            run.log({"train/loss": 2.0 - 0.1 * len(run.metrics.get("train/loss", []))})
        run.log({"val/loss": 1.7}, step=4)
        run.summary["best"] = 1.7
    d = kb.run(run.id)
    assert d.status == "completed" and d.project == "ctx" and d.tags == ["smoke"]
    assert [p[:2] for p in d.metrics["train/loss"]] == [[i, 2.0 - 0.1 * i] for i in range(5)]
    assert [p[:2] for p in d.metrics["val/loss"]] == [[4, 1.7]]
    assert d.summary["best"] == 1.7 and d.config == {"optim": {"lr": 1e-3}}
    assert d.code["host"] and d.code["argv"] and "git_commit" in d.code      # the repo is a git tree


def test_context_manager_exception_is_stored_failed_and_reraised(kb):
    def train(run):
        run.log({"train/loss": 3.0}, step=0)
        run.log({"train/loss": 2.5}, step=1)
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape mismatch"):
        with kb.track(project="ctx", config={"a": 1}, name="boom", index=False) as run:
            train(run)
    d = kb.run(run.id)
    assert d.status == "failed"
    f = d.failures[0]
    assert f["kind"] == "exception" and f["message"] == "ValueError: shape mismatch" and f["step"] == 1
    assert "Traceback (most recent call last)" in f["evidence"] and "in train" in f["evidence"]


def test_context_manager_nan_loss_and_interrupt(kb):
    with pytest.raises(RuntimeError):
        with kb.track(config={"a": 1}, name="nan", index=False) as run:
            run.log({"train/loss": 2.0})
            run.log({"train/loss": float("nan")})
            raise RuntimeError("loss is nan")
    assert kb.run(run.id).status == "diverged"
    with kb.track(config={"a": 2}, name="quiet-nan", index=False) as quiet:
        quiet.log({"train/loss": float("inf")}, step=7)
    assert kb.run(quiet.id).status == "diverged"
    assert kb.run(quiet.id).failures[0]["step"] == 7
    with pytest.raises(KeyboardInterrupt):
        with kb.track(config={"a": 3}, name="ctrl-c", index=False) as stopped:
            stopped.log({"train/loss": 1.0})
            raise KeyboardInterrupt
    assert kb.run(stopped.id).status == "killed" and kb.run(stopped.id).failures[0]["kind"] == "killed"


def test_context_manager_rejects_bad_input_early(kb):
    from kb.errors import InvalidRecord
    with pytest.raises(InvalidRecord, match="status"):
        kb.track(config={"a": 1}, status="completed")
    run = kb.track(config={"a": 1}, index=False)
    with pytest.raises(InvalidRecord, match="metrics.loss"):
        run.log({"loss": "low"})


def test_hooks_import_no_framework():
    code = ("import sys, ingest.hooks, kb.tracking, kb.api, kb.cli.track; "
            "print([m for m in ('transformers', 'lightning', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


# ---- Hugging Face Trainer ----------------------------------------------------------------------------

class _Ids:
    """Random token ids; the `fail_at`-th read raises, as a broken shard would."""

    def __init__(self, n=32, fail_at=None):
        import torch
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)
        self.fail_at, self.reads = fail_at, 0

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        self.reads += 1
        if self.fail_at is not None and self.reads >= self.fail_at:
            raise OSError(f"shard {i} unreadable")
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(tmp_path, dataset, callback, **args):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    import torch
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32))
    targs = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, logging_steps=1, use_cpu=True,
                              report_to=[], per_device_train_batch_size=2, learning_rate=1e-3,
                              save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, **args)
    return Trainer(model=model, args=targs, train_dataset=dataset, callbacks=[callback]), model


def test_hf_callback_curve_equals_log_history(kb, tmp_path):
    from ingest.callbacks import KBCallback
    cb = KBCallback(kb, project="hf", name="tiny-gpt2", index=False)
    trainer, model = _trainer(tmp_path, _Ids(), cb)
    trainer.train()
    d = kb.run(cb.run.id)
    losses = [[e["step"], e["loss"]] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 4
    assert [p[:2] for p in d.metrics["train/loss"]] == losses
    assert d.status == "completed" and d.project == "hf" and d.name == "tiny-gpt2"
    assert d.config["training"]["learning_rate"] == 1e-3 and d.config["training"]["max_steps"] == 4
    assert d.config["model"]["n_layer"] == 1 and d.config["model"]["n_embd"] == 32
    assert d.scale["params"] == sum(p.numel() for p in model.parameters())
    assert d.summary["train/train_loss"] == pytest.approx(trainer.state.log_history[-1]["train_loss"])


def test_hf_callback_stores_a_crash_inside_with(kb, tmp_path):
    from ingest.callbacks import KBCallback
    cb = KBCallback(kb, project="hf", name="crash", index=False)
    trainer, _ = _trainer(tmp_path, _Ids(n=32, fail_at=5), cb)
    with pytest.raises(OSError, match="unreadable"):
        with cb:
            trainer.train()
    d = kb.run(cb.run.id)
    assert d.status == "failed" and d.failures[0]["kind"] == "exception"
    assert d.failures[0]["message"].startswith("OSError: shard")
    # the steps logged before the bad read (the Trainer reads a batch ahead, so fewer than 2)
    logged = [[e["step"], e["loss"]] for e in trainer.state.log_history if "loss" in e]
    assert 1 <= len(logged) <= 2 and [p[:2] for p in d.metrics["train/loss"]] == logged


# ---- Lightning -----------------------------------------------------------------------------------

def _lightning_module(fail_at=None):
    import lightning.pytorch as pl
    import torch

    class Tiny(pl.LightningModule):
        def __init__(self, lr=0.1, width=4):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Linear(width, 1)

        def training_step(self, batch, batch_idx):
            if fail_at is not None and batch_idx == fail_at:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_mse", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(64, 4, generator=g)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                               batch_size=8)

    return Tiny()


def _fit(tmp_path, module, callback, steps=5):
    import lightning.pytorch as pl
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[callback])
    trainer.fit(module)
    return trainer


@pytest.mark.slow
def test_lightning_callback_stores_the_fit(kb, tmp_path):
    from ingest.lightning_callback import KBLightningCallback
    cb = KBLightningCallback(kb, project="pl", index=False)
    _fit(tmp_path, _lightning_module(), cb)
    d = kb.run(cb.run.id)
    assert d.status == "completed" and d.name == "Tiny" and d.project == "pl"
    assert [p[0] for p in d.metrics["train/loss"]] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(p[1]) for p in d.metrics["train/loss"])
    assert d.config["model"] == {"lr": 0.1, "width": 4} and d.config["trainer"]["max_steps"] == 5
    assert d.scale["params"] == 5


def test_lightning_exception_is_stored_failed(kb, tmp_path):
    from ingest.lightning_callback import KBLightningCallback
    cb = KBLightningCallback(kb, project="pl", name="bad-step", index=False)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        _fit(tmp_path, _lightning_module(fail_at=3), cb)
    d = kb.run(cb.run.id)
    assert d.status == "failed"
    f = d.failures[0]
    assert f["kind"] == "exception" and f["message"].startswith("RuntimeError: CUDA error")
    assert "training_step" in f["evidence"] and f["step"] == 3
    assert [p[0] for p in d.metrics["train/loss"]] == [1, 2, 3]
