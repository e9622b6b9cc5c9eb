"""Property tests (hypothesis) for the training-log ingester, on SQLite and Postgres.

The properties (issue 7):
  - any bytes named like a log (random text, metric-looking lines with junk, huge numbers, NaN and
    inf spellings, code, YAML/JSON/Namespace/dataclass dumps with hostile content, very long lines,
    binary garbage, invalid UTF-8, a BOM, CRLF, NUL bytes, nesting thousands deep) are read into a
    valid record or refused naming the file, never an exception;
  - the metric lines of every shape the ingester documents, mixed with lines that report nothing,
    read back through KnowledgeBase (and `kb show --json`'s shape) with exactly the values printed;
  - in a folder of such logs, each one is stored as read or refused alone: a hostile log never
    takes a good one with it.

    pytest tests/test_fuzz_logs.py -q                                 # sized for CI
    KB_FUZZ_EXAMPLES=10000 pytest tests/test_fuzz_logs.py -q          # or: pytest --long
"""
from __future__ import annotations

import json
import math
import re
import uuid

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ingest.detect import resolve
from ingest.logs import LogIngester
from kb.errors import UnknownFormat
from kb.records import Parsed, Rejected
from tests.fuzzing import examples

SLOW = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large,
        HealthCheck.large_base_example]
FUZZ = settings(max_examples=examples(15), deadline=None, suppress_health_check=SLOW)
FUZZ_PURE = settings(max_examples=examples(60), deadline=None, suppress_health_check=SLOW)

# ---- hostile lines ---------------------------------------------------------------------------------

number_text = st.one_of(
    st.floats().map(repr), st.integers(-10**30, 10**30).map(str),
    st.sampled_from(["nan", "-nan", "NaN", "inf", "-inf", "Infinity", "1e999", "-1E400", "1e-999", "0x1F", "1_000",
                     "\u0661\u0662", "9" * 400, ".5", "5.", "+3", "--1", "1e", "nanx", "infinite"]))
word = st.sampled_from(["loss", "train loss", "val loss", "lm loss", "lr", "learning rate", "norm", "grad norm",
                        "mfu", "time", "step", "iter", "iteration", "global_step", "s", "trl", "tel", "_", "__/__",
                        "a" * 300, "x.y/z", "loss value", "tok/s"]) | st.text(max_size=6)
sep = st.sampled_from([": ", "=", " ", " | ", ", ", ":", "\t"])
step_head = st.sampled_from(["step {}:", "iter {}:", "step:{}/10", "iteration {}/ 100 |", "s:{}", "global_step={}",
                             "step 1/{}", "step {}/{}", "[{}]", "step {} |", "step={}"])
metric_like = st.builds(
    lambda head, steps, pairs: f"{head.format(*steps[:head.count('{}')])} " + " | ".join(map("".join, pairs)),
    step_head, st.lists(number_text, min_size=2, max_size=2), st.lists(st.tuples(word, sep, number_text), max_size=5))
code_like = st.sampled_from([
    "import os", "from a import b", "def f(x):", "    return x", "class Config:", "@dataclass",
    "class Hyperparameters:", "    lr: float = 3e-4", "    n: int = 2**99999", "    s = 9**9**9",
    "    bad: int = (", "if __name__ == '__main__':", "'''", '"""', "x = (", "#!/usr/bin/env python",
    "=" * 40, "    " + "(" * 250 + ")" * 250, "\tpass"])
dumps = st.sampled_from([
    '{"lr": 1e999}', '{"lr": NaN, "step": 3}', "{'a': {'b': {'c': 1}}}", '{"step": 5, "loss": 1e400}',
    '{"step": -4, "loss": 1}', '{"step": 99999999999999999999999, "loss": 1}', '{"step": 1, "loss": ' + "9" * 400 + "}",
    "lr: 1e-3", "model:", "  n_layer: 12", "  - 0.9", "    -", "key=value other=2", "lr ........ 3e-4",
    "| learning rate (LR) | 3e-4 |", "python train.py --lr 1e999 --x=--y", "python train.py --a " + "9" * 50,
    "Overriding: lr = 1e308*10", "Overriding: n = 9**9**9", "Namespace(lr=0.1, b='x', c=[1, {'d': None}])",
    "Namespace(" * 60, "GPTConfig(n_layer=" + "(" * 150 + "1" + ")" * 150 + ")", "Namespace(k='a\\x00b')",
    "Hyperparameters(" + ", ".join(f"k{i}={i}" for i in range(300)) + ")",
    ':::MLLOG {"key": "x", "value": 1e308, "metadata": {"step": 1e300}, "time_ms": 1e300}',
    ':::MLLOG {"key": "run_start", "time_ms": 1e20}', ':::MLLOG {"key": "v", "value": 1, "metadata": {"step": -5}}',
    ':::MLLOG {"key": "v", "value": 1, "metadata": 5}', ":::MLLOG " + "[" * 3000,
    ':::MLLOG {"key": "", "value": ' + "9" * 400 + ', "metadata": {"epoch_num": 1}}',
    "Traceback (most recent call last):", "torch.cuda.OutOfMemoryError: CUDA out of memory.", "Killed",
    "loss is NaN, stopping", "Epoch 0, global step 9000: 'val_loss' reached 7.04238 (best 7.04), saving model",
    "Epoch 0, global step 99999999999999999999999: 'val_loss' reached nan"])
