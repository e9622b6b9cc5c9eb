"""kb.failures: one Failure shape, from a raised exception or from a log's lines."""
from __future__ import annotations

import dataclasses

import pytest

from kb.failures import Failure, classify, from_exception


def _raise(exc: BaseException):
    try:
        raise exc
    except BaseException as caught:       # noqa: BLE001 - the point is to catch anything
        return caught


def test_failure_is_frozen_and_a_plain_dict():
    f = Failure("oom", 12, "CUDA out of memory", "line")
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.kind = "other"
    assert f.as_dict() == {"kind": "oom", "step": 12, "message": "CUDA out of memory", "evidence": "line"}


def test_from_exception_names_type_message_and_traceback():
    f = from_exception(_raise(ValueError("lr must be positive")), 7)
    assert (f.kind, f.step, f.message) == ("exception", 7, "ValueError: lr must be positive")
    assert f.evidence.startswith("Traceback (most recent call last):")
    assert f.evidence.rstrip().endswith("ValueError: lr must be positive")
    assert "_raise" in f.evidence                 # the frame that raised it


def test_from_exception_keyboard_interrupt_is_killed_and_bare_types_have_no_colon():
    f = from_exception(_raise(KeyboardInterrupt()), None)
    assert (f.kind, f.step, f.message) == ("killed", None, "KeyboardInterrupt")


def test_from_exception_keeps_only_the_traceback_tail():
    f = from_exception(_raise(RuntimeError("x" * 20_000)), 1)
    assert len(f.evidence) == 4000 and len(f.message) == 500


def test_classify_takes_lines_alone_or_with_ranks_and_events():
    lines = ["iter 10: loss 3.0", "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    assert classify(lines).kind == "oom" and classify(lines).step is None
    f = classify(lines, [None, None], [(0, 10, {"train/loss": 3.0})])
    assert (f.kind, f.step) == ("oom", 10)
    assert "iter 10" not in f.message and "CUDA out of memory" in f.evidence


def test_classify_a_nonfinite_loss_event_is_divergence():
    lines = ["step 1 loss 2.0", "step 2 loss nan"]
    events = [(0, 1, {"train/loss": 2.0}), (1, 2, {"train/loss": float("nan")})]
    f = classify(lines, [None, None], events)
    assert (f.kind, f.step) == ("diverged", 2) and f.message == "train/loss is nan at step 2"
    assert f.evidence == "step 1 loss 2.0\nstep 2 loss nan"


def test_classify_clean_lines_is_none():
    assert classify(["loading data", "step 1 loss 2.0", "done"]) is None


def test_classify_names_the_exception_when_a_frame_line_matched_first():
    lines = ["step 3 loss 2.0", "Traceback (most recent call last):", '  File "train.py", line 9, in <module>',
             '    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")',
             "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    f = classify(lines, [None] * 5, [(0, 3, {"train/loss": 2.0})])
    assert (f.kind, f.step) == ("oom", 3)
    assert f.message == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert f.evidence.startswith("Traceback") and f.evidence.endswith("2.00 GiB")
