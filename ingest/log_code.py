"""Source code a training log printed about itself: where it is, what it is, and its hyperparameters.

Many training scripts print their own source before they train (modded-nanogpt's speedrun
logs print the whole script, then a `====` line, then the run). That text is the run's code,
not its config: a `self.n_head = config.n_head` in it configures nothing.

    blocks = find_code(lines)                 # [(start, end)] line ranges, end exclusive
    source = "\\n\\n".join("\\n".join(lines[a:b]) for a, b in blocks)
    hyperparameters(source)                   # {"batch_size": 524288, "num_iterations": 1390, ...}

A block starts at a line only code starts with (`import x`, `from x import y`, `def`, `class`,
a decorator, `#!...python`, `if __name__ ==`; a docstring or comment when it is the log's first
line or follows a `====` rule), reaching back over the module docstring, comments and
`__version__`-style lines right above it. It runs while lines stay code: indented, blank,
comments, inside an open bracket or triple-quoted string or after a backslash, compound-statement
headers, or a statement that parses on its own (or with the lines its open brackets take). It
ends at the program's output: a line that does not parse, a bare word (`Killed`), a dict or
number (a JSON metrics line), a lone `Namespace(lr=0.1)`. A run of plain assignments and
imports (nanoGPT printing its config file) is config, not code, and is left to the config reader.

The one thing read out of code: the fields of a `@dataclass` named like settings
(`Hyperparameters`, `*Config`, `*Args`) with literal or arithmetic defaults. Those are the
program printing its own settings; nothing else in the code (module or function assignments,
`self.x = ...`, call arguments) becomes config.
"""
from __future__ import annotations

import ast
import re

from ingest.log_config import node_value

OPENER = re.compile(r"^(?:import\s+[\w.]+|from\s+\.*[\w.]*\s+import\s|(?:async\s+)?def\s+\w+\s*\(|class\s+\w+\s*[(:]"
                    r"|@[\w.]+|#!.*python|if\s+__name__\s*==)")
HEADER = re.compile(r"^(?:if|elif|else|for|while|try|except|finally|with|match|case|async)\b.*:\s*(?:#.*)?$")
BARE_WORD = re.compile(r"^[A-Za-z_]\w*\.?$")      # `Killed`, `done.`: what a program prints, not code
HEAD = re.compile(r"^(?:[rRbBuU]?(?:\"\"\"|\'\'\')|#)")        # how a script's first line may look: docstring, comment
DUNDER = re.compile(r"^__\w+__\s*=")                        # `__version__ = '1.0'` above the imports
SEPARATOR = re.compile(r"^\s*([=\-#*~_])\1{9,}\s*$")       # `=====...`, a printed rule
SETTINGS_CLASS = re.compile(r"^(?:Hyper[Pp]aram\w*|H[Pp]arams|\w*(?:Config|Args|Arguments|Settings))$")
MIN_LINES = 3                # fewer non-blank lines is not worth calling a script
LINE_PARSE_CHARS = 2000      # a longer line is never tried as a statement on its own
STATEMENT_LINES = 5000       # a literal table in a script (a dict of 1,000 entries) is one statement
# Lines the search may look at, in all, per line of the log. Without a bound, a log of openers each
# followed by an unclosed bracket costs STATEMENT_LINES per line (40,000 lines: 6 minutes); a real
# script is looked at about once per line.
SCAN_PER_LINE = 20


def find_code(lines: list[str]) -> list[tuple[int, int]]:
    """Line ranges [start, end) of printed Python source, in order."""
    blocks: list[tuple[int, int]] = []
    budget = [SCAN_PER_LINE * len(lines) + STATEMENT_LINES]     # lines left to look at
    i = 0
    while i < len(lines) and budget[0] > 0:
        if not (OPENER.match(lines[i]) or (HEAD.match(lines[i]) and _first_after_rule(lines, i))):
            i += 1
            continue
        start = _reach_back(lines, i, blocks[-1][1] if blocks else 0)
        end = _extend(lines, i, budget)
        if _is_code(lines[start:end]):
            blocks.append((start, end))
        i = max(end, i + 1)
    return blocks


def _first_after_rule(lines: list[str], i: int) -> bool:
    """Line i starts the log or follows a rule (`====`): where a script may open with its
    docstring or a comment rather than an import."""
    for k in range(i - 1, -1, -1):
        if lines[k].strip():
            return bool(SEPARATOR.match(lines[k]))
    return True


def _reach_back(lines: list[str], i: int, floor: int) -> int:
    """Include the comments and module docstring right above an opener."""
    j = i
    while j > floor:
        prev = lines[j - 1].strip()
        if not prev or prev.startswith("#") or DUNDER.match(prev):
            j -= 1
        elif prev.endswith(('"""', "'''")):
            quote = prev[-3:]
            opening = next((k for k in range(j - 1, max(floor, j - 400) - 1, -1)
                            if lines[k].lstrip().lstrip("rRbBuU").startswith(quote)
                            and (k < j - 1 or lines[k].count(quote) >= 2)), None)
            if opening is None:
                break
            j = opening
        else:
            break
    while j < i and not lines[j].strip():
        j += 1
    return j