deep = st.sampled_from([
    "{" + '"a": {' * 3000 + "}" * 3001,                                   # a JSON dump nested 3,000 deep
    "\n".join(" " * i + f"k{i}:" for i in range(200)) + "\n" + " " * 200 + "v: 1",   # YAML, 200 levels
    "[" * 5000 + "]" * 5000,
    "Namespace(a=" + "[" * 180 + "]" * 180 + ")",
    "import os\nx = (\n" * 3000, "{\n" * 5000])          # the code and dump readers looked thousands of lines ahead
# each of these was quadratic in its length somewhere in the reader (at 20,000 characters: 96 s)
long_line = st.sampled_from(["x" * 100_000, "step 1: loss 2.0 " + "a1" * 50_000, "9" * 100_000,
                             "A(a=" * 25_000, "def f(" * 15_000, "Namespace(" * 10_000 + "a=1)", "k=v " * 20_000])
junk = st.text(max_size=60) | st.binary(max_size=40).map(lambda b: b.decode("latin-1"))
line = st.one_of(metric_like, code_like, dumps, junk, deep, long_line)
raw_extra = st.sampled_from([b"", b"\xff\xfe", b"\x00\x00\x00", b"\xef\xbb\xbf", b"\xc3", b"\r", b"\x1b[2K\r"])


@st.composite
def hostile_log(draw) -> bytes:
    lines = draw(st.lists(line, max_size=12))
    newline = draw(st.sampled_from(["\n", "\r\n", "\r"]))
    text = newline.join(lines).encode("utf-8", "surrogatepass")          # a lone surrogate: invalid UTF-8
    head, tail = draw(raw_extra), draw(raw_extra)
    return head + text + tail


@FUZZ_PURE
@given(data=hostile_log(), suffix=st.sampled_from([".log", ".out", ".txt", ""]))
def test_any_bytes_are_read_into_a_valid_record_or_refused_naming_the_file(tmp_path, data, suffix):
    path = tmp_path / f"{uuid.uuid4().hex}{suffix}"
    path.write_bytes(data)
    ingester = LogIngester()
    assert 0 <= ingester.detect(str(path)) <= 100
    try:
        resolve(str(path))                      # detection by every ingester: claimed, or not a format
    except UnknownFormat:
        pass
    items = list(ingester.read(str(path)))
    assert len(items) == 1
    item = items[0]
    if isinstance(item, Rejected):
        assert item.error.source == str(path) and item.error.error and "\n" not in item.error.error
        # refused only for having nothing to store: what the store cannot hold is left out, not the run
        assert item.error.error.startswith(("no step/metric lines recognised", "nothing it printed can be stored")), \
            item.error
    else:
        assert isinstance(item, Parsed) and (item.record.metrics or item.record.config)
        for key, points in item.record.metrics.items():
            assert key and all(0 <= p[0] < 2**63 for p in points)


# ---- metric lines of every documented shape, with exact values ----------------------------------------

finite = st.floats(allow_nan=False, allow_infinity=False)
printed = st.one_of(finite.map(repr), finite.map(lambda x: f"{x:.4f}"), finite.map(lambda x: f"{x:.6e}"),
                    st.integers(-10**6, 10**6).map(str),
                    st.sampled_from(["nan", "-nan", "NaN", "inf", "-inf", "Infinity", "1e999"]))
c_printed = st.one_of(finite.map(lambda x: f"{x:.6f}"), st.sampled_from(["nan", "-nan", "inf", "-inf"]))  # C's printf

# (line template, {placeholder: canonical metric name}); {step} and {total} are the step and its total
SHAPES = {
    "nanogpt_iter": ("iter {step}: loss {a}, time 12.50ms, mfu 3.20%", {"a": "train/loss"}),
    "nanogpt_eval": ("step {step}: train loss {a}, val loss {b}", {"a": "train/loss", "b": "val/loss"}),
    "llmc": ("step {step:4d}/{total} | train loss {a} | norm {b} | lr {c} | 44.57 ms | 9.6% bf16 MFU | 91886 tok/s",
             {"a": "train/loss", "b": "grad_norm", "c": "lr"}),
    "key_value": ("step={step} loss={a} lr={b}", {"a": "train/loss", "b": "lr"}),
    "megatron": (" iteration {step}/{total} | consumed samples: 64 | learning rate: {c} | global batch size: 8 | "
                 "lm loss: {a} | grad norm: {b} | number of skipped iterations: 0 | number of nan iterations: 0 |",
                 {"a": "train/loss", "b": "grad_norm", "c": "lr"}),
    "speedrun": ("step:{step}/{total} val_loss:{a} train_time:1234ms step_avg:105.87ms", {"a": "val/loss"}),
    "main_log": ("s:{step} trl:{a} norm:{b}", {"a": "train/loss", "b": "grad_norm"}),
    "json": (None, {"a": "train/loss", "b": "lr"}),
}
LEADS = ["", "[rank0]: ", "0: ", "[2024-05-01 10:00:00] ", "2024-05-01 10:00:00,123 INFO "]


