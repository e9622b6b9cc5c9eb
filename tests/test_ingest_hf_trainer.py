"""The hf-trainer ingester on a folder written at test time by transformers' Trainer
(a 1-layer random GPT-2, 6 steps on CPU): curves, config and scale read back as written.

Run: pytest tests/test_ingest_hf_trainer.py -q
"""
from __future__ import annotations

import enum
import json
import os
import shutil
import time

import pytest

from ingest.hf_trainer import TRAINING_KEYS, HFTrainerIngester, metric_key
from ingest.tensorboard import TensorBoardIngester
from kb.records import Parsed, Rejected, content_hash

HF = HFTrainerIngester()


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """(output folder, trainer, model) after a 6-step run with checkpoints at 3 and 6."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16))

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n, seed):
            self.ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(seed))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    out = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    args = TrainingArguments(
        output_dir=str(out), max_steps=6, logging_steps=1, save_steps=3, eval_strategy="steps",
        eval_steps=3, per_device_train_batch_size=4, per_device_eval_batch_size=4, learning_rate=1e-3,
        warmup_steps=2, weight_decay=0.01, seed=7, report_to=["tensorboard"], use_cpu=True,
        include_num_input_tokens_seen=True, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(32, 0), eval_dataset=Tokens(8, 1))
    trainer.train()
    trainer.save_model()
    trainer.save_state()
    return out, trainer, model


def _read(folder) -> Parsed:
    (item,) = HF.read(str(folder))
    assert isinstance(item, Parsed), item
    return item


def _copy(src, dst, drop=()):
    shutil.copytree(src, dst)
    for name in drop:
        p = dst / name
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return dst


def test_every_log_history_entry_is_read_back(trained):
    out, trainer, _ = trained
    item = _read(out)
    rec = item.record
    assert item.source_kind == "hf-trainer" and item.source_uri == str(out.resolve()) and item.line is None
    history = trainer.state.log_history
    closing = history[-1]
    assert "train_loss" in closing
    expected: dict[str, list] = {}
    for entry in history[:-1]:
        for k, v in entry.items():
            if k == "step":
                continue
            pts = expected.setdefault(metric_key(k), [])
            if not (pts and pts[-1] == [entry["step"], v]):
                pts.append([entry["step"], v])
    assert {k: [list(p) for p in v] for k, v in rec.metrics.items()} == expected
    assert set(rec.metrics) >= {"train/loss", "train/learning_rate", "train/grad_norm", "eval/loss"}
    assert len(rec.metrics["train/loss"]) == 6 and [p[0] for p in rec.metrics["eval/loss"]] == [3, 6]
    assert rec.summary == {metric_key(k): v for k, v in closing.items() if k != "step"}


def test_config_holds_model_config_and_training_arguments(trained):
    out, trainer, model = trained
    rec = _read(out).record
    assert rec.config["model"] == json.loads((out / "config.json").read_text())
    assert (rec.config["model"]["n_layer"], rec.config["model"]["n_embd"], rec.config["model"]["vocab_size"]) \
        == (1, 32, 64)
    training = rec.config["training"]
    for key in TRAINING_KEYS:
        value = getattr(trainer.args, key, None)
        if isinstance(value, enum.Enum):
            value = value.value
        if value is None:
            assert key not in training
        else:
            assert training[key] == value, key
    assert training["learning_rate"] == 1e-3 and training["lr_scheduler_type"] == "linear"
    assert training["seed"] == 7 and training["warmup_steps"] == 2 and training["max_steps"] == 6


def test_status_scale_and_checkpoints(trained):
    out, trainer, model = trained
    rec = _read(out).record
    assert rec.status == "completed" and rec.failure is None
    assert rec.scale.params == model.num_parameters()
    assert rec.scale.tokens == trainer.state.num_input_tokens_seen > 0
    assert rec.scale.flops == trainer.state.total_flos
    assert rec.meta["checkpoints"] == ["checkpoint-3", "checkpoint-6"]
    assert rec.meta["state_file"] == "trainer_state.json"
    assert rec.name == "gpt2-tiny" and rec.started_at is not None


def test_reading_twice_gives_the_same_record(trained):
    out, _, _ = trained
    assert content_hash(_read(out).record, "hf-trainer") == content_hash(_read(out).record, "hf-trainer")


def test_checkpoints_only_folder_uses_the_newest(trained, tmp_path):
    out, trainer, _ = trained
    run = _copy(out, tmp_path / "ckpts", drop=("trainer_state.json", "model.safetensors", "config.json",
                                               "training_args.bin"))
    rec = _read(run).record
    assert rec.meta["state_file"] == os.path.join("checkpoint-6", "trainer_state.json")
    state6 = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    assert [list(p) for p in rec.metrics["eval/loss"]] == \
        [[e["step"], e["eval_loss"]] for e in state6["log_history"] if "eval_loss" in e]
    assert rec.status == "completed"                     # global_step 6 of max_steps 6
    assert rec.config["training"]["learning_rate"] == 1e-3 and rec.config["model"]["n_layer"] == 1


def test_stopped_early_is_running_then_killed(trained, tmp_path):
    out, _, _ = trained
    run = _copy(out, tmp_path / "stopped", drop=("trainer_state.json", "model.safetensors", "checkpoint-6"))
    assert _read(run).record.status == "running"         # written just now
    old = time.time() - 2 * 3600
    os.utime(run / "checkpoint-3" / "trainer_state.json", (old, old))
    rec = _read(run).record
    assert rec.status == "killed" and rec.failure.kind == "killed" and rec.failure.step == 3
    assert max(p[0] for p in rec.metrics["train/loss"]) == 3


def test_training_args_json_is_preferred_and_a_bad_pickle_is_a_warning(trained, tmp_path):
    out, _, _ = trained
    run = _copy(out, tmp_path / "json-args")
    (run / "training_args.json").write_text(json.dumps({"learning_rate": 0.5, "seed": 1, "hub_token": "x"}))
    assert _read(run).record.config["training"] == {"learning_rate": 0.5, "seed": 1}

    run = _copy(out, tmp_path / "bad-args", drop=[c for c in ("checkpoint-3", "checkpoint-6")])
    (run / "training_args.bin").write_bytes(b"not a pickle at all")
    rec = _read(run).record
    assert "training" not in rec.config
    assert any("training_args.bin" in w for w in rec.meta["warnings"])


class _Trap:
    """Pickles as a call to open(marker, 'w'): unpickling it for real would create the file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_training_args_pickle_runs_no_code(trained, tmp_path):
    import torch
    out, _, _ = trained
    run = _copy(out, tmp_path / "trap", drop=("checkpoint-3", "checkpoint-6"))
    marker = tmp_path / "pwned"
    torch.save({"learning_rate": 0.25, "seed": 3, "optim": _Trap(str(marker))}, run / "training_args.bin")
    rec = _read(run).record
    assert not marker.exists()
    assert rec.config["training"]["learning_rate"] == 0.25 and rec.config["training"]["seed"] == 3


