"""The training-log ingester: real logs captured from tiny torch training scripts run as
subprocesses (a clean run, a NaN divergence, a crash, a SIGKILL reported by the launching shell),
plus short literal samples of formats no local library produces (Megatron, llm.c, MLPerf,
torchrun prefixes, OOM/NCCL/Xid messages)."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlmodel import Session

from ingest.base import Parsed, Rejected
from ingest.logs import LogIngester, classify_failure, parse_log, parse_metric_line
from ingest.notes import NotesIngester

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