def _extend(lines: list[str], i: int, budget: list[int]) -> int:
    """One past the last line of the block that starts at line i; what it looks at is taken from
    `budget`."""
    depth, quote, joined = 0, "", False
    end = j = i
    while j < len(lines):
        line = lines[j]
        budget[0] -= 1
        if not (depth or quote or joined or _code_line(line)):
            stop = _statement(lines, j, budget)     # `print0(` alone does not parse; with its lines it does
            if stop is None:
                break
            end = j = stop
            continue
        depth, quote = _carry(line, depth, quote)
        joined = not quote and line.rstrip().endswith("\\")      # a backslash continues the line
        if line.strip():
            end = j + 1
        j += 1
    return end


def _statement(lines: list[str], j: int, budget: list[int]) -> int | None:
    """One past a statement that starts at line j and spans lines (open brackets), if it parses."""
    depth, quote = _carry(lines[j], 0, "")
    joined = lines[j].rstrip().endswith("\\")
    k = j + 1
    while (depth or quote or joined) and k < min(len(lines), j + STATEMENT_LINES, j + budget[0]):
        depth, quote = _carry(lines[k], depth, quote)
        joined = not quote and lines[k].rstrip().endswith("\\")
        k += 1
    budget[0] -= k - j
    if k == j + 1 or depth or quote:
        return None
    text = "\n".join(lines[j:k])
    if re.sub(r"#[^\"']*$", "", text).rstrip().endswith(":"):
        text += "\n    pass"                    # `for x in (a,\n  b):` heads a block: its body follows
    try:
        ast.parse(text)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    return k


def _code_line(line: str) -> bool:
    text = line.strip()
    if not text or line[:1].isspace() or text.startswith("#"):
        return True
    if OPENER.match(line) or HEADER.match(line):
        return True
    if BARE_WORD.match(text) or len(text) > LINE_PARSE_CHARS:
        return False
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    return not _printed(tree)


def _printed(tree: ast.Module) -> bool:
    """A line that parses but is what programs print: a dict, list or number (a JSON metrics line),
    or a keyword-only `CapWord(...)` repr (`Namespace(lr=0.1)`) standing alone."""
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr):
        return False
    value = tree.body[0].value
    if isinstance(value, (ast.Dict, ast.List, ast.Tuple)) or (
            isinstance(value, ast.Constant) and not isinstance(value.value, str)):
        return True                      # a string alone is an attribute's docstring
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id[:1].isupper()
            and not value.args and bool(value.keywords))


def _carry(line: str, depth: int, quote: str) -> tuple[int, str]:
    """Bracket depth and open triple quote after `line`, given those before it (strings and
    comments skipped, so a `(` inside a string or a comment does not count)."""
    i, n = 0, len(line)
    while i < n:
        if quote:
            k = line.find(quote, i)
            if k < 0:
                return depth, quote
            i, quote = k + 3, ""
            continue
        c = line[i]
        if c == "#":
            break
        if line.startswith(('"""', "'''"), i):
            quote = line[i:i + 3]
            i += 3
            continue
        if c in "\"'":
            k = i + 1
            while k < n and line[k] != c:
                k += 2 if line[k] == "\\" else 1
            i = k + 1
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth = max(0, depth - 1)
        i += 1
    return depth, quote


def _is_code(block: list[str]) -> bool:
    """A script, not a printed config file: it defines, loops or calls something."""
    body = [x for x in block if x.strip()]
    if len(body) < MIN_LINES:
        return False
    try:
        tree = ast.parse("\n".join(block))
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        # interleaved or cut short: judge by what its lines start with
        return sum(bool(re.match(r"\s*(?:def|class|for|while|if|with|try|return)\b", x)) for x in body) >= 2
    plain = (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign, ast.AugAssign)
    stmts = [s for s in tree.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return any(not isinstance(s, plain) for s in stmts)


def hyperparameters(source: str) -> dict:
    """The literal defaults of the settings dataclasses defined in `source`, flat, later wins."""
    out: dict = {}
    for cls, text in _classes(source):
        if not _is_settings(cls):
            continue
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
                name, value = stmt.target.id, stmt.value
            elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                name, value = stmt.targets[0].id, stmt.value
            else:
                continue
            if not name.startswith("_"):
                out[name] = node_value(value, text)
    return out


def _classes(source: str) -> list[tuple[ast.ClassDef, str]]:
    """Top-level classes with the text they were parsed from; when the whole source does not
    parse, each class chunk on its own."""
    try:
        return [(n, source) for n in ast.parse(source).body if isinstance(n, ast.ClassDef)]
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        pass
    lines = source.splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.startswith("class "):
            continue
        start = i
        while start > 0 and lines[start - 1].startswith("@"):
            start -= 1
        end = i + 1
        while end < len(lines) and (not lines[end].strip() or lines[end][:1].isspace() or lines[end].startswith("#")):
            end += 1
        chunk = "\n".join(lines[start:end])
        try:
            out += [(n, chunk) for n in ast.parse(chunk).body if isinstance(n, ast.ClassDef)]
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            continue
    return out


def _is_settings(cls: ast.ClassDef) -> bool:
    if not SETTINGS_CLASS.match(cls.name):
        return False
    if cls.name.lower().startswith(("hyperparam", "hparam")):
        return True                      # settings by name, decorated or not
    for deco in cls.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            return True
    return False