def test_corrupt_trainer_state_is_rejected_with_file_and_line(trained, tmp_path):
    out, _, _ = trained
    run = _copy(out, tmp_path / "corrupt", drop=("checkpoint-3", "checkpoint-6"))
    text = (run / "trainer_state.json").read_text()
    (run / "trainer_state.json").write_text(text[: len(text) // 2])
    (item,) = HF.read(str(run))
    assert isinstance(item, Rejected)
    assert item.error.source == str(run.resolve() / "trainer_state.json")
    assert item.error.line and "invalid JSON" in item.error.error


def test_bad_log_history_entry_names_the_field(trained, tmp_path):
    out, _, _ = trained
    run = _copy(out, tmp_path / "badstep", drop=("checkpoint-3", "checkpoint-6"))
    state = json.loads((run / "trainer_state.json").read_text())
    state["log_history"][2]["step"] = "three"
    (run / "trainer_state.json").write_text(json.dumps(state))
    (item,) = HF.read(str(run))
    assert isinstance(item, Rejected) and item.error.field == "log_history[2].step"

    state["log_history"] = {"not": "a list"}
    (run / "trainer_state.json").write_text(json.dumps(state))
    (item,) = HF.read(str(run))
    assert isinstance(item, Rejected) and item.error.field == "log_history"


def test_detect(trained, tmp_path):
    out, _, _ = trained
    assert HF.detect(str(out)) == 95
    assert HF.detect(str(out)) > TensorBoardIngester().detect(str(out))     # its runs/ holds events
    assert HF.detect(str(out / "trainer_state.json")) == 90
    run = _copy(out, tmp_path / "ckpts", drop=("trainer_state.json",))
    assert HF.detect(str(run)) == 90
    (tmp_path / "empty").mkdir()
    assert HF.detect(str(tmp_path / "empty")) == 0
    assert HF.detect(str(out / "config.json")) == 0
    assert HF.detect(str(tmp_path / "missing")) == 0


def test_no_trainer_state_is_rejected(tmp_path):
    (tmp_path / "checkpoint-1").mkdir()
    (item,) = HF.read(str(tmp_path))
    assert isinstance(item, Rejected) and "no trainer_state.json" in item.error.error


def test_run_stores_with_its_scale_and_status(trained, engine):
    from kb.db import session
    from kb.models import Run
    from kb.runs import write_run

    out, trainer, model = trained
    item = _read(out)
    for want in ("added", "unchanged"):
        with session(engine) as s, s.begin():
            outcome, run_id = write_run(s, item.record, item.source_kind, item.source_uri)
        assert outcome == want
    with session(engine) as s:
        row = s.get(Run, run_id)
        assert (row.status, row.params, row.tokens, row.lr) == \
            ("completed", model.num_parameters(), trainer.state.num_input_tokens_seen, 1e-3)
