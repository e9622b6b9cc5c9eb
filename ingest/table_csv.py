"""CSV and TSV framing for the table ingester: a file's bytes as rows that know their line.

    lines, undecodable = text_lines(path.read_bytes())    # physical lines; any byte not UTF-8?
    first = header_index(lines)                           # past blank lines and `#` comments
    delimiter = sniff(lines, first)                       # `,` `;` tab or `|`
    for line, cells, error in rows(lines, first, delimiter): ...

Nothing here refuses a whole file for one row: a byte that is not UTF-8 is kept as a surrogate
escape (the table ingester refuses the row whose cell holds it), a cell may be as long as a record's
text (16 Mi characters, not csv's 128 KiB), and a quote that is never closed, which would swallow
every line after it into one cell, is reported on its own line and the lines after it are read
again as rows.
"""
from __future__ import annotations

import csv
import io
import itertools
from typing import Iterator

from kb.records import MAX_TEXT

DELIMITERS = (",", ";", "\t", "|")
SNIFF_CHARS = 16384
QUOTE_RESTARTS = 100       # unclosed quotes read around before the rest of a file is refused


def text_lines(raw: bytes) -> tuple[list[str], bool]:
    """The file's physical lines, ends kept (`\\n`, `\\r\\n`, `\\r`; a byte-order mark dropped, as
    Excel writes one), and whether any byte was not UTF-8."""
    text = raw.decode("utf-8-sig", errors="surrogateescape")
    return list(io.StringIO(text, newline="")), not text.isascii() and not_utf8(text)


def header_index(lines: list[str]) -> int:
    """The index of the header line: past leading blank lines and `#` comments."""
    for i, line in enumerate(lines):
        if line.strip() and not line.lstrip().startswith("#"):
            return i
    return len(lines)


def sniff(lines: list[str], first: int) -> str:
    """The delimiter that splits the header into columns and the most data lines into at most as
    many (trailing empty cells aside: spreadsheets pad rows); ties go to the wider header."""
    sample = "".join(lines[first:first + 200])[:SNIFF_CHARS]
    split = sample.splitlines()
    if len(split) > 1 and not sample.endswith(("\n", "\r")):
        split = split[:-1]                     # the sample cut a line short
    best, score = ",", (-1, 0)
    for d in DELIMITERS:
        parsed = [row for row in csv.reader(split[:50], delimiter=d) if row]
        if not parsed or len(parsed[0]) < 2:
            continue
        width = len(parsed[0])
        fit = sum(1 for row in parsed[1:] if len(row) > 1 and len(_trimmed(row)) <= width)
        if (fit, width) > score:
            best, score = d, (fit, width)
    return best


def rows(lines: list[str], pos: int, delimiter: str) -> Iterator[tuple[int, list[str] | None, str | None]]:
    """(first line number, cells, None) for each CSV row in lines[pos:], or (line number, None, why)
    for a row that cannot be read: a cell over the size limit, or a quote that is never closed;
    the lines such a quote took are read again as rows."""
    if csv.field_size_limit() < MAX_TEXT:
        csv.field_size_limit(MAX_TEXT)        # process-wide, and only ever raised
    restarts = 0
    while pos < len(lines):
        reader = csv.reader(itertools.islice(lines, pos, None), delimiter=delimiter)
        at = 0                                 # lines the reader has consumed
        while True:
            try:
                cells = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:           # the reader carries on at the next line
                yield pos + at + 1, None, f"not readable as CSV: {exc}"
                at = reader.line_num
                continue
            start, at = pos + at, reader.line_num
            if pos + at == len(lines) and pos + at - start > 1 and _unclosed(lines[start:], delimiter):
                restarts += 1
                if restarts > QUOTE_RESTARTS:
                    yield start + 1, None, (f"more than {QUOTE_RESTARTS} quotes are never closed; "
                                            "the rest of the file is not read")
                    return
                yield start + 1, None, "a quoted cell that starts on this line is never closed"
                pos = start + 1
                break
            yield start + 1, cells, None


def _unclosed(lines: list[str], delimiter: str) -> bool:
    """Whether the row that starts these lines runs to the end of the file inside a quoted cell."""
    try:
        for _ in csv.reader(lines, delimiter=delimiter, strict=True):
            pass
    except csv.Error:
        return True
    return False


def _trimmed(row: list[str]) -> list[str]:
    end = len(row)
    while end and not row[end - 1].strip():
        end -= 1
    return row[:end]


def not_utf8(text: str) -> bool:
    """Whether `text` holds bytes that were not UTF-8 (decoded as surrogate escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def printable(text: str) -> str:
    """`text` with the bytes that were not UTF-8 shown as U+FFFD, for a message."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
