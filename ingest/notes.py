"""Notes: Markdown, reStructuredText and plain-text documents (postmortems, design docs, reviews).

A document becomes several NoteRecords, chunked for retrieval: split on headings, then packed
paragraph by paragraph into chunks of ~250 words (never across a heading; a paragraph longer
than a chunk is cut at sentence ends). Each chunk's title carries its heading path
("Postmortem > Timeline > Day 2"), `chunk` its index. Ids are `<stem>-<hash8>#<chunk>`, the
hash taken from the file's resolved path, so re-reading the file yields the same ids and an
edited document updates its chunks in place instead of adding a second copy.

`project` comes from front matter (`---\\nproject: gpt-small\\n---`), else the `--project`
flag (applied by the store), else "default". `mentions` over-collects what looks like a run
name or id (backticked names, "run X" phrases, tokens mixing letters and digits with - or _);
the store keeps only those that resolve to existing runs.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Iterator

from ingest.base import register, rejected
from ingest.logs import log_score
from kb.records import Item, NoteRecord, Parsed, path_text

TARGET_WORDS = 250
MAX_WORDS = 300
MAX_MENTIONS = 50
SUFFIXES = {".md": 80, ".markdown": 80, ".rst": 80}
NOT_NOTES = ("requirements", "constraints", "license", "cmakelists", "robots")

ATX = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
UNDERLINE = re.compile(r"^([=\-~^\"'`#*+:.])\1{2,}\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")

BACKTICKED = re.compile(r"`([^`\s]{3,80})`")
RUN_PHRASE = re.compile(r"\bruns?\s+(?:id\s+|named\s+|called\s+)?[`'\"]?([A-Za-z0-9][\w.\-/]{2,80})", re.I)
JOINED = re.compile(r"(?<![\w./-])((?=[\w.\-]*\d)[A-Za-z0-9][\w.\-]*[-_][\w.\-]*[A-Za-z0-9])(?![\w/-])")
MIXED = re.compile(r"(?<![\w./-])((?=[a-z0-9]*[a-z])(?=[a-z0-9]*\d)[a-z0-9]{8,40})(?![\w/-])")


# ---- structure ---------------------------------------------------------------------------

def front_matter(text: str) -> tuple[dict, str]:
    """A leading `---` block of `key: value` lines (lists as `[a, b]` or `- a` items); the rest."""
    lines = text.split("\n")
    if not lines or lines[0].strip() != "---":
        return {}, text
    for end in range(1, min(len(lines), 200)):
        if lines[end].strip() in ("---", "..."):
            break
    else:
        return {}, text
    meta: dict = {}
    key = None
    for line in lines[1:end]:
        if (m := re.match(r"^([A-Za-z_][\w\-]*):\s*(.*?)\s*$", line)):
            key, value = m.group(1).lower(), m.group(2)
            if value.startswith("[") and value.endswith("]"):
                meta[key] = [v.strip().strip("'\"") for v in value[1:-1].split(",") if v.strip()]
            else:
                meta[key] = value.strip("'\"") if value else []
        elif key and (m := re.match(r"^\s*-\s+(.+?)\s*$", line)) and isinstance(meta.get(key), list):
            meta[key].append(m.group(1).strip("'\""))
    return meta, "\n".join(lines[end + 1:])


def sections(text: str) -> list[tuple[list[str], list[str]]]:
    """(heading path, paragraphs) in document order; Markdown ATX/setext and RST headings.

    RST has no fixed order of underline characters, so its levels follow the order in which they
    first appear; once a document shows Markdown (an ATX heading or a fence), `=` is level 1 and
    `-` level 2, as in Markdown."""
    lines = text.split("\n")
    out: list[tuple[list[str], list[str]]] = []
    path: list[tuple[int, str]] = []
    rst_levels: list[str] = []
    para: list[str] = []
    paras: list[str] = []
    in_fence = markdown = False

    def flush_para():
        if para and any(x.strip() for x in para):
            paras.append("\n".join(para).strip("\n"))
        para.clear()

    def flush_section():
        flush_para()
        if paras:
            out.append(([t for _, t in path], paras.copy()))
        paras.clear()

    def open_heading(level: int, title: str):
        flush_section()
        while path and path[-1][0] >= level:
            path.pop()
        path.append((level, title))

    i = 0
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line):
            in_fence, markdown = not in_fence, True
            para.append(line)
            i += 1
            continue
        if in_fence:
            para.append(line)
            i += 1
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if (m := ATX.match(line)):
            markdown = True
            open_heading(len(m.group(1)), m.group(2).strip())
            i += 1
            continue
        over = UNDERLINE.match(line) and i + 2 < len(lines) and UNDERLINE.match(lines[i + 2]) \
            and lines[i + 1].strip() and not UNDERLINE.match(lines[i + 1])
        if over:                                      # RST title with an overline
            mark = "o" + line.strip()[0]
            if mark not in rst_levels:
                rst_levels.append(mark)
            open_heading(rst_levels.index(mark) + 1, lines[i + 1].strip())
            i += 3
            continue
        if line.strip() and not para and UNDERLINE.match(nxt) and len(nxt.strip()) >= min(len(line.strip()), 3):
            mark = nxt.strip()[0]
            if markdown and mark in "=-":
                level = 1 if mark == "=" else 2           # Markdown setext
            elif not markdown:
                if mark not in rst_levels:
                    rst_levels.append(mark)
                level = rst_levels.index(mark) + 1
            else:
                level = 0                                 # Markdown has no other underlines
            if level:
                open_heading(level, line.strip())
                i += 2
                continue
        if not line.strip():
            flush_para()
        elif not (UNDERLINE.match(line) and not para):    # a horizontal rule carries no text
            para.append(line)
        i += 1
    flush_section()
    return out


def _split_long(paragraph: str) -> list[str]:
    """A paragraph over MAX_WORDS, cut at sentence ends (or, failing that, every TARGET_WORDS words)."""
    pieces, current = [], []
    for sentence in SENTENCE_END.split(paragraph):
        words = sentence.split()
        while len(words) > MAX_WORDS:                 # one giant "sentence": a table, a log paste
            if current:
                pieces.append(" ".join(current))
                current = []
            pieces.append(" ".join(words[:TARGET_WORDS]))
            words = words[TARGET_WORDS:]
        if current and len(current) + len(words) > MAX_WORDS:
            pieces.append(" ".join(current))
            current = []
        current.extend(words)
    if current:
        pieces.append(" ".join(current))
    return pieces


def chunks(text: str) -> list[tuple[list[str], str]]:
    """(heading path, chunk text): paragraphs packed to ~TARGET_WORDS, never across headings."""
    out = []
    for path, paras in sections(text):
        current: list[str] = []
        count = 0
        for p in paras:
            n = len(p.split())
            parts = _split_long(p) if n > MAX_WORDS else [p]
            for part in parts:
                m = len(part.split())
                if current and (count >= TARGET_WORDS or count + m > MAX_WORDS):
                    out.append((path, "\n\n".join(current)))
                    current, count = [], 0
                current.append(part)
                count += m
        if current:
            out.append((path, "\n\n".join(current)))
    return out


# ---- mentions --------------------------------------------------------------------------------

def mentions(text: str) -> list[str]:
    """Tokens that may name a run: over-collected on purpose, resolved against the store on write."""
    found: list[str] = []
    for pattern in (BACKTICKED, RUN_PHRASE, JOINED, MIXED):
        for m in pattern.finditer(text):
            token = m.group(1).strip(".,;:!?)('\"")
            if _plausible(token) and token not in found:
                found.append(token)
    return found[:MAX_MENTIONS]


STOPWORDS = {"the", "and", "for", "with", "that", "this", "was", "were", "are", "out", "into", "which",
             "its", "our", "their", "from", "longer", "faster", "slower", "time", "times", "again", "until"}


def _plausible(token: str) -> bool:
    if len(token) < 3 or len(token) > 80 or "://" in token or token.lower() in STOPWORDS:
        return False
    if not re.search(r"[A-Za-z]", token) and not re.fullmatch(r"\d{3,}", token):
        return False                                  # dates and version-like numbers ("2024-01-05")
    if re.fullmatch(r"\d+(?:\.\d+)*[a-z]{0,2}", token):
        return False                                  # 3.11, 1e
    return True


# ---- the ingester ---------------------------------------------------------------------------------

def note_records(path: Path, text: str) -> list[NoteRecord]:
    meta, body = front_matter(text)
    stem = path_text(path.stem)
    digest = hashlib.sha1(path_text(str(path.resolve())).encode()).hexdigest()[:8]
    parts = chunks(body)
    root = meta.get("title") if isinstance(meta.get("title"), str) and meta.get("title") else None
    if root is None:
        # one top heading over the whole document is its title; otherwise the file name is
        tops = {p[0] if p else None for p, _ in parts}
        root = tops.pop() if len(tops) == 1 and None not in tops else stem
    project = meta.get("project") if isinstance(meta.get("project"), str) and meta.get("project") else "default"
    listed = [r for k in ("run", "runs") for r in ([meta[k]] if isinstance(meta.get(k), str) else meta.get(k, []))]
    records = []
    for i, (heads, chunk_text) in enumerate(parts):
        heads = heads[1:] if heads and heads[0] == root else heads
        title = " > ".join([root] + heads)
        names = listed + [m for m in mentions(f"{title}\n{chunk_text}") if m not in listed]
        records.append(NoteRecord(id=f"{stem}-{digest}#{i}", project=project, title=title, text=chunk_text,
                                  chunk=i, mentions=names[:MAX_MENTIONS]))
    return records


@register("notes")
class NotesIngester:
    def detect(self, target: str) -> int:
        path = Path(target)
        if not path.is_file():
            return 0
        suffix = path.suffix.lower()
        if suffix in SUFFIXES:
            return SUFFIXES[suffix]
        if suffix == ".txt" and not path.name.lower().startswith(NOT_NOTES):
            try:
                with path.open("rb") as fh:
                    if b"\0" in fh.read(8192):
                        return 0                      # binary, whatever its name says
            except OSError:
                return 0
            # a .txt that the log ingester would claim is a log, whatever else it holds
            return 0 if log_score(path) > 0 else 60
        return 0

    def read(self, target: str) -> Iterator[Item]:
        path = Path(target)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            yield rejected(path, f"cannot read: {exc.strerror or exc}")
            return
        if b"\0" in raw[:8192]:
            yield rejected(path, "binary file, not a text note")
            return
        # a stray NUL further in is no text (Postgres cannot store it): dropped, as from logs
        records = note_records(path, raw.replace(b"\0", b"").decode("utf-8", errors="replace"))
        if not records:
            yield rejected(path, "empty note: no text outside headings")
            return
        uri = str(path.resolve())
        for record in records:
            yield Parsed(record, "notes", uri, None)
