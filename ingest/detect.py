"""Pick the ingester for a path or URI; a folder no ingester claims is walked for ones they do.

Nothing a walk visits disappears: each file is read by the ingester that claims it, or
reported as failed (it looked like a run and cannot be read) or skipped (it is not a run,
and the reason says what it is)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

from ingest.base import INGESTERS, Ingester
from kb.errors import UnknownFormat
from kb.records import Parsed, Rejected

MODULES = ("native", "mlflow", "wandb", "tensorboard", "hf_trainer", "logs", "notes", "table")
SKIP_DIRS = {".git", "__pycache__", ".kb", ".venv", "node_modules"}


def load_ingesters() -> dict[str, Ingester]:
    for name in MODULES:
        try:
            importlib.import_module(f"ingest.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"ingest.{name}":
                raise
    return INGESTERS


@dataclass
class Read:
    source: str
    ingester: Ingester
    project: str | None = None       # from the folder layout, for records that name none

    def settle(self, item: Parsed, project: str | None) -> Parsed:
        """The item's record under `project` (`--project`) when given, else under the folder's
        project when the record names none."""
        if project:
            item.record = item.record.model_copy(update={"project": project})
        elif self.project and "project" not in item.record.model_fields_set:
            item.record = item.record.model_copy(update={"project": self.project})
        return item


@dataclass
class Plan:
    """What an ingest will do with its targets: every file a walk visits lands in one list."""
    reads: list[Read] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)     # looked like a run and cannot be read
    skipped: list[dict] = field(default_factory=list)    # not a run: {"source", "reason"}

    def extend(self, other: "Plan") -> None:
        self.reads += other.reads
        self.failed += other.failed
        self.skipped += other.skipped


def resolve(target: str, fmt: str | None = None) -> Plan:
    """The plan for one target. `fmt` overrides detection for the target itself.

    A target no ingester claims is an error (UnknownFormat) unless it is a folder, which is
    walked: each file in it is read, failed (it looked like a run) or skipped (it is not one)."""
    ingesters = load_ingesters()
    if fmt:
        if fmt not in ingesters:
            raise UnknownFormat(f"unknown format {fmt!r}; known: {sorted(ingesters)}")
        return Plan(reads=[Read(target, ingesters[fmt])])
    found = _claim(target, ingesters)
    if found:
        return Plan(reads=[Read(*found)])
    path = Path(target)
    if not path.exists():
        raise UnknownFormat(f"{target}: no such file, folder or tracking URI")
    if path.is_dir():
        plan = Plan()
        _walk(path, path, ingesters, plan)
        if plan.reads or plan.failed:
            return plan
        raise UnknownFormat(f"{target}: no runs or notes in this folder ({len(plan.skipped)} files, none a run); "
                            f"known formats: {', '.join(sorted(ingesters))}")
    raise UnknownFormat(f"{target}: not a format pretrain-kb reads; known formats: "
                        f"{', '.join(sorted(ingesters))} (use --format to choose one)")


def _walk(root: Path, folder: Path, ingesters: dict[str, Ingester], plan: Plan) -> None:
    for child in sorted(folder.iterdir()):
        if child.name in SKIP_DIRS or child.name.startswith("."):
            continue
        try:
            found = _claim(str(child), ingesters)
        except UnknownFormat as exc:          # ambiguous: it is a run, we cannot tell of which kind
            plan.failed.append(_failure(child, str(exc).split(": ", 1)[-1]))
            continue
        if found:
            plan.reads.append(Read(found[0], found[1], _project_of(root, child)))
        elif child.is_dir():
            _walk(root, child, ingesters, plan)
        elif child.is_file():
            verdict, reason = unclaimed(child)
            if verdict == "failed":
                plan.failed.append(_failure(child, reason))
            else:
                plan.skipped.append({"source": str(child), "reason": reason})


def _project_of(root: Path, child: Path) -> str | None:
    """The walked folder's first level below the root names the project (`runs/gpt-small/...`);
    a file at the top of the root has no such level, and keeps whatever its record says."""
    rel = child.relative_to(root).parts
    return rel[0] if len(rel) > 1 else None


def _failure(path: Path, error: str) -> dict:
    return {"source": str(path), "line": None, "field": "", "error": error}


# what a file no ingester claims is, by its suffix
NOT_RUNS = {
    "image": (".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp", ".bmp", ".tiff"),
    "document": (".pdf", ".docx", ".pptx", ".xlsx", ".html", ".htm"),
    "checkpoint or tensor file": (".pt", ".pth", ".bin", ".safetensors", ".ckpt", ".npy", ".npz",
                                  ".pkl", ".pickle", ".h5", ".gguf", ".onnx", ".msgpack", ".arrow"),
    "source code": (".py", ".sh", ".ipynb", ".c", ".cu", ".cpp", ".h", ".js", ".ts", ".rs", ".go"),
    "configuration file (not a run by itself)": (".yaml", ".yml", ".toml", ".cfg", ".ini", ".conf"),
    "archive (unpack it to ingest what it holds)": (".zip", ".tar", ".gz", ".tgz", ".bz2", ".xz", ".zst"),
    "tokenizer or vocabulary file": (".model", ".vocab", ".merges", ".tiktoken"),
}
LOOKS_LIKE_RUNS = (".log", ".out", ".err")


def unclaimed(path: Path) -> tuple[str, str]:
    """("failed" | "skipped", why) for a file in a walked folder that no ingester claims.

    A file named like a training log is a run that could not be read (failed, with the log
    reader's own complaint); anything else is not a run, and the reason says what it is."""
    suffix = path.suffix.lower()
    if suffix in LOOKS_LIKE_RUNS or ".log" in path.name.lower():
        return "failed", _log_complaint(path)
    for what, suffixes in NOT_RUNS.items():
        if suffix in suffixes:
            return "skipped", what
    if suffix == ".json":
        return "skipped", "JSON that is not a run record (no config, metrics or summary)"
    try:
        with path.open("rb") as fh:
            head = fh.read(8192)
    except OSError as exc:
        return "failed", f"cannot read: {exc.strerror or exc}"
    if not head:
        return "skipped", "empty file"
    if b"\0" in head:
        return "skipped", "binary file"
    return "skipped", "text that no ingester recognises (no step/metric lines, not a note)"


def _log_complaint(path: Path) -> str:
    from ingest.logs import LogIngester
    for item in LogIngester().read(str(path)):
        if isinstance(item, Rejected):
            return item.error.error
    return "a log file that no ingester claimed"


def _claim(target: str, ingesters: dict[str, Ingester]) -> tuple[str, Ingester] | None:
    scores = sorted(((ing.detect(target), name) for name, ing in ingesters.items()), reverse=True)
    best, name = scores[0]
    if best <= 0:
        return None
    if len(scores) > 1 and scores[1][0] == best:
        tied = sorted(n for s, n in scores if s == best)
        raise UnknownFormat(f"{target}: ambiguous, could be {' or '.join(tied)}; use --format")
    return target, ingesters[name]
