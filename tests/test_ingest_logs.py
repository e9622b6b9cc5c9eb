"""The training-log ingester: real logs captured from tiny torch training scripts run as
subprocesses (a clean run, a NaN divergence, a crash, a SIGKILL reported by the launching shell,
ranks under torchrun), verbatim excerpts of public logs in tests/data/logs (modded-nanogpt's
speedrun, llm.c's stdout and main.log, nanoGPT, Megatron, NeMo, MLPerf; tests/data/logs/README.md
says where each comes from), plus short literal samples of failure messages (OOM/NCCL/Xid)."""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlmodel import Session

from ingest.log_code import find_code
from ingest.log_config import arithmetic, literal
from ingest.logs import LogIngester, classify_failure, parse_log, parse_metric_line
from ingest.notes import NotesIngester
from kb.records import Parsed, Rejected

DATA = Path(__file__).parent / "data" / "logs"

TRAIN = textwrap.dedent('''
    """A nanoGPT-shaped toy loop: linear regression, printing the lines nanoGPT prints."""
    import argparse, json, os, time
    import torch

    torch.set_num_threads(1)
    p = argparse.ArgumentParser()
    p.add_argument("--name", default="run")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--crash_at", type=int, default=-1)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95))
    p.add_argument("--truth", default="truth.json")
    args = p.parse_args()
    print(f"Overriding: learning_rate = {args.lr}")
    print("Overriding: batch_size = 8")
    print(args)
    print(f"pid {os.getpid()}", flush=True)
    torch.manual_seed(0)
    w_true = torch.randn(4, 1)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    truth = {"train": [], "val": []}
    for it in range(args.steps):
        if it == args.crash_at:
            torch.randn(8, 4) @ torch.randn(3, 5)      # a real shape bug
        x = torch.randn(8, 4)
        if it % 5 == 0:
            with torch.no_grad():
                xv = torch.randn(64, 4)
                val = torch.nn.functional.mse_loss(model(xv), xv @ w_true).item()
            truth["val"].append([it, val])
            print(f"step {it}: train loss {val:.4f}, val loss {val:.4f}")
        t0 = time.time()
        loss = torch.nn.functional.mse_loss(model(x), x @ w_true)
        opt.zero_grad()
        loss.backward()
        opt.step()
        truth["train"].append([it, loss.item()])
        with open(args.truth, "w") as fh:
            json.dump(truth, fh)
        print(f"iter {it}: loss {loss.item():.4f}, time {(time.time() - t0) * 1000:.2f}ms, mfu -100.00%", flush=True)
        time.sleep(args.sleep)
''')


