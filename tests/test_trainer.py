"""The proxy trainer (runner/): tiny GPTs on CPU, the built-in stdlib corpus and .bin shards
written here with the real header. GPU paths are tested only where torch sees a GPU."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from kb.errors import InvalidRecord, KBError
from runner.config import TrainConfig
from runner.data import HEADER_INTS, MAGIC, MixtureBatches, read_shard, user_source, write_shard
from runner.model import GPT
from runner.optim import lr_at, param_groups
from runner.train import CHECKPOINT, RECORD, train

TINY = {"n_layer": 1, "d_model": 32, "seq_len": 32, "batch_size": 8, "eval_batches": 1, "threads": 1}


def tiny(**over) -> TrainConfig:
    return TrainConfig.from_dict({**TINY, **over})


def points(curve):
    return [(int(p[0]), float(p[1])) for p in curve]


def cyclic_shard(path, start: int, period: int, n: int = 4096):
    """A source whose next token is always determined: start, start+1, ..., start+period-1, start, ..."""
    return write_shard(path, start + np.arange(n) % period)


# ---- learning and failing ------------------------------------------------------------------------

def test_loss_falls_on_the_builtin_corpus(tmp_path):
    res = train(tiny(max_steps=40, eval_interval=10, lr=3e-3), tmp_path / "run")
    rec = res.record
    assert rec["status"] == "completed" and res.steps_done == 40
    val = points(rec["metrics"]["val/loss"])
    assert [s for s, _ in val] == [10, 20, 30, 40]
    assert val[-1][1] < val[0][1] - 0.2
    train_loss = [v for _, v in points(rec["metrics"]["train/loss"])]
    assert train_loss[0] == pytest.approx(math.log(256), abs=0.3)       # a fresh model guesses uniformly
    assert np.mean(train_loss[-5:]) < train_loss[0] - 1.5
    for source in ("prose", "code"):
        assert rec["metrics"][f"val/loss/{source}"][-1][1] == pytest.approx(rec["summary"][f"val/loss/{source}"])
    # the overall val/loss is the plain mean over sources
    assert rec["summary"]["val/loss"] == pytest.approx(
        (rec["summary"]["val/loss/prose"] + rec["summary"]["val/loss/code"]) / 2)
    assert rec["scale"]["tokens"] == 40 * 8 * 32
    assert rec["scale"]["flops"] == 6 * rec["scale"]["params"] * rec["scale"]["tokens"]
    assert rec["summary"]["tokens_per_sec"] > 0


def test_absurd_learning_rate_diverges_at_the_step_it_blew_up(tmp_path):
    rec = train(tiny(max_steps=50, lr=30.0, warmup_steps=0, grad_clip=0.0), tmp_path / "run").record
    assert rec["status"] == "diverged"
    curve = points(rec["metrics"]["train/loss"])
    first = curve[0][1]
    blown = next(s for s, v in curve if not math.isfinite(v) or v > 3 * first)
    assert rec["failure"]["kind"] == "diverged"
    assert rec["failure"]["step"] == blown > 0
    assert curve[-1][0] == blown                # stopped there: no step after the blow-up
    assert rec["summary"]["stop_reason"] == "diverged"


# ---- checkpoints and resume ---------------------------------------------------------------------

RESUME = {"max_steps": 12, "eval_interval": 4, "checkpoint_interval": 4, "dropout": 0.1, "lr": 3e-3}


def test_resume_after_a_crash_equals_an_uninterrupted_run(tmp_path):
    cfg = tiny(**RESUME)
    whole = train(cfg, tmp_path / "whole").record

    def crash(step, metrics):
        if step == 8:                        # after the step-4 checkpoint, before the step-8 one
            raise RuntimeError("node lost")

    crashed = train(cfg, tmp_path / "crashy", on_eval=crash)
    assert crashed.record["status"] == "failed"
    assert crashed.record["failure"]["kind"] == "exception" and "node lost" in crashed.record["failure"]["message"]
    assert crashed.checkpoint == tmp_path / "crashy" / CHECKPOINT
    resumed = train(cfg, tmp_path / "crashy", resume=True)
    assert resumed.record["status"] == "completed" and resumed.steps_done == 12
    assert resumed.record["id"] == crashed.record["id"]
    # Same ops in the same order on one CPU thread, the same batches (a function of seed and
    # step), the optimizer and RNG state restored: the losses agree to the last bit; 1e-6
    # leaves room for nothing but a different BLAS kernel choice.
    for key in ("train/loss", "val/loss", "val/loss/prose", "lr"):
        got, want = points(resumed.record["metrics"][key]), points(whole["metrics"][key])
        assert [s for s, _ in got] == [s for s, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)


def test_a_cancel_stops_killed_and_resumes(tmp_path):
    cfg = tiny(**RESUME)
    calls = iter(range(1000))
    stopped = train(cfg, tmp_path / "run", should_stop=lambda: next(calls) == 5)     # asked before each step
    assert stopped.record["status"] == "killed" and stopped.steps_done == 5
    assert stopped.record["failure"] == {"kind": "killed", "step": 5, "message": "stopped on request at step 5"}
    again = train(cfg, tmp_path / "run", resume=True)
    assert again.record["status"] == "completed" and again.steps_done == 12
    assert [s for s, _ in points(again.record["metrics"]["train/loss"])] == list(range(12))
    fresh = train(cfg, tmp_path / "run", resume=False)          # resume=False starts afresh
    assert fresh.record["id"] != again.record["id"]


def test_a_checkpoint_of_another_config_is_refused(tmp_path):
    train(tiny(max_steps=2, eval_interval=2), tmp_path / "run")
    with pytest.raises(KBError, match="another config"):
        train(tiny(max_steps=2, eval_interval=2, lr=1e-2), tmp_path / "run", resume=True)


def test_token_and_time_budgets_stop_the_run(tmp_path):
    rec = train(tiny(max_steps=100, eval_interval=50, max_tokens=7 * 8 * 32), tmp_path / "t").record
    assert rec["status"] == "completed" and rec["summary"]["steps"] == 7
    assert rec["summary"]["stop_reason"] == "max_tokens"
    assert points(rec["metrics"]["val/loss"])[-1][0] == 7          # measured where it stopped
    rec = train(tiny(max_steps=100000, eval_interval=1000, max_seconds=0.5), tmp_path / "s").record
    assert rec["summary"]["stop_reason"] == "max_seconds"
    assert 0 < rec["summary"]["steps"] < 100000 and rec["summary"]["wall_seconds"] >= 0.5


# ---- data ------------------------------------------------------------------------------------------

def test_bin_shards_are_read_and_trained_on(tmp_path):
    cyclic_shard(tmp_path / "cyc_train.bin", 0, 10)
    cyclic_shard(tmp_path / "cyc_val.bin", 0, 10, n=512)
    raw = np.fromfile(tmp_path / "cyc_train.bin", dtype=np.int32, count=HEADER_INTS)
    assert list(raw[:3]) == [MAGIC, 1, 4096]
    assert list(read_shard(tmp_path / "cyc_train.bin")[:12]) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    src = user_source("cyc", str(tmp_path / "cyc_*.bin"))
    assert src.tokens("train") == 4096 and src.tokens("val") == 512          # the `val` file validates
    rec = train(tiny(max_steps=30, eval_interval=30, vocab_size=16, lr=1e-2,
                     **{"data.sources": {"cyc": str(tmp_path / "cyc_*.bin")}}), tmp_path / "run").record
    assert rec["config"]["data"] == {"mixture": {"cyc": 1.0}, "sources": {"cyc": src.origin}}
    assert rec["summary"]["val/loss"] < 0.5          # a determined next token is learned


def test_bad_shards_and_sources_are_named(tmp_path):
    bad = tmp_path / "bad.bin"
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (1234, 1, 4)
    bad.write_bytes(header.tobytes() + np.arange(4, dtype=np.uint16).tobytes())
    with pytest.raises(InvalidRecord, match="magic number 1234"):
        read_shard(bad)
    header[:3] = (MAGIC, 1, 100)
    bad.write_bytes(header.tobytes() + np.arange(4, dtype=np.uint16).tobytes())
    with pytest.raises(InvalidRecord, match="header says 100 tokens"):
        read_shard(bad)
    with pytest.raises(InvalidRecord, match="no .bin shard") as exc:
        train(tiny(**{"data.sources": {"web": str(tmp_path / "missing_*.bin")}}), tmp_path / "r")
    assert exc.value.field == "data.sources.web"
    with pytest.raises(InvalidRecord, match="unknown source 'web'"):
        train(tiny(**{"data.mixture": {"web": 0.5, "code": 0.5}}), tmp_path / "r")
    cyclic_shard(tmp_path / "big.bin", 0, 300)
    with pytest.raises(InvalidRecord, match="token 299, beyond vocab_size 256"):
        train(tiny(**{"data.sources": {"big": str(tmp_path / "big.bin")}}), tmp_path / "r")


def test_mixture_weights_change_what_is_sampled(tmp_path):
    sources = {"a": user_source("a", str(cyclic_shard(tmp_path / "a.bin", 0, 10))),
               "b": user_source("b", str(cyclic_shard(tmp_path / "b.bin", 100, 10)))}

    def share_of_a(weights):
        batches = MixtureBatches(sources, weights, seq_len=16, seed=3)
        picked, rows = [], []
        for step in range(50):
            names, windows = batches.draw(step, 40)
            picked += names
            rows.append(windows)
        windows = torch.cat(rows)
        from_a = windows.max(dim=1).values < 100                       # the tokens say where a row came from
        assert [n == "a" for n in picked] == from_a.tolist()
        return from_a.float().mean().item()

    # 2000 rows each: the binomial sd of a share is at most 0.011, so 0.05 is over 4 sd
    assert share_of_a({"a": 0.8, "b": 0.2}) == pytest.approx(0.8, abs=0.05)
    assert share_of_a({"a": 0.2, "b": 0.8}) == pytest.approx(0.2, abs=0.05)
    assert share_of_a({"a": 0.0, "b": 1.0}) == 0.0
    same = MixtureBatches(sources, {"a": 0.5, "b": 0.5}, seq_len=16, seed=3)
    assert torch.equal(same.draw(7, 8)[1], same.draw(7, 8)[1])       # a batch is a function of (seed, step)


def test_the_builtin_corpus_has_two_domains_split_by_file(tmp_path):
    from runner.data import builtin_source, default_cache_dir
    prose = builtin_source("prose", default_cache_dir())
    code = builtin_source("code", default_cache_dir())
    assert prose.tokens("train") > 10**6 and code.tokens("train") > 10**6
    assert 0.05 < prose.tokens("val") / prose.tokens("train") < 0.25
    text = lambda s: bytes(np.asarray(s.train[0][:20000], dtype=np.uint8)).decode("utf-8", "replace")
    # code is full of defs, colons and brackets; docstrings are mostly words
    assert text(code).count("def ") > 5 * max(1, text(prose).count("def "))
    assert text(prose).count(" the ") > text(code).count(" the ")


# ---- options -----------------------------------------------------------------------------------

def scale_invariant_queries(model) -> bool:
    """With QK-norm the output ignores the scale of the query weights; without, it does not."""
    x = torch.randint(0, 256, (2, 16))
    model.eval()
    with torch.no_grad():
        before = model(x)
        model.blocks[0].attn.qkv.weight[:model.cfg.d_model] *= 10
        return torch.allclose(before, model(x), atol=1e-4)


OPTIONS = [
    ({"pos": "rope"}, lambda m: m.wpe is None and hasattr(m, "rope_cos")),
    ({"norm": "rmsnorm"}, lambda m: isinstance(m.norm_f, torch.nn.RMSNorm)),
    ({"norm_position": "post"}, lambda m: isinstance(m.norm_f, torch.nn.Identity)),
    ({"activation": "swiglu"}, lambda m: m.blocks[0].mlp.fc.out_features == 2 * 128),
    ({"activation": "relu2"}, lambda m: m.blocks[0].mlp.activation == "relu2"),
    ({"qk_norm": True}, lambda m: scale_invariant_queries(m)),
    ({"n_head": 4, "n_kv_head": 1}, lambda m: m.blocks[0].attn.qkv.out_features == 32 + 2 * 8),
    ({"tie_embeddings": False}, lambda m: m.lm_head.weight is not m.wte.weight),
    ({"dropout": 0.2}, lambda m: m.drop.p == 0.2),
    ({"optimizer": "muon"}, None),
    ({"schedule": "linear"}, None),
    ({"schedule": "wsd", "decay_frac": 0.5}, None),
    ({"micro_batch_size": 2}, None),
    ({"weight_decay": 0.0, "grad_clip": 0.0, "beta1": 0.8, "beta2": 0.99}, None),
    ({"warmup_steps": 0, "min_lr": 0.0}, None),
]


def test_qk_norm_check_can_fail():
    assert not scale_invariant_queries(GPT(tiny().resolved().model_config()))


@pytest.mark.parametrize("option,check", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items())
                         if isinstance(o, dict) else "")
def test_every_option_builds_and_runs_a_step(tmp_path, option, check):
    cfg = tiny(max_steps=2, eval_interval=2, **option)
    if check is not None:
        assert check(GPT(cfg.resolved().model_config()))
    rec = train(cfg, tmp_path / "run").record
    assert rec["status"] == "completed"
    assert all(math.isfinite(v) for _, v in points(rec["metrics"]["train/loss"]))
    for key, value in option.items():
        assert rec["config"][key] == value         # stored under its canonical name


def test_muon_takes_the_hidden_matrices_and_learns(tmp_path):
    model = GPT(tiny().resolved().model_config())
    groups = param_groups(model)
    assert groups["hidden"] and all(p.ndim == 2 for p in groups["hidden"])
    hidden = {id(p) for p in groups["hidden"]}
    assert id(model.wte.weight) not in hidden and id(model.blocks[0].norm1.weight) not in hidden
    rec = train(tiny(max_steps=30, eval_interval=30, optimizer="muon", lr=3e-3), tmp_path / "run").record
    loss = [v for _, v in points(rec["metrics"]["train/loss"])]
    assert np.mean(loss[-5:]) < loss[0] - 1.5


def test_a_muon_step_is_an_orthogonalised_update_at_adamw_scale(tmp_path):
    from runner.data import default_cache_dir
    from runner.train import Run
    cfg = tiny(optimizer="muon", lr=1e-2, warmup_steps=0, weight_decay=0.0).resolved()
    run = Run(cfg, tmp_path, default_cache_dir(), {})
    w = run.model.blocks[0].mlp.fc.weight               # 128 x 32
    before = w.detach().clone()
    run.train_step()
    update = (w.detach() - before) / (0.2 * cfg.lr * math.sqrt(max(w.shape)))     # Moonshot's RMS match
    sv = torch.linalg.svdvals(update)
    # Newton-Schulz takes singular values to about 0.7-1.2 (its quintic's band), except the
    # directions the gradient barely has, which five iterations lift only part of the way
    assert sv.max() < 1.5 and (sv > 0.5).float().mean() > 0.9
    emb = run.model.wte.weight.grad is None and run.optimizers[-1].state[run.model.wte.weight]["step"] == 1
    assert emb                                           # the embedding took its step on AdamW


def test_seeds_decide_everything(tmp_path):
    loss = lambda seed, d: points(train(tiny(max_steps=3, eval_interval=3, dropout=0.1, seed=seed),
                                        tmp_path / d).record["metrics"]["train/loss"])
    assert loss(1, "a") == loss(1, "b")
    assert loss(1, "a") != loss(2, "c")


def test_schedules():
    cfg = tiny(max_steps=100, lr=1.0, min_lr=0.1, warmup_steps=10).resolved()
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(100, cfg) == pytest.approx(0.1)
    assert lr_at(55, cfg) == pytest.approx(0.55)                      # cosine's midpoint
    wsd = tiny(max_steps=100, lr=1.0, min_lr=0.0, warmup_steps=10, schedule="wsd", decay_frac=0.2).resolved()
    assert [lr_at(s, wsd) for s in (10, 50, 80)] == [1.0, 1.0, 1.0]
    assert lr_at(90, wsd) == pytest.approx(0.5) and lr_at(100, wsd) == pytest.approx(0.0)
    lin = tiny(max_steps=100, lr=1.0, min_lr=0.0, warmup_steps=0, schedule="linear").resolved()
    assert lr_at(25, lin) == pytest.approx(0.75)


# ---- config --------------------------------------------------------------------------------------

def test_config_reads_nested_aliases_and_derives_from_depth():
    cfg = TrainConfig.from_dict({"model": {"depth": 6}, "optim": {"learning_rate": 1e-3},
                                 "data.mixture.prose": 0.25, "data": {"mixture": {"code": 0.75}}}).resolved()
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.lr) == (6, 384, 6, 1e-3)
    assert cfg.min_lr == pytest.approx(1e-4)
    assert cfg.data_mixture == {"prose": 0.25, "code": 0.75}
    assert TrainConfig.from_dict({"n_layer": 8}).resolved().d_model == 512
    assert TrainConfig.from_dict({"n_layer": 2}).resolved().lr == pytest.approx(
        2 ** 0.5 * TrainConfig.from_dict({"n_layer": 4}).resolved().lr)
    # the record's config reads back into the same config
    again = TrainConfig.from_dict(cfg.to_config()).resolved()
    assert again.to_config() == cfg.to_config()


def test_a_stored_config_trains_again_as_it_was(tmp_path):
    write_shard(tmp_path / "a_train.bin", np.arange(3000) % 7)
    write_shard(tmp_path / "b1.bin", np.arange(3000) % 5)
    write_shard(tmp_path / "b2.bin", np.arange(3000) % 3)
    write_shard(tmp_path / "b_held.bin", np.arange(1000) % 5)
    sources = {"a": str(tmp_path / "a_train.bin"), "b": str(tmp_path / "b?.bin"),
               "c": {"train": str(tmp_path / "b1.bin"), "val": str(tmp_path / "b_held.bin")}}
    first = train(tiny(max_steps=3, eval_interval=3, **{"data.sources": sources,
                  "data.mixture": {"a": 0.3, "b": 0.3, "c": 0.2, "code": 0.2}}), tmp_path / "one").record
    origins = first["config"]["data"]["sources"]
    assert origins["code"] == "builtin:code" and origins["b"] == [str(tmp_path / "b1.bin"), str(tmp_path / "b2.bin")]
    assert origins["c"] == {"train": [str(tmp_path / "b1.bin")], "val": [str(tmp_path / "b_held.bin")]}
    again = train(TrainConfig.from_dict(first["config"]), tmp_path / "two").record
    assert again["config"] == first["config"]
    assert again["metrics"]["train/loss"] == first["metrics"]["train/loss"]


@pytest.mark.parametrize("bad,field,words", [
    ({"n_layers_total": 3}, "n_layers_total", "unknown option"),
    ({"norm": "batchnorm"}, "norm", "not one of layernorm, rmsnorm"),
    ({"lr": -1}, "lr", "outside (0, inf)"),
    ({"lr": float("nan")}, "lr", "not a finite number"),
    ({"n_layer": 2.5}, "n_layer", "not a whole number"),
    ({"qk_norm": "yes"}, "qk_norm", "not true or false"),
    ({"data.mixture": {"prose": 0.5, "code": 0.2}}, "data.mixture", "sum to 0.7"),
    ({"data.mixture": {"prose": -0.5, "code": 1.5}}, "data.mixture.prose", ">= 0"),
    ({"lr": 1e-3, "optim": {"lr": 2e-3}}, "optim.lr", "set twice"),
])
def test_bad_configs_name_the_key(bad, field, words):
    with pytest.raises(InvalidRecord) as exc:
        TrainConfig.from_dict(bad)
    assert exc.value.field == field and words in exc.value.error


def test_derived_shapes_that_cannot_work_are_errors():
    with pytest.raises(InvalidRecord, match="not a multiple of n_kv_head"):
        tiny(n_head=4, n_kv_head=3).resolved()
    with pytest.raises(InvalidRecord, match="not a multiple of micro_batch_size"):
        tiny(micro_batch_size=3).resolved()


# ---- the record in the store ------------------------------------------------------------------

def test_the_record_is_stored_and_read_back(kb, tmp_path):
    res = train(tiny(max_steps=6, eval_interval=3), tmp_path / "run", record_fields={"tags": ["proxy", "t"]})
    rec = res.record
    assert rec["code"]["git_commit"] and rec["code"]["host"] and rec["code"]["argv"]
    assert rec["meta"]["runner"]["torch"] == torch.__version__
    report = kb.ingest_records([rec], source="test-trainer", index=False)
    assert report.added == 1 and not report.failed
    got = kb.run(rec["id"])
    assert got.status == "completed" and got.config == rec["config"]
    assert got.scale["params"] == rec["scale"]["params"]
    assert set(got.metrics) == set(rec["metrics"])
    for key, curve in rec["metrics"].items():
        assert points(got.metrics[key]) == points(curve)
    assert kb.runs(where="config.data.mixture.prose = 0.5 and config.n_layer = 1")[0].id == rec["id"]


def test_a_nan_diverged_record_is_stored_with_its_failure(kb, tmp_path):
    # no blow-up threshold to speak of: the run goes on until the loss is NaN
    res = train(tiny(max_steps=50, lr=1e8, warmup_steps=0, grad_clip=0.0, divergence_factor=1e30),
                tmp_path / "run")
    rec = res.record
    step = rec["failure"]["step"]
    assert rec["status"] == "diverged" and "not finite" in rec["failure"]["message"]
    assert math.isnan(rec["metrics"]["train/loss"][-1][1]) and rec["metrics"]["train/loss"][-1][0] == step
    assert all(math.isfinite(v) for _, v in points(rec["metrics"]["train/loss"])[:-1])
    assert kb.ingest_records([rec], source="test-trainer", index=False).added == 1
    got = kb.run(rec["id"])
    assert got.status == "diverged"
    assert ("diverged", step) in [(f["kind"], f["step"]) for f in got.failures]
    assert math.isnan(got.metrics["train/loss"][-1][1])
    saved = json.loads((tmp_path / "run" / RECORD).read_text())     # kept beside the checkpoint
    assert saved["id"] == rec["id"] and saved["metrics"]["train/loss"][-1][1] == "NaN"


# ---- GPU --------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bf16 autocast, torch.compile, MFU)")
def test_gpu_run_uses_bf16_compile_and_reports_mfu(tmp_path):
    rec = train(TrainConfig.from_dict({"n_layer": 2, "max_steps": 20, "eval_interval": 10}), tmp_path / "run").record
    assert rec["status"] == "completed"
    runner = rec["meta"]["runner"]
    assert runner["precision"] == "bf16" and runner["compiled"]
    assert 0 < rec["summary"]["mfu"] < 1 or "H" not in runner["device"]


def test_a_depth_change_carries_what_followed_the_depth_rule():
    stored = TrainConfig.from_dict(TrainConfig.from_dict({"n_layer": 4}).resolved().to_config())
    deeper = stored.with_depth(8).resolved()
    assert (deeper.d_model, deeper.n_head, deeper.lr) == (512, 8, TrainConfig(n_layer=8).resolved().lr)
    custom = TrainConfig.from_dict(TrainConfig.from_dict({"n_layer": 4, "d_model": 128, "lr": 1e-3}).resolved().to_config())
    deeper = custom.with_depth(8).resolved()
    assert (deeper.d_model, deeper.n_head, deeper.lr, deeper.min_lr) == (128, 2, 1e-3, pytest.approx(1e-4))


def test_the_readme_example_runs(tmp_path, monkeypatch):
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Proxy trainer", 1)[1].split("\n## ", 1)[0]
    [code] = re.findall(r"```python\n(.*?)```", section, re.S)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    saved = json.loads((tmp_path / "proxy-run" / RECORD).read_text())
    assert saved["status"] == "completed" and saved["config"]["data"]["mixture"] == {"prose": 0.7, "code": 0.3}


def test_the_command_line_entry(tmp_path, capsys):
    from runner.train import main
    rc = main(["--workdir", str(tmp_path / "w"), "--set", "n_layer=1", "--set", "d_model=32", "--set", "seq_len=32",
               "--set", "batch_size=4", "--set", "max_steps=2", "--set", "eval_interval=2", "--set", "norm=rmsnorm"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["status"] == "completed"
    assert json.loads((tmp_path / "w" / RECORD).read_text())["config"]["norm"] == "rmsnorm"
    assert main(["--workdir", str(tmp_path / "w"), "--set", "norm=batchnorm"]) == 2
    assert "norm: 'batchnorm' is not one of" in capsys.readouterr().err