def neutral(t: str) -> bool:
    """A line that reports nothing: no digit, no nan/inf, no code or MLPerf opener."""
    low = t.lower()
    return not (re.search(r"\d|nan|inf|:::", low) or re.match(r"\s*(import|from|def|class|@|#!|if\s|\"\"\"|''')", low))


quiet = st.text(st.characters(exclude_categories=["Cs", "Nd", "No", "Nl"]), max_size=80).filter(neutral)


@st.composite
def metric_log(draw):
    """(file bytes, {metric: [[step, printed value], ...]})."""
    lead = draw(st.sampled_from(LEADS))
    steps = sorted(draw(st.sets(st.integers(0, 2**40), min_size=1, max_size=8)))
    total = steps[-1] + draw(st.integers(0, 100))
    want: dict[str, dict[int, float]] = {}
    lines = draw(st.lists(quiet, max_size=3))
    for step in steps:
        shape = draw(st.sampled_from(sorted(SHAPES)))
        template, names = SHAPES[shape]
        tokens = {k: draw(c_printed if shape == "main_log" else printed) for k in names}
        if template is None:
            row = {"step": step, **{k: float(v) for k, v in zip(("train_loss", "lr"), tokens.values())}}
            text = json.dumps(row)                          # NaN and Infinity as Python's json writes them
        else:
            text = template.format(step=step, total=total, **tokens)
        lines.append(lead + text)
        for key, name in names.items():
            want.setdefault(name, {})[step] = float(tokens[key])
        lines += [lead + q if q else q for q in draw(st.lists(quiet, max_size=2))]
    newline = draw(st.sampled_from(["\n", "\r\n", "\r"]))
    data = newline.join(lines).encode()
    if draw(st.booleans()):
        data = b"\xef\xbb\xbf" + data
    if draw(st.booleans()):
        data += newline.encode() + b"garbage \xff\xfe \x00\x00 bytes" + newline.encode()   # neutral once decoded
    return data, {k: [[s, v] for s, v in sorted(pts.items())] for k, pts in want.items()}


def same_points(got: list, want: list) -> bool:
    return len(got) == len(want) and all(
        g[0] == w[0] and (g[1] == w[1] or math.isnan(g[1]) and math.isnan(w[1])) for g, w in zip(got, want))


def shown(v: float):
    if math.isnan(v):
        return "NaN"
    return v if math.isfinite(v) else ("Infinity" if v > 0 else "-Infinity")


@FUZZ
@given(drawn=metric_log())
def test_metric_lines_read_back_with_exactly_the_printed_values(kb, tmp_path, drawn):
    data, want = drawn
    path = tmp_path / f"{uuid.uuid4().hex}.log"
    path.write_bytes(data)
    project = f"p-{uuid.uuid4().hex[:8]}"
    report = kb.ingest(str(path), format="log", project=project, index=False)
    assert (report.added, report.failed) == (1, []), report.failed
    [run] = kb.runs(project=project)
    detail = kb.run(run.id)
    for name, points in want.items():
        assert same_points(detail.metrics.get(name, []), points), (name, detail.metrics.get(name), points)
        assert detail.as_dict()["metrics"][name] == [[s, shown(v)] for s, v in points]     # `kb show --json`


# ---- a folder: hostile logs beside a good one ----------------------------------------------------------

def same_json(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or math.isnan(a) and math.isnan(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    return a == b


@FUZZ
@given(hostile=st.lists(hostile_log(), min_size=1, max_size=3), good=metric_log())
def test_a_hostile_log_is_stored_as_read_or_refused_alone(kb, tmp_path, hostile, good):
    folder = tmp_path / uuid.uuid4().hex
    folder.mkdir()
    (folder / "good.log").write_bytes(good[0])
    for i, data in enumerate(hostile):
        (folder / f"hostile-{i}.log").write_bytes(data)
    read = {p.name: list(LogIngester().read(str(p))) for p in folder.iterdir()}
    project = f"p-{uuid.uuid4().hex[:8]}"
    report = kb.ingest(str(folder), project=project, index=False)       # walked: every file accounted for
    failed = {f["source"]: f for f in report.failed}
    runs = {r.name: r for r in kb.runs(project=project)}
    for name, [item] in read.items():
        stem = name.removesuffix(".log")
        if stem not in runs:
            # refused by the reader, or not claimed as a log (no metric line in its head): failed, by name
            assert str(folder / name) in failed, (name, item, report.failed)
            continue
        assert isinstance(item, Parsed), item
        run, record = kb.run(runs[stem].id), item.record
        assert same_json(run.config, record.config), (run.config, record.config)
        assert run.status == record.status
        assert list(run.metrics) == list(record.metrics)
        for key, points in record.metrics.items():
            assert same_points(run.metrics[key], [list(p) for p in points]), key
    assert len(runs) == report.added and report.added + len(report.failed) == len(read)
    good_run = kb.run(runs["good"].id)
    for name, points in good[1].items():
        assert same_points(good_run.metrics[name], points)