def _run(tmp: Path, name: str, *args: str, kill_after: int | None = None) -> tuple[str, dict]:
    """Run the script the way a launcher does (`bash -c '...' > log 2>&1`); return (log text, truth)."""
    script = tmp / "train.py"
    truth = tmp / f"{name}.truth.json"
    cmd = f"{sys.executable} -u {script} --name {name} --truth {truth} {' '.join(args)}; exit $?"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(["bash", "-c", cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp, env=env)
    lines, pid = [], None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("pid "):
            pid = int(line.split()[1])
        if kill_after is not None and line.startswith(f"iter {kill_after}:"):
            os.kill(pid, signal.SIGKILL)     # the python child, so bash reports it as a launcher would
            break
    lines.extend(proc.stdout.readlines())
    proc.wait(timeout=60)
    log = "".join(lines)
    (tmp / f"{name}.log").write_text(log)
    return log, json.loads(truth.read_text())


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("logs")
    (tmp / "train.py").write_text(TRAIN)
    runs = {"normal": ("--steps", "20"), "nan": ("--lr", "1e6", "--steps", "30"),
            "crash": ("--steps", "20", "--crash_at", "7"), "killed": ("--steps", "1000", "--sleep", "0.05")}
    # side by side: each one mostly waits for `import torch`
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {name: pool.submit(_run, tmp, name, *args, kill_after=5 if name == "killed" else None)
                   for name, args in runs.items()}
        out = {name: f.result() for name, f in futures.items()}
    return out | {"dir": tmp}


def _assert_points(parsed: list, truth: list, places: int = 4):
    assert [p[0] for p in parsed] == [t[0] for t in truth]
    for (_, got), (step, want) in zip(parsed, truth):
        if math.isfinite(want):
            assert got == pytest.approx(round(want, places), abs=10 ** -places), step
        else:
            assert not math.isfinite(got) and (math.isnan(got) == math.isnan(want)), step


def test_clean_run_parses_every_printed_point_and_config(logs):
    text, truth = logs["normal"]
    rec = parse_log(text, "normal")
    _assert_points(rec["metrics"]["train/loss"], truth["train"])   # the iter line wins over the eval line
    _assert_points(rec["metrics"]["val/loss"], truth["val"])
    assert len(rec["metrics"]["time_ms"]) == 20 and rec["metrics"]["mfu"][0] == [0, -100.0]
    cfg = rec["config"]
    assert cfg["learning_rate"] == 0.05 and isinstance(cfg["learning_rate"], float)
    assert cfg["batch_size"] == 8 and isinstance(cfg["batch_size"], int)
    assert cfg["lr"] == 0.05 and cfg["steps"] == 20 and cfg["name"] == "normal"
    assert cfg["betas"] == [0.9, 0.95] and cfg["crash_at"] == -1
    assert rec["status"] == "completed" and "failure" not in rec
    assert rec["meta"]["log_tail"].splitlines()[-1] == text.splitlines()[-1]


def test_ingester_detects_and_validates_a_real_log(logs):
    path = logs["dir"] / "normal.log"
    assert LogIngester().detect(str(path)) == 85
    items = list(LogIngester().read(str(path)))
    assert len(items) == 1 and isinstance(items[0], Parsed)
    record = items[0].record
    assert record.name == "normal" and record.status == "completed" and items[0].source_kind == "log"
    txt = logs["dir"] / "normal.txt"
    txt.write_text(logs["normal"][0])
    assert LogIngester().detect(str(txt)) == 85 and NotesIngester().detect(str(txt)) == 0


def test_nan_run_is_diverged_at_the_first_nonfinite_step(logs):
    text, truth = logs["nan"]
    rec = parse_log(text, "nan")
    _assert_points(rec["metrics"]["train/loss"], truth["train"])
    first_bad = next(s for s, v in truth["train"] if not math.isfinite(v))
    assert rec["status"] == "diverged"
    f = rec["failure"]
    assert f["kind"] == "diverged" and f["step"] == first_bad
    assert f"iter {first_bad}: loss " in f["evidence"]
    assert f["message"].startswith("train/loss is ")


def test_crash_is_an_exception_with_type_message_and_last_step(logs):
    text, truth = logs["crash"]
    rec = parse_log(text, "crash")
    assert rec["status"] == "failed"
    f = rec["failure"]
    assert f["kind"] == "exception"
    assert f["message"].startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    assert f["step"] == truth["train"][-1][0] == 6
    assert f["evidence"].splitlines()[-1] == f["message"]
    assert "train.py" in f["evidence"] and "@ torch.randn(3, 5)" in f["evidence"]
    _assert_points(rec["metrics"]["train/loss"], truth["train"])


def test_sigkill_reported_by_the_shell_is_killed(logs):
    text, truth = logs["killed"]
    assert "Killed" in text.splitlines()[-1]       # bash's own report, as in a job log
    rec = parse_log(text, "killed")
    assert rec["status"] == "killed"
    f = rec["failure"]
    assert f["kind"] == "killed" and "Killed" in f["message"]
    last_printed = max(int(line.split()[1].rstrip(":")) for line in text.splitlines() if line.startswith("iter "))
    assert f["step"] == last_printed and last_printed >= 5


def test_diverged_log_goes_through_the_store(logs, engine):
    from kb.runs import read_detail, write_run
    from kb.models import Run

    (item,) = LogIngester().read(str(logs["dir"] / "nan.log"))
    with Session(engine) as s, s.begin():
        outcome, run_id = write_run(s, item.record, item.source_kind, item.source_uri)
    with Session(engine) as s:
        detail = read_detail(s, s.get(Run, run_id))
    assert outcome == "added" and detail.status == "diverged"
    assert [f["kind"] for f in detail.failures] == ["diverged"]
    assert any(a["kind"] == "divergence" for a in detail.anomalies)
    assert detail.config["learning_rate"] == 1e6


# ---- fixed samples of formats no local library writes ----------------------------------------

MEGATRON = """\
------------------------ arguments ------------------------
  global_batch_size ............................... 512
  lr .............................................. 0.0003
  num_layers ...................................... 24
  bf16 ............................................ True
  optimizer ....................................... adam
-------------------- end of arguments ---------------------
 [2024-05-01 10:00:00] iteration      100/   10000 | consumed samples:        51200 | elapsed time per iteration (ms): 1234.5 | learning rate: 3.000E-04 | global batch size:   512 | lm loss: 6.123000E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |
 [2024-05-01 10:02:00] iteration      200/   10000 | consumed samples:       102400 | elapsed time per iteration (ms): 1200.1 | learning rate: 2.990E-04 | global batch size:   512 | lm loss: 5.001000E+00 | loss scale: 1.0 | grad norm: 0.876 | number of skipped iterations:   0 | number of nan iterations:   0 |
-----------------------------------------------------------------------------------------------
 validation loss at iteration 200 | lm loss value: 4.900000E+00 | lm loss PPL: 1.342898E+02 |
-----------------------------------------------------------------------------------------------
"""


def test_megatron_lines_and_argument_dump():
    rec = parse_log(MEGATRON, "megatron")
    m = rec["metrics"]
    assert m["train/loss"] == [[100, 6.123], [200, 5.001]]
    assert m["lr"] == [[100, 3e-4], [200, 2.99e-4]]
    assert m["grad_norm"] == [[100, 1.234], [200, 0.876]]
    assert m["elapsed_time_per_iteration_ms"][1] == [200, 1200.1]
    assert m["consumed_samples"][0] == [100, 51200.0]
    assert m["number_of_nan_iterations"] == [[100, 0.0], [200, 0.0]]
    assert m["val/loss"] == [[200, 4.9]] and m["val/ppl"] == [[200, 134.2898]]
    assert "loss_scale" in m
    assert rec["config"] == {"global_batch_size": 512, "lr": 0.0003, "num_layers": 24, "bf16": True,
                             "optimizer": "adam"}
    assert rec["meta"]["total_steps"] == 10000 and rec["status"] == "completed"


LLMC = """\
val loss 10.985000
step    1/5000 | train loss 10.980000 | norm 5.2000 | lr 6.00e-06 | (123.40 ms | 41234 tok/s)
step    2/5000 | train loss 10.500000 | norm 4.1000 | lr 1.20e-05 | (120.00 ms | 42000 tok/s)
val loss 10.100000
step    3/5000 | train loss nan | norm nan | lr 1.80e-05 | (119.00 ms | 42100 tok/s)
"""


def test_llmc_lines_assign_val_loss_to_the_step_it_follows():
    rec = parse_log(LLMC, "llmc")
    m = rec["metrics"]
    assert m["val/loss"] == [[0, 10.985], [2, 10.1]]
    assert m["train/loss"][:2] == [[1, 10.98], [2, 10.5]] and math.isnan(m["train/loss"][2][1])
    assert m["grad_norm"][0] == [1, 5.2] and m["lr"][1] == [2, 1.2e-5]
    assert m["time_ms"][0] == [1, 123.4] and m["tokens_per_sec"][0] == [1, 41234.0]
    assert rec["status"] == "diverged" and rec["failure"]["step"] == 3
    assert "train loss nan" in rec["failure"]["evidence"]


def test_torchrun_rank_prefixes_keep_rank0_and_find_the_oom():
    text = "\n".join([
        "[rank0]: iter 1: loss 2.0000, time 10.00ms, mfu 1.00%",
        "[rank1]: iter 1: loss 2.5000, time 10.00ms, mfu 1.00%",
        "[rank0]: iter 2: loss 1.9000, time 10.00ms, mfu 1.00%",
        "[rank1]: iter 2: loss 2.4000, time 10.00ms, mfu 1.00%",
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "/w/train.py", line 331, in <module>',
        "[rank0]: iter 3: loss 1.8000, time 10.00ms, mfu 1.00%",
        "[rank1]:     logits, loss = model(X, Y)",
        "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total "
        "capacity of 79.15 GiB of which 1.02 GiB is free.",
        "W0501 10:00:00.000000 123 torch/distributed/elastic/multiprocessing/api.py:897] Sending process 124 "
        "closing signal SIGTERM",
    ])
    rec = parse_log(text, "ddp")
    assert rec["metrics"]["train/loss"] == [[1, 2.0], [2, 1.9], [3, 1.8]]
    f = rec["failure"]
    assert f["kind"] == "oom" and f["step"] == 2 and rec["status"] == "failed"
    assert f["message"].startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert "logits, loss = model(X, Y)" in f["evidence"] and "iter 3" not in f["evidence"]


def test_srun_labels_key_value_and_json_lines():
    text = "\n".join([
        "0: step=10 loss=2.3450 lr=3.0e-04 grad_norm=0.91",
        "0: step: 20, loss: 2.1000, lr: 2.5e-04",
        '{"step": 30, "loss": 2.0, "tokens_per_sec": 1000}',
        "1: step=10 loss=9.9",
    ])
    rec = parse_log(text, "srun")
    assert rec["metrics"]["train/loss"] == [[10, 2.345], [20, 2.1], [30, 2.0]]
    assert rec["metrics"]["lr"] == [[10, 3e-4], [20, 2.5e-4]]
    assert rec["metrics"]["grad_norm"] == [[10, 0.91]] and rec["metrics"]["tokens_per_sec"] == [[30, 1000.0]]


def test_json_config_dump_at_the_top():
    text = "\n".join([
        "config:",
        "{",
        '  "model": {"n_layer": 4, "d_model": 128},',
        '  "optim": {"lr": 0.001, "betas": [0.9, 0.95]}',
        "}",
        "step 1 | loss 3.0",
        "step 2 | loss 2.5",
    ])
    rec = parse_log(text, "cfg")
    assert rec["config"] == {"model": {"n_layer": 4, "d_model": 128}, "optim": {"lr": 0.001, "betas": [0.9, 0.95]}}
    assert rec["metrics"]["train/loss"] == [[1, 3.0], [2, 2.5]]


def test_yaml_dump_at_the_top_is_nested_config():
    yaml = pytest.importorskip("yaml")
    dumped = yaml.safe_dump({"model": {"n_layer": 12, "d_model": 768}, "optim": {"lr": 3e-4, "betas": [0.9, 0.95]},
                             "resume": None, "compile": True, "data": "/data/fineweb/*.bin"}, sort_keys=False)
    rec = parse_log(dumped + "step 1 | loss 3.0\nstep 2 | loss 2.5\n", "yaml")
    assert rec["config"] == {"model": {"n_layer": 12, "d_model": 768}, "optim": {"lr": 3e-4, "betas": [0.9, 0.95]},
                             "resume": None, "compile": True, "data": "/data/fineweb/*.bin"}


MLPERF = """\
:::MLLOG {"namespace": "", "time_ms": 1714557600000, "event_type": "POINT_IN_TIME", "key": "submission_benchmark", "value": "gpt3", "metadata": {"file": "train.py", "lineno": 10}}
:::MLLOG {"namespace": "", "time_ms": 1714557600001, "event_type": "POINT_IN_TIME", "key": "global_batch_size", "value": 1536, "metadata": {"file": "train.py", "lineno": 11}}
:::MLLOG {"namespace": "", "time_ms": 1714557600002, "event_type": "POINT_IN_TIME", "key": "opt_base_learning_rate", "value": 2e-05, "metadata": {"file": "train.py", "lineno": 12}}
:::MLLOG {"namespace": "", "time_ms": 1714557600100, "event_type": "INTERVAL_START", "key": "run_start", "value": null, "metadata": {"file": "train.py", "lineno": 20}}
:::MLLOG {"namespace": "", "time_ms": 1714557700000, "event_type": "INTERVAL_START", "key": "epoch_start", "value": null, "metadata": {"file": "train.py", "lineno": 30, "epoch_num": 1}}
:::MLLOG {"namespace": "", "time_ms": 1714557800000, "event_type": "POINT_IN_TIME", "key": "eval_accuracy", "value": 2.95, "metadata": {"file": "train.py", "lineno": 40, "epoch_num": 1}}
:::MLLOG {"namespace": "", "time_ms": 1714557900000, "event_type": "POINT_IN_TIME", "key": "eval_accuracy", "value": 2.69, "metadata": {"file": "train.py", "lineno": 40, "epoch_num": 2}}
:::MLLOG {"namespace": "", "time_ms": 1714558000000, "event_type": "INTERVAL_END", "key": "run_stop", "value": null, "metadata": {"file": "train.py", "lineno": 50, "status": "success"}}
"""


def test_mlperf_events_become_config_and_metrics(tmp_path):
    rec = parse_log(MLPERF, "mlperf")
    assert rec["config"] == {"submission_benchmark": "gpt3", "global_batch_size": 1536, "opt_base_learning_rate": 2e-05}
    assert rec["metrics"]["eval_accuracy"] == [[1, 2.95, 1714557800.0], [2, 2.69, 1714557900.0]]
    assert rec["started_at"] == "2024-05-01T10:00:00.100000" and rec["meta"]["mlperf_status"] == "success"
    path = tmp_path / "result_0.txt"
    path.write_text(MLPERF)
    assert LogIngester().detect(str(path)) == 85
    (item,) = LogIngester().read(str(path))
    assert item.record.started_at.year == 2024


# ---- failure messages ------------------------------------------------------------------------

BEFORE = ["iter 10: loss 3.0000, time 1.00ms", "iter 20: loss 2.9000, time 1.00ms"]


@pytest.mark.parametrize("lines,kind,needle", [
    (["RuntimeError: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"], "oom", "CUBLAS"),
    (["[E ProcessGroupNCCL.cpp:475] [Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, "
      "OpType=ALLREDUCE, NumelIn=1, Timeout(ms)=600000) ran for 600013 milliseconds before timing out.",
      "[E ProcessGroupNCCL.cpp:489] Some NCCL operations have failed or timed out."], "nccl_timeout", "Watchdog"),
    (["torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:219, "
      "unhandled system error"], "nccl_timeout", "NCCL error"),
    (["[Thu May  2 10:00:00 2024] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.",
      "iter 21: loss nan, time 1.00ms"], "hardware", "Xid"),
    (["RuntimeError: CUDA error: uncorrectable ECC error encountered"], "hardware", "uncorrectable"),
    (["WARNING: loss is NaN, skipping"], "diverged", "loss is NaN"),
    (["slurmstepd: error: *** JOB 4242 ON node12 CANCELLED AT 2024-05-01T10:00:00 DUE TO TIME LIMIT ***"],
     "timeout", "TIME LIMIT"),
    (["srun: error: node12: task 0: Killed"], "killed", "Killed"),
    (["torch.distributed.elastic.multiprocessing.api.SignalException: Process 42 got signal: 15",
      "exited with signal 15 (SIGTERM)"], "killed", "signal"),
    (["Segmentation fault (core dumped)"], "other", "Segmentation"),
])
def test_failure_messages_are_classified(lines, kind, needle):
    f = classify_failure(BEFORE + lines)
    assert f["kind"] == kind and needle in f["message"]
    assert f["step"] == 20 and needle in f["evidence"]


def test_torchrun_wrapper_traceback_defers_to_the_signal():
    lines = BEFORE + [
        "Traceback (most recent call last):",
        '  File "/usr/bin/torchrun", line 8, in <module>',
        "    sys.exit(main())",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "train.py FAILED",
        "  exitcode  : -9 (pid: 1234)",
        "  traceback : Signal 9 (SIGKILL) received by PID 1234",
    ]
    assert classify_failure(lines)["kind"] == "killed"


def test_clean_lines_have_no_failure():
    assert classify_failure(BEFORE + ["saving checkpoint to out/ckpt.pt", "done."]) is None
    # a handler installed at start-up is not a kill: only the end of a log says how it ended
    startup = ["installed SIGTERM handler for checkpoint-on-preemption"]
    assert classify_failure(startup + [f"iter {i}: loss 2.0" for i in range(60)]) is None
    assert classify_failure(startup + [f"iter {i}: loss 2.0" for i in range(60)] + ["Killed"])["step"] == 59


# ---- what is not a log ---------------------------------------------------------------------------

def test_markdown_and_prose_are_not_logs(tmp_path):
    md = tmp_path / "postmortem.md"
    md.write_text("# Postmortem\n\nStep 1: we lowered the lr to 3e-4 and the loss 2.1 held.\n" * 5)
    assert LogIngester().detect(str(md)) == 0
    prose = tmp_path / "ideas.txt"
    prose.write_text("We trained 3 models for 10 days on 512 GPUs.\nThe loss was fine.\n")
    assert LogIngester().detect(str(prose)) == 0 and NotesIngester().detect(str(prose)) == 60
    assert parse_metric_line("HellaSwag: 2500/10042 = 0.2490") is None
    assert parse_metric_line("number of parameters: 0.80M") is None


def test_a_log_without_metric_lines_is_rejected_by_name(tmp_path):
    path = tmp_path / "slurm-77.out"
    path.write_text("loading modules\nstarting job on node12\n")
    assert LogIngester().detect(str(path)) == 0
    (item,) = LogIngester().read(str(path))
    assert isinstance(item, Rejected)
    assert str(path) in str(item.error) and "no step/metric lines recognised" in str(item.error)
    crashed = tmp_path / "crash.log"
    crashed.write_text("Traceback (most recent call last):\n  File \"t.py\", line 1\nImportError: no torch\n")
    assert LogIngester().detect(str(crashed)) == 40
    (item,) = LogIngester().read(str(crashed))
    assert isinstance(item, Rejected) and "exception: ImportError: no torch" in item.error.error


def test_kb_ingest_reads_a_folder_of_logs_once(logs, tmp_path):
    from kb.api import KnowledgeBase

    folder = tmp_path / "jobs"
    folder.mkdir()
    for name in ("normal", "crash", "killed"):
        (folder / f"{name}.log").write_text(logs[name][0])
    with KnowledgeBase.open(home=tmp_path / "kb") as k:
        first = k.ingest(str(folder), index=False)
        second = k.ingest(str(folder), index=False)
        by_name = {r.name: r for r in k.runs()}
        crash = k.run(by_name["crash"].id)
    assert (first.added, first.failed, second.unchanged) == (3, [], 3)
    assert {n: r.status for n, r in by_name.items()} == {"normal": "completed", "crash": "failed", "killed": "killed"}
    assert crash.failures[0]["kind"] == "exception" and crash.failures[0]["step"] == 6
    assert crash.config["crash_at"] == 7


# ---- logs that print their own source (modded-nanogpt's speedrun) --------------------------------

SPEEDRUN = DATA / "speedrun" / "081087e4-affa-4df9-8b5e-b2aea5b5f688.txt"
SPEEDRUN_CONFIG = {"train_files": "data/fineweb10B/fineweb_train_*.bin",
                   "val_files": "data/fineweb10B/fineweb_val_*.bin", "val_tokens": 10485760, "batch_size": 524288, "num_iterations": 1395, "cooldown_frac": 0.4,
                   "val_loss_every": 125, "seq_len": 65536, "save_checkpoint": False}


def test_speedrun_log_keeps_the_script_as_code_and_its_hyperparameters_as_config():
    text = SPEEDRUN.read_text()
    rec = parse_log(text, "speedrun")
    # the printed `class Hyperparameters` is the config, `8*64*1024` evaluated; nothing else in the
    # script is (`self.attn_scale = 0.12`, `lr=0.05` in a call, `rank = int(...)`, `code = f.read()`)
    assert rec["config"] == SPEEDRUN_CONFIG
    source = rec["code"]["source"]
    assert source.startswith("import os\nimport sys\n") and source.endswith("dist.destroy_process_group()")
    assert rec["code"]["source_sha256"] == hashlib.sha256(source.encode()).hexdigest()
    assert source == text.split("\n\n====", 1)[0]          # all of the script, none of what it printed
    m = rec["metrics"]
    assert m["val/loss"] == [[0, 10.8258], [250, 3.9847], [375, 3.7906], [1375, 3.2856], [1395, 3.2814]]
    assert m["train_time_ms"][1] == [1, 26020.0] and m["step_avg_ms"][0] == [13, 122.56]
    assert rec["meta"]["total_steps"] == 1395 and rec["status"] == "completed" and "failure" not in rec
    assert LogIngester().detect(str(SPEEDRUN)) == 85


def test_speedrun_val_line_is_read():
    assert parse_metric_line("step:125/1390 val_loss:4.3121 train_time:13234ms step_avg:105.87ms") == \
        (125, {"val/loss": 4.3121, "train_time_ms": 13234.0, "step_avg_ms": 105.87})
    assert parse_metric_line("step:1/1395 train_time:26020ms step_avg:nanms") == (1, {"train_time_ms": 26020.0})


# the script in the shape of later speedrun records (annotated fields), with the lines that used to
# come out as config: `self.n_head = config.n_head`, `loss = None`, `raw_model = model.module`, an lr
JUNK_SCRIPT = textwrap.dedent('''\
    """A speedrun-shaped training script; it prints itself first."""
    import os
    import torch
    from dataclasses import dataclass

    @dataclass
    class Hyperparameters:
        train_files : str = "data/fineweb10B/fineweb_train_*.bin" # input .bin to train on
        batch_size : int = 8*64*1024 # batch size, in tokens
        num_iterations : int = 1390 # number of iterations to run
        cooldown_frac : float = 0.4 # fraction of training spent cooling down the learning rate
        lr_peak : float = 3e-4 / 2
        window : int = 2**17
        run_id : str = f"run-{os.getpid()}"
    args = Hyperparameters()

    class CausalSelfAttention(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.n_head = config.n_head
            self.scale = 0.12

    def get_lr(it):
        lr = 1
        return lr * (1 - it / args.num_iterations)

    loss = None
    raw_model = model.module
    # step 100: loss 4.2 is what a good run prints here (a comment, not a metric)
    if os.environ.get("RANK") == "0":
        signal_note = "SIGTERM received"          # strings in code are not how the run ended
        oom_note = "CUDA out of memory"
        print("Traceback (most recent call last):")
    for step in range(args.num_iterations + 1):
        pass
    ''')


def _speedrun_log(script: str, printed: str = "") -> str:
    return script + "\n" + "=" * 100 + "\n" + printed + textwrap.dedent("""\
        Running PyTorch 2.7.0 compiled for CUDA 12.6
        ====================================================================================================
        step:0/1390 val_loss:10.8258 train_time:0ms step_avg:nanms
        step:1/1390 train_time:26020ms step_avg:nanms
        step:125/1390 val_loss:4.3121 train_time:13234ms step_avg:105.87ms
        step:1390/1390 val_loss:3.2790 train_time:147190ms step_avg:105.89ms
        """)


def test_printed_script_yields_its_hyperparameters_evaluated_and_no_key_from_the_code():
    rec = parse_log(_speedrun_log(JUNK_SCRIPT), "train_gpt")
    assert rec["config"] == {"train_files": "data/fineweb10B/fineweb_train_*.bin", "batch_size": 524288,
                             "num_iterations": 1390, "cooldown_frac": 0.4, "lr_peak": 1.5e-4, "window": 131072,
                             "run_id": 'f"run-{os.getpid()}"'}      # not evaluable: kept as its text
    assert rec["code"]["source"] == JUNK_SCRIPT.rstrip("\n")
    assert rec["metrics"]["val/loss"] == [[0, 10.8258], [125, 4.3121], [1390, 3.279]]
    assert rec["status"] == "completed" and "failure" not in rec     # SIGTERM / OOM / Traceback are code


def test_what_the_program_printed_wins_over_the_scripts_defaults():
    printed = textwrap.dedent("""\
        + torchrun --standalone --nproc_per_node=8 train_gpt.py --num_iterations 1500 --lr=3e-4 --betas 0.9 0.95 --compile
        Hyperparameters(batch_size=8*64*1024, num_iterations=1500, cooldown_frac=0.45, val_tokens=10485760)
        """)
    rec = parse_log(_speedrun_log(JUNK_SCRIPT, printed), "train_gpt")
    cfg = rec["config"]
    assert cfg["num_iterations"] == 1500 and cfg["cooldown_frac"] == 0.45 and cfg["val_tokens"] == 10485760
    assert cfg["batch_size"] == 524288 and cfg["lr"] == 3e-4 and cfg["betas"] == [0.9, 0.95] and cfg["compile"] is True
    assert "nproc_per_node" not in cfg and "standalone" not in cfg        # the launcher's, not the run's
    assert rec["code"]["entrypoint"] == "train_gpt.py" and rec["code"]["argv"][0] == "torchrun"


def test_without_a_script_the_printed_repr_alone_is_the_config():
    text = "Hyperparameters(batch_size=8*64*1024, num_iterations=1390, cooldown_frac=0.4)\n" \
           "step:1/1390 train_time:100ms step_avg:100.00ms\n"
    rec = parse_log(text, "r")
    assert rec["config"] == {"batch_size": 524288, "num_iterations": 1390, "cooldown_frac": 0.4} and "code" not in rec


def test_a_script_longer_than_the_detection_head_is_still_a_log(tmp_path):
    body = "".join(f"def f{i}(x):\n    return x * {i}  # {'pad ' * 40}\n\n" for i in range(2000))
    path = tmp_path / "b1e2c3.txt"
    path.write_text(_speedrun_log("import torch\n" + body))
    assert path.stat().st_size > 300_000
    assert LogIngester().detect(str(path)) == 85
    (item,) = LogIngester().read(str(path))
    assert isinstance(item, Parsed) and item.record.code.model_extra["source"].startswith("import torch")


def test_a_printed_config_file_of_assignments_is_config_not_code():
    # nanoGPT prints its config file (configurator.py); verbatim run: tests/data/logs/README.md
    rec = parse_log((DATA / "nanogpt_shakespeare_char.log").read_text(), "shakespeare")
    assert "code" not in rec
    assert rec["config"] == {"out_dir": "out-shakespeare-char", "eval_interval": 250, "eval_iters": 200,
                             "log_interval": 10, "always_save_checkpoint": False, "wandb_log": False,
                             "wandb_project": "shakespeare-char", "wandb_run_name": "mini-gpt",
                             "dataset": "shakespeare_char", "gradient_accumulation_steps": 1, "batch_size": 64,
                             "block_size": 256, "n_layer": 6, "n_head": 6, "n_embd": 384, "dropout": 0.2,
                             "learning_rate": 1e-3, "max_iters": 5000, "lr_decay_iters": 5000, "min_lr": 1e-4,
                             "beta2": 0.99, "warmup_iters": 100, "device": "mps", "compile": False}
    assert rec["metrics"]["val/loss"] == [[0, 4.2823], [250, 2.0676]]
    assert rec["metrics"]["train/loss"][-1] == [260, 1.9755] and rec["metrics"]["mfu"][0] == [0, -100.0]
    # a config file that imports something is still a config file: only assignments, no logic
    with_import = "import time\nout_dir = 'out-shakespeare'\nwandb_run_name = 'ft-' + str(time.time())\n" \
                  "batch_size = 1\ngradient_accumulation_steps = 32\niter 0: loss 4.0\n"
    rec = parse_log(with_import, "ft")
    assert rec["config"] == {"out_dir": "out-shakespeare", "batch_size": 1, "gradient_accumulation_steps": 32}


@pytest.mark.parametrize("module", ["argparse", "dataclasses", "typing"])
def test_a_long_real_script_printed_first_is_kept_whole(module):
    # real source of any size and style: the stdlib's own files, printed the way the speedrun prints itself
    import importlib
    import inspect
    source = inspect.getsource(importlib.import_module(module)).strip("\n")
    rec = parse_log(_speedrun_log(source), module)
    assert rec["code"]["source"] == source
    assert rec["config"] == {} and rec["status"] == "completed"
    assert rec["metrics"]["val/loss"] == [[0, 10.8258], [125, 4.3121], [1390, 3.279]]


def test_code_blocks_are_found_with_their_docstring_and_end_at_the_programs_output():
    lines = ['"""Train a model.', "", 'Usage: python train.py"""', "import os", "", "def main():",
             "    cfg = dict(", "        lr=0.1,", ")", "    return cfg", "", "print(", "    main()", ")",
             '{"step": 1, "loss": 2.0}', "Namespace(lr=0.1)"]
    assert find_code(lines) == [(0, 14)]
    assert find_code(["import os", "x = 1", "y = 2"]) == []          # imports and assignments: a config file
    assert find_code(["lr = 0.1", "step 1: loss 2.0"]) == []


# ---- values: literals and safe arithmetic ----------------------------------------------------------

@pytest.mark.parametrize("text,value", [
    ("8*64*1024", 524288), ("2048 * 24 * 8", 393216), ("3e-4 / 2", 1.5e-4), ("2**17", 131072),
    ("-2**3", -8), ("(1 + 2) * 3", 9), ("7 // 2", 3), ("10 % 4", 2), ("-0.5", -0.5),
])
def test_arithmetic_is_evaluated(text, value):
    assert arithmetic(text) == value and type(arithmetic(text)) is type(value)


@pytest.mark.parametrize("text", ["9**9**9", "10**400", "2**100000", "1/0", "x * 2", "len('ab')", "os.getpid()",
                                  "True * 3", "'a' * 3", "(-8) ** 0.5", "1e308 * 10", "[1] * 3", "2 ** -2000",
                                  "9" * 300])
def test_arithmetic_refuses_names_calls_and_huge_results(text):
    assert arithmetic(text) is None


def test_printed_values_fall_back_to_text_for_bare_words():
    assert literal("8*64*1024 # tokens") == (True, 524288)
    assert literal("'data/*.bin'") == (True, "data/*.bin") and literal("data/*.bin") == (True, "data/*.bin")
    assert literal("torch.bfloat16") == (True, "torch.bfloat16")
    assert literal("the cosine schedule") == (False, None)


# ---- llm.c: stdout and main.log -------------------------------------------------------------------

def test_llmc_gpu_stdout_reads_the_settings_table_and_step_lines():
    path = DATA / "llmc_gpu_stdout.log"
    rec = parse_log(path.read_text(), "llmc")
    cfg = rec["config"]
    assert cfg["micro_batch_size"] == 4 and cfg["sequence_length"] == 1024 and cfg["total_batch_size"] == 4096
    assert cfg["learning_rate"] == 3e-4 and cfg["lr_scheduler"] == "cosine" and cfg["weight_decay"] == 0.0
    assert cfg["num_layers"] == 12 and cfg["num_heads"] == 12 and cfg["channels"] == 768
    assert cfg["num_parameters"] == 124475904 and cfg["device"] == "NVIDIA GeForce RTX 3060 Laptop GPU"
    assert cfg["train_data_pattern"] == "dev/data/tinyshakespeare/tiny_shakespeare_train.bin"
    assert "parameter" not in cfg and "zero_optimization_is_disabled" not in cfg
    m = rec["metrics"]
    assert m["val/loss"] == [[0, 4.503414]]
    assert m["train/loss"] == [[1, 4.283499], [42, 3.364718], [43, 3.361276]]
    assert m["grad_norm"][0] == [1, 13.0082] and m["lr"][0] == [1, 3e-4] and m["time_ms"][0] == [1, 349.48]
    assert m["mfu"][0] == [1, -100.0] and m["tokens_per_sec"][0] == [1, 11720.0]
    assert rec["meta"]["total_steps"] == 74 and rec["status"] == "completed"


def test_llmc_cpu_stdout():
    rec = parse_log((DATA / "llmc_cpu_stdout.txt").read_text(), "llmc-cpu")
    assert rec["config"] == {"max_seq_len": 1024, "vocab_size": 50257, "num_layers": 12, "num_heads": 12,
                             "channels": 768, "num_parameters": 124439808, "num_activations": 73323776}
    assert rec["metrics"]["val/loss"] == [[0, 5.252026], [39, 4.107781]]
    assert [p[0] for p in rec["metrics"]["train/loss"]] == [0, 1, 2, 3, 39]
    assert rec["metrics"]["took_ms"][0] == [0, 1452.121]


def test_llmc_main_log_is_claimed_and_named_by_its_folder():
    path = DATA / "gpt2_124M_shakespeare" / "main.log"
    assert LogIngester().detect(str(path)) == 85
    (item,) = LogIngester().read(str(path))
    record = item.record
    assert record.name == "gpt2_124M_shakespeare"
    assert record.metrics["train/loss"] == [(0, 4.2835), (41, 3.3647), (42, 3.3613)]
    assert record.metrics["val/loss"] == [(0, 4.5034)]
    assert record.metrics["lr"][0] == (0, 0.0003) and record.metrics["grad_norm"][0] == (0, 13.01)
    # tel only (modded-nanogpt's GPT-2 medium record), under another name
    rec = parse_log((DATA / "gpt2_medium" / "main.log").read_text(), "main")
    assert rec["metrics"]["val/loss"][0] == [0, 10.983] and rec["metrics"]["val/loss"][-1] == [60000, 2.9282]
    renamed = Path(DATA / "gpt2_medium" / "main.log").read_text()
    assert sum(parse_metric_line(x) is not None for x in renamed.splitlines()) == 8


def test_llmc_main_log_line_shapes():
    # the format strings of llmc/logger.h, and the older python trainer's `s:%d trl:%f`
    assert parse_metric_line("s:%d trl:%.4f lr:%.6f norm:%.2f" % (1, 10.9812, 6e-06, 15.2341)) == \
        (1, {"train/loss": 10.9812, "lr": 6e-06, "grad_norm": 15.23})
    assert parse_metric_line("s:%d tel:%.4f" % (0, 10.9876)) == (0, {"val/loss": 10.9876})
    assert parse_metric_line("s:%d eval:%.4f" % (250, 0.2834)) == (250, {"hellaswag_acc": 0.2834})
    assert parse_metric_line("s:0 trl:10.965596") == (0, {"train/loss": 10.965596})     # modded-nanogpt, June 2024
    assert math.isnan(parse_metric_line("s:7 trl:-nan lr:0.000300 norm:nan")[1]["train/loss"])
    assert parse_metric_line("s:1 is the first step") is None


# ---- Megatron, NeMo, MLPerf --------------------------------------------------------------------------

def test_megatron_argument_dump_and_validation_lines():
    rec = parse_log((DATA / "megatron_gpt2_345m.log").read_text(), "megatron")
    cfg = rec["config"]
    assert cfg["lr"] == 0.00015 and cfg["global_batch_size"] == 8 and cfg["micro_batch_size"] == 4
    assert cfg["num_layers"] == 24 and cfg["hidden_size"] == 1024 and cfg["fp16"] is True
    assert cfg["data_path"] == ["./data/meg-gpt2_text_document"] and cfg["params_dtype"] == "torch.float16"
    assert "wandb_project" not in cfg and "evaluate" not in cfg and "model-and-optimizer-setup" not in cfg
    assert rec["metrics"]["val/loss"] == [[1, 11.03246], [2, 11.029]]
    assert rec["metrics"]["val/ppl"] == [[1, 61849.32], [2, 61635.99]]
    rec = parse_log((DATA / "megatron_iterations.log").read_text(), "megatron")
    m = rec["metrics"]
    assert m["train/loss"] == [[122, 2.50422], [123, 2.493043], [124, 2.559583], [125, 2.477393]]
    assert m["lr"][0] == [122, 9.15e-06] and m["grad_norm"][-1] == [125, 0.356]
    assert m["elapsed_time_per_iteration_ms"][0] == [122, 86545.2] and rec["meta"]["total_steps"] == 250000


def test_nemo_progress_bar_nan_loss_is_diverged():
    rec = parse_log((DATA / "nemo_nan.log").read_text(), "nemo")
    assert rec["status"] == "diverged" and rec["failure"]["step"] == 9000      # global_step=9e+3
    assert rec["failure"]["message"] == "train/loss is nan at step 9000"
    assert rec["metrics"]["val/loss"] == [[9000, 7.04238]]       # ModelCheckpoint's line, more digits
    assert set(rec["metrics"]) <= {"train/loss", "val/loss", "epoch", "v_num", "consumed_samples",
                                   "train_step_timing_in_s"}
    rec = parse_log((DATA / "nemo2_bionemo.log").read_text(), "nemo2")
    assert rec["metrics"]["train/loss"][0] == [120, 1.233] and rec["metrics"]["lr"][0] == [120, 3e-05]
    assert rec["metrics"]["consumed_samples"][-1] == [125, 126.0] and rec["status"] == "completed"


def test_mlperf_events_between_python_dict_lines():
    rec = parse_log((DATA / "mlperf_bert_result.txt").read_text(), "bert")
    assert rec["metrics"]["eval_accuracy"][0] == [1210432, 0.7091760635375977, 1684505482.468]
    assert rec["metrics"]["val/loss"][0] == [2679, 1.3657647371292114]
    assert rec["metrics"]["eval_mlm_accuracy"][-1] == [3684, 0.7132415771484375]
    assert rec["config"] == {} and rec["status"] == "completed"


# ---- torchrun: ranks, key=value lines, a child that fails ------------------------------------------

RANKED = textwrap.dedent('''
    import os, time
    rank = int(os.environ["RANK"])
    print(f"world_size={os.environ['WORLD_SIZE']} lr=3e-4 batch_size=8", flush=True)
    loss = 4.0
    if rank == 1:
        time.sleep(1.0)          # rank 0 logs every step first, so the failure's step is known
    for step in range(1, 6):
        loss *= 0.9 if rank == 0 else 0.95
        print(f"step={step} loss={loss:.4f} lr=3.0e-04 grad_norm={1.0 / step:.3f}", flush=True)
        if rank == 1 and step == 4:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
''')


@pytest.mark.slow
def test_torchrun_tee_prefixes_key_value_lines_and_a_failed_rank(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    (tmp_path / "ranked.py").write_text(RANKED)
    done = subprocess.run([torchrun, "--nproc_per_node=2", "--tee", "3", "ranked.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    text = done.stdout + done.stderr
    assert done.returncode != 0 and "[default1]:Traceback" in text
    rec = parse_log(text, "ranked")
    assert rec["config"] == {"world_size": 2, "lr": 3e-4, "batch_size": 8}
    assert rec["metrics"]["train/loss"] == [[1, 3.6], [2, 3.24], [3, 2.916], [4, 2.6244], [5, 2.362]]   # rank 0's
    f = rec["failure"]
    assert f["kind"] == "oom" and f["step"] == 5 and rec["status"] == "failed"
    assert f["message"] == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"     # not torchrun's wrapper
    assert "ranked.py" in f["evidence"]


# ---- a folder of logs mixed with files that are not runs ------------------------------------------

def test_a_folder_of_real_logs_and_other_files(tmp_path):
    from kb.api import KnowledgeBase

    folder = tmp_path / "runs"
    shutil.copytree(DATA, folder)
    (folder / "loss_curve.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    (folder / "train.py").write_text("import torch\nprint('step 1: loss 2.0')\n")
    (folder / "sweep.yaml").write_text("lr: [1e-4, 3e-4]\n")
    (folder / "ckpt.pt").write_bytes(b"PK\x03\x04" + bytes(64))
    (folder / "ideas.txt").write_text("We trained 3 models for 10 days on 512 GPUs.\nThe loss was fine.\n")
    logs = sorted(p for p in DATA.rglob("*") if p.is_file() and p.suffix != ".md")
    with KnowledgeBase.open(home=tmp_path / "kb") as k:
        first = k.ingest(str(folder), index=False)
        second = k.ingest(str(folder), index=False)
        runs = {r.name: r for r in k.runs()}
        speedrun = k.run(runs[SPEEDRUN.stem].id)
    assert first.failed == [] and second.failed == []
    names = {p.parent.name if p.name == "main.log" else p.stem for p in logs}
    assert set(runs) == names                    # every log a run; README, notes and the rest are not
    assert second.unchanged == first.added
    skipped = {Path(s["source"]).name for s in first.skipped}
    assert {"loss_curve.png", "train.py", "sweep.yaml", "ckpt.pt"} <= skipped
    assert runs["nemo_nan"].status == "diverged" and runs["gpt2_medium"].project == "gpt2_medium"
    assert speedrun.config == SPEEDRUN_CONFIG
    assert speedrun.code["source_sha256"] == hashlib.sha256(speedrun.code["source"].encode()).hexdigest()


# ---- hostile input (issue 7): what fuzzing found, one case each ------------------------------------

def test_steps_and_times_no_store_holds_make_no_step_and_no_crash():
    rec = parse_log("\n".join([
        "step 1e999: loss 2.0",                                  # was OverflowError
        "step 99999999999999999999999: loss 2.0",                # past 64 bits
        '{"step": -4, "loss": 1.0}', '{"step": 3, "loss": ' + "9" * 400 + ', "lr": 0.1}',
        "s:0 trl:3.5 _:1.0", "step 2: _ 7.0 loss 2.5",          # a name of separators names nothing
        ':::MLLOG {"key": "run_start", "time_ms": 1e20}',        # was OSError: past any datetime
        ':::MLLOG {"key": "v", "value": 1, "metadata": {"step": -5}}',
        ':::MLLOG {"key": "w", "value": 1, "metadata": 5}', ":::MLLOG " + "[" * 3000,
    ]), "x")
    assert rec["metrics"] == {"train/loss": [[0, 3.5], [2, 2.5]], "lr": [[3, 0.1]]}
    assert "started_at" not in rec and rec["config"] == {"w": 1}


def test_a_deep_dump_or_a_long_name_costs_the_run_only_that_part(tmp_path):
    path = tmp_path / "train.log"
    path.write_text("\n".join([
        "{" + '"a": {' * 3000 + "}" * 3001,                      # was RecursionError
        "\n".join(" " * i + f"k{i}:" for i in range(200)) + "\n" + " " * 200 + "v: 1",
        "batch_size = 64",
        "step 1: loss 2.0 " + "q" * 300 + " 5.0",               # a metric name past the 200-character limit
        "step 2: loss 1.5",
    ]))
    (item,) = LogIngester().read(str(path))
    assert isinstance(item, Parsed), item
    record = item.record
    assert record.metrics["train/loss"] == [(1, 2.0), (2, 1.5)] and record.config["batch_size"] == 64
    assert [u["field"].split(".")[0] for u in record.meta["unread"]] == ["metrics"]
    assert "q" * 300 not in record.metrics


def test_nul_bytes_a_bom_and_bytes_that_are_not_utf8_leave_the_log_readable(tmp_path):
    path = tmp_path / "node3.log"
    lines = b"\r\n".join(f"iter {i}: loss {3 - i / 10:.2f}".encode() for i in range(5))
    path.write_bytes(b"\xef\xbb\xbflr = 3e-4\r\n\x00\x00\xff\xfe garbled\r\n" + lines + b"\r\n" + b"\x00" * 4096)
    assert LogIngester().detect(str(path)) == 85             # the zeros of a crashed node are not a binary file
    (item,) = LogIngester().read(str(path))
    assert item.record.config == {"lr": 3e-4}
    assert [p[1] for p in item.record.metrics["train/loss"]] == [3.0, 2.9, 2.8, 2.7, 2.6]


@pytest.mark.parametrize("unit", ["x", "a1", "a.", "1e", "9", "def f(", "A(a=", "Namespace("])
def test_a_long_line_is_read_in_linear_time(unit):
    # each of these took time quadratic in the line's length (a 20,000-character line: 96 s);
    # 400,000 characters would not finish
    text = "step 1: loss 2.0 " + unit * (400_000 // len(unit))
    assert parse_log(text + "\n" + text, "x")["metrics"]["train/loss"] == [[1, 2.0]]


@pytest.mark.parametrize("head", ["import os\nx = (\n" * 10_000, "{\n" * 40_000])
def test_a_log_of_openers_and_unclosed_brackets_is_read_in_linear_time(head):
    # each `x = (` made the code search look 5,000 lines ahead (40,000 lines: 6 minutes), and each
    # `{` the dump reader 2,000 lines ahead (40,000 lines: 21 s)
    rec = parse_log(head + "step 1: loss 2.0\n", "x")
    assert rec["metrics"] == {"train/loss": [[1, 2.0]]} and "code" not in rec and rec["config"] == {}


@pytest.mark.parametrize("name, content, run", [
    (b"\xff-run.log", b"iter 1: loss 2.0\niter 2: loss 1.5\n", "\\xff-run"),
    (b"\xff-runs.jsonl", b'{"name": "a", "config": {"lr": 1}}\n', "a"),
    (b"\xff-sweep.csv", b"name,lr\nr1,0.1\n", "r1"),
], ids=["log", "native", "table"])
def test_a_file_name_that_is_not_utf8_names_its_run(tmp_path, name, content, run):
    from kb.api import KnowledgeBase

    folder = os.fsencode(tmp_path / "runs")
    os.mkdir(folder)
    with open(os.path.join(folder, name), "wb") as fh:
        fh.write(content)
    with KnowledgeBase.open(home=tmp_path / "kb") as k:
        report = k.ingest(os.fsdecode(folder), index=False)
        assert (report.added, report.failed) == (1, [])
        assert [r.name for r in k.runs()] == [run]
        assert k.ingest(os.fsdecode(folder), index=False).unchanged == 1


def test_a_note_whose_file_name_is_not_utf8_is_stored(tmp_path):
    """The note reader hashed the path as UTF-8 and took the whole walk down with it."""
    from kb.api import KnowledgeBase

    folder = os.fsencode(tmp_path / "notes")
    os.mkdir(folder)
    with open(os.path.join(folder, b"\xff-postmortem.md"), "wb") as fh:
        fh.write(b"# Postmortem\n\nThe lr=3e-3 run went NaN at step 1200.\n")
    with KnowledgeBase.open(home=tmp_path / "kb") as k:
        report = k.ingest(os.fsdecode(folder), index=False)
        assert (report.added, report.failed) == (1, [])
        assert k.ingest(os.fsdecode(folder), index=False).unchanged == 1
