"""One vocabulary: the same quantity under each source's name answers to one canonical query.

The cross-source test writes one run per source with that source's own client library
(MLflow's client, wandb offline, torch's SummaryWriter, transformers' TrainerState), a
training log and a table, each spelling validation loss and learning rate its own way;
`val/loss < 3.3` and `lr = 3e-4` find all of them, and each reads back as logged.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kb import vocab
from kb.query import parse

LR = 3e-4
FINAL = 3.25       # every source's last validation loss


def test_aliases_fold_case_and_separators():
    for key in ("val/loss", "val_loss", "eval/loss", "eval_loss", "Eval-Loss", "tel", "validation loss"):
        assert vocab.metric_name(key) == "val/loss", key
    for key in ("loss", "train/loss", "train_loss", "trl", "lm loss"):
        assert vocab.metric_name(key) == "train/loss", key
    assert vocab.metric_name("train/learning_rate") == "lr"
    assert vocab.metric_name("charts/val_loss") == "val/loss"       # a tracker's section on a known name
    assert vocab.metric_name("hellaswag") is None
    for key in ("lr", "learning_rate", "opt_base_learning_rate", "max_lr"):
        assert vocab.hparam_name(key) == "lr", key
    assert vocab.hparam_name("block_size") == "seq_len"


def test_canonical_hyperparameters_prefer_the_shallowest_and_the_global_batch():
    cfg = {"sched": {"warmup": {"lr": 1.0}}, "optim": {"lr": LR, "batch_size": 8},
           "global_batch_size": 512, "batch_size": 16, "name": "x", "lr_note": "auto"}
    hp = vocab.canonical_hparams(cfg)
    assert hp["lr"] == (("optim", "lr"), LR)                     # optim.lr beats sched.warmup.lr
    assert hp["batch_size"] == (("global_batch_size",), 512)     # global beats per-device at one depth
    assert vocab.canonical_hparams({"lr": "auto"}) == {}         # only numbers are hyperparameter values


def test_bare_names_in_queries():
    assert parse("val/loss < 3.3").key == ("summary", "val/loss")
    assert parse("eval_loss < 3.3").key == ("summary", "val/loss")
    assert parse("learning_rate = 3e-4").key == ("lr",)
    assert parse("seq_len = 1024").key == ("hparams", "seq_len")


def test_columns_of_tables():
    assert [vocab.column_target(c) for c in ("params_N", "tokens_D", "compute_C", "loss", "lr", "N", "hellaswag")] \
        == ["scale.params", "scale.tokens", "scale.flops", "summary.loss", "config.lr", "scale.params", None]


def _mlflow(tmp_path) -> str:
    from mlflow.tracking import MlflowClient
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("vocab"), run_name="from-mlflow")
    client.log_param(run.info.run_id, "learning_rate", LR)
    for step, v in enumerate((4.0, 3.6, FINAL)):
        client.log_metric(run.info.run_id, "eval_loss", v, step=step * 100)
    client.set_terminated(run.info.run_id)
    return uri


WANDB_WRITER = textwrap.dedent("""
    import wandb
    run = wandb.init(project="vocab", name="from-wandb", config={"optimizer": {"lr": %r}})
    for step, v in enumerate((4.0, 3.6, %r)):
        wandb.log({"eval/loss": v}, step=step * 100)
    wandb.finish()
""")


def _wandb(tmp_path):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true",
               WANDB_DISABLE_GIT="true", WANDB_CONSOLE="off")
    subprocess.run([sys.executable, "-c", WANDB_WRITER % (LR, FINAL)], env=env, check=True,
                   capture_output=True, timeout=180, cwd=tmp_path)
    return tmp_path / "wandb"


def _tensorboard(tmp_path):
    from torch.utils.tensorboard import SummaryWriter
    folder = tmp_path / "tb" / "from-tensorboard"
    with SummaryWriter(str(folder)) as w:
        for step, v in enumerate((4.0, 3.6, FINAL)):
            w.add_scalar("val_loss", v, step * 100)
        w.add_hparams({"learning_rate": LR}, {"hparam/val_loss": FINAL}, run_name=".")
    return folder


def _hf_trainer(tmp_path):
    from transformers import TrainerState
    folder = tmp_path / "from-hf"
    folder.mkdir()
    history = [{"step": s * 100, "epoch": s / 3, "eval_loss": v, "learning_rate": LR}
               for s, v in enumerate((4.0, 3.6, FINAL), start=1)]
    TrainerState(global_step=300, max_steps=300, log_history=history).save_to_json(str(folder / "trainer_state.json"))
    (folder / "training_args.json").write_text(json.dumps({"learning_rate": LR, "per_device_train_batch_size": 8}))
    return folder


def _log(tmp_path):
    path = tmp_path / "from-log.log"
    lines = ["learning_rate = 0.0003", "batch_size = 12"]
    lines += [f"step {s * 100}: train loss {v + 0.1:.4f}, val loss {v:.4f}" for s, v in enumerate((4.0, 3.6, FINAL))]
    path.write_text("\n".join(lines) + "\n")
    return path


def _table(tmp_path):
    path = tmp_path / "sweep.csv"
    path.write_text(f"name,lr,val_loss\nfrom-table,{LR},{FINAL}\nother,1e-3,3.9\n")
    return path


@pytest.mark.slow
def test_every_source_answers_to_the_canonical_names(kb, tmp_path):
    native = tmp_path / "native.jsonl"
    native.write_text(json.dumps({"name": "from-native", "config": {"optim": {"lr": LR}},
                                  "metrics": {"val/loss": [[0, 4.0], [100, 3.6], [200, FINAL]]}}) + "\n")
    targets = [_mlflow(tmp_path), _wandb(tmp_path), _tensorboard(tmp_path), _hf_trainer(tmp_path),
               _log(tmp_path), _table(tmp_path), native]
    report = kb.ingest(*map(str, targets), index=False)
    assert not report.failed, report.failed
    expected = {"from-mlflow", "from-wandb", "from-tensorboard", "from-hf", "from-log", "from-table", "from-native"}

    found = {r.name for r in kb.runs(where="val/loss < 3.3")}
    assert found == expected
    assert {r.name for r in kb.runs(where="summary.val/loss < 3.3 and lr = 3e-4")} == expected
    assert {r.name for r in kb.runs(where="hparams.lr = 3e-4 and val/loss = 3.25")} == expected
    assert "other" not in {r.name for r in kb.runs(where="val/loss exists and lr = 3e-4")}

    # what each source logged comes back under its own name
    logged = {"from-mlflow": "eval_loss", "from-wandb": "eval/loss", "from-tensorboard": "val_loss",
              "from-hf": "eval/loss", "from-log": "val/loss", "from-table": "val_loss", "from-native": "val/loss"}
    for run in kb.runs(where="val/loss < 3.3"):
        detail = kb.run(run.id)
        key = logged[run.name]
        assert detail.summary[key] == FINAL, (run.name, detail.summary)
        assert detail.canonical["val/loss"] == {"key": f"summary.{key}", "value": FINAL}
        assert detail.canonical["lr"]["value"] == LR
        assert "val/loss=3.25" in detail.card
        if run.name != "from-table":
            assert [p[1] for p in detail.metrics[key]] == [4.0, 3.6, FINAL]
            assert "val/loss" not in detail.metrics or key == "val/loss"     # no renamed copy of a curve
