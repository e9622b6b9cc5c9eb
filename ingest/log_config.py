"""What a training log printed about its own settings, read into a typed config dict.

    config = read_config(bodies, first_metric)     # bodies: log lines, rank prefixes removed

Shapes read, in the order a line is tried:
  - argparse `Namespace(lr=0.1, ...)` and dataclass reprs `Hyperparameters(batch_size=524288, ...)`,
    `GPTConfig(n_layer=12, ...)` (a nested repr becomes a nested dict)
  - JSON / Python dict dumps, one line or pretty-printed
  - Megatron's argument dump `  lr ............ 0.0003`
  - nanoGPT's `Overriding: key = value` (anywhere in the log)
  - a command line `python train.py --lr 3e-4 --batch_size=32`, `torchrun ... train_gpt.py --foo 1`
  - llm.c's settings table `| learning rate (LR)    | 3.000000e-04 |`
  - `key=value key2=value2`, `key = value`, YAML-style `key: value` (nested by indentation)
Everything but reprs and `Overriding:` counts only before the first step line: after it, a
line like `loss = 2.3` reports, it does not configure. Lines of a printed source file are
blanked by the caller before they get here (ingest/log_code.py): code is never mined.

Values are Python literals, else simple arithmetic (`8*64*1024` -> 524288, `3e-4 / 2`,
`2**17`) evaluated by a walk over numeric constants and + - * / // % ** that refuses
names, calls and huge results, else a bare word kept as text (`adamw`, `/data/*.bin`).
"""
from __future__ import annotations

import ast
import json
import math
import operator
import re
import shlex
from pathlib import Path
from typing import Any

from kb.records import MAX_DEPTH, json_safe

NAMESPACE = re.compile(r"\b([A-Z]\w*)\((\s*[A-Za-z_]\w*\s*=.*)\)\s*$")
CONFIG_NAMES = re.compile(r"^(?:Namespace|Hyper[Pp]aram\w*|H[Pp]arams|\w*(?:Config|Args|Arguments|Settings))$")
ASSIGN = re.compile(r"^(?:Overriding:\s*)?([A-Za-z_][\w.]*)\s*=\s*(.+?)\s*$")
PAIRS = re.compile(r"^(?:[A-Za-z_][\w.\-]*=\S+[\s,]*){2,}$")
COLON = re.compile(r"^(\s*)([A-Za-z_][\w.\-]*)\s*:(?:\s+(.*?))?\s*$")
LIST_ITEM = re.compile(r"^(\s*)-\s+(.+?)\s*$")
ARGDOTS = re.compile(r"^\s*([A-Za-z_]\w*)\s+\.{3,}\s+(.*?)\s*$")      # Megatron's argument dump
TABLE_ROW = re.compile(r"^\|\s*([A-Za-z][^|]*?)\s*\|\s*([^|]*?)\s*\|\s*$")   # llm.c's two-column table
BARE = re.compile(r"[\w.\-/:+*~@%,]+")
STEP_KEYS = {"step", "iter", "iteration", "global_step", "global_steps", "_step", "iter_num"}
LAUNCHERS = {"torchrun", "deepspeed", "accelerate", "srun", "mpirun", "horovodrun", "uv", "composer"}
EXPR_CHARS = 200             # longer than this is not "simple arithmetic"
DUMP_LINES = 2000            # a pretty-printed dump longer than this is not read as one
INT_BITS = 256               # an integer result past this is not a hyperparameter
TEXT_CHARS = 300             # an unevaluated expression kept as text is cut here
NEST_DEPTH = MAX_DEPTH - 2   # `key:` levels a YAML-style dump opens; the record holds config.a.b... this deep
YAML_WORDS = {"null": None, "~": None, "true": True, "false": False}    # OmegaConf.to_yaml, yaml.dump


# ---- values -----------------------------------------------------------------------------------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def arithmetic(expr: str | ast.AST) -> int | float | None:
    """The value of `8*64*1024`, `3e-4 / 2`, `-2**17`; None for anything else (names, calls, huge)."""
    if isinstance(expr, str):
        if len(expr) > EXPR_CHARS:
            return None
        try:
            expr = ast.parse(expr.strip(), mode="eval").body
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return None
    try:
        value = _arith(expr, 0)
    except (ArithmeticError, ValueError, TypeError, RecursionError):
        return None
    return value if not isinstance(value, float) or math.isfinite(value) else None


def _arith(node: ast.AST, depth: int) -> int | float:
    if depth > 40:
        raise ValueError("too deep")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _arith(node.operand, depth + 1)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = _arith(node.left, depth + 1), _arith(node.right, depth + 1)
        if isinstance(node.op, ast.Pow) and (abs(b) > 64 or (abs(a) > 1 and abs(b) * math.log2(abs(a)) > INT_BITS)):
            raise ValueError("power too large")      # 9**9**9 would run for ever; bound it first
        out = _OPS[type(node.op)](a, b)
        if isinstance(out, complex) or (isinstance(out, int) and out.bit_length() > INT_BITS):
            raise ValueError("not a plain number")
        return out
    raise ValueError(f"not arithmetic: {type(node).__name__}")


def literal(raw: str) -> tuple[bool, Any]:
    """(True, value) for a printed value: a literal, simple arithmetic, or a bare word; else (False, None)."""
    raw = raw.strip()
    for candidate in dict.fromkeys((raw, raw.split("#", 1)[0].strip())):
        try:
            return True, json_safe(ast.literal_eval(candidate))
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            pass
        if (number := arithmetic(candidate)) is not None:
            return True, number
    bare = raw.split("#", 1)[0].strip()
    if bare and BARE.fullmatch(bare):
        return True, bare                  # an unquoted word: torch.bfloat16, adamw, /data/*.bin
    return False, None


def node_value(node: ast.AST, source: str | None = None) -> Any:
    """A config value from an expression: literal, arithmetic, a nested keyword-only call as a
    dict, else its text as written in `source` (an f-string, `field(default_factory=list)`)."""
    try:
        return json_safe(ast.literal_eval(node))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    if (number := arithmetic(node)) is not None:
        return number
    if isinstance(node, ast.Call) and node.keywords and not node.args:
        return call_kwargs(node, source)
    text = ast.get_source_segment(source, node) if source else None
    return (text or ast.unparse(node))[:TEXT_CHARS]


def call_kwargs(call: ast.Call, source: str | None = None) -> dict:
    return {kw.arg: node_value(kw.value, source) for kw in call.keywords if kw.arg is not None}


# ---- line shapes ---------------------------------------------------------------------------------

def repr_config(text: str, any_name: bool = True) -> dict | None:
    """`Namespace(a=1, b='x')`, `Hyperparameters(...)`: read as a call so nested commas and quotes are safe.

    With `any_name` (before the first step) any class name counts; else only names that say config."""
    # the regex ends in `.*\)$`: a line that cannot end there would cost a scan per `Word(` in it
    m = NAMESPACE.search(text) if "=" in text and text.rstrip().endswith(")") else None
    if not m or (not any_name and not CONFIG_NAMES.match(m.group(1))):
        return None
    if text[:m.start(1)].endswith("."):
        return None              # `torch.amp.GradScaler(enabled=...)`: a source line a warning echoed
    inner = f"f({m.group(2)})"
    try:
        call = ast.parse(inner, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    return call_kwargs(call, inner) if isinstance(call, ast.Call) else None


def dump_ends(lines: list[str]) -> list[int | None]:
    """For each line i, one past the line where the braces counted from line i balance (the end
    of a pretty-printed JSON/dict dump that starts there), or None if they do not within
    DUMP_LINES lines. One pass over prefix sums of `{` minus `}` (the next m > i whose sum is at
    most line i's): looking ahead from every `{` line cost DUMP_LINES each (40,000 lines of
    `{`: 21 s)."""
    prefix = [0]
    for text in lines:
        prefix.append(prefix[-1] + text.count("{") - text.count("}"))
    ends: list[int | None] = [None] * len(lines)
    waiting: list[int] = []                  # line starts not yet balanced; their sums strictly increase
    for m, total in enumerate(prefix):
        while waiting and total <= prefix[waiting[-1]]:
            i = waiting.pop()
            if m - i <= DUMP_LINES:
                ends[i] = m
        if m < len(lines):
            waiting.append(m)
    return ends


def literal_dict(body: str) -> dict | None:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        try:
            data = ast.literal_eval(body)       # Python dict reprs: {'lr': 0.1}
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            return None
    return data if isinstance(data, dict) else None


def command_line(text: str) -> tuple[dict, dict] | None:
    """({flag: value}, {"entrypoint", "argv"}) for a printed `python train.py --lr 3e-4 ...`, else None.

    Flags after the script are the run's settings; a launcher's own (`--nproc_per_node=8`) are not."""
    if ".py" not in text:
        return None
    text = re.sub(r"^(?:\$|\+|>>>|#)\s+", "", text.strip())    # a shell prompt or `set -x` trace
    try:
        argv = shlex.split(text)
    except ValueError:
        return None
    script = next((i for i, a in enumerate(argv) if a.endswith(".py")), None)
    if script is None:
        return None
    heads = [Path(a).name for a in argv[:script] if "=" not in a or a.startswith("-")]
    if heads and not (re.match(r"python[\d.]*$", heads[0]) or heads[0] in LAUNCHERS):
        return None
    config: dict[str, Any] = {}
    rest = argv[script + 1:]
    i = 0
    while i < len(rest):
        arg = rest[i]
        i += 1
        if not arg.startswith("--") or len(arg) < 3:
            continue                               # a positional (nanoGPT's config file) or -x
        key, eq, val = arg[2:].partition("=")
        key = key.replace("-", "_")
        if eq:
            config[key] = _arg_value(val)
            continue
        vals = []
        while i < len(rest) and not _is_flag(rest[i]):
            vals.append(_arg_value(rest[i]))
            i += 1
        config[key] = True if not vals else vals[0] if len(vals) == 1 else vals
    return config, {"entrypoint": argv[script], "argv": argv}


def _is_flag(arg: str) -> bool:
    return arg.startswith("-") and arithmetic(arg) is None     # -1 and -3e-4 are values


def _arg_value(raw: str) -> Any:
    ok, value = literal(raw)
    return value if ok else raw


def table_row(text: str) -> tuple[str, Any] | None:
    """llm.c's `| micro batch size B | 64 |` -> ("micro_batch_size", 64); a header row is not one."""
    m = TABLE_ROW.match(text)
    if not m:
        return None
    words = re.sub(r"\([^)]*\)", " ", m.group(1)).split()
    if len(words) > 1 and re.fullmatch(r"[A-Z][A-Za-z]?", words[-1]):
        words = words[:-1]                         # the symbol llm.c prints after a name: B, T, Vp, NH
    key = "_".join(words).lower()
    if not key or (key == "parameter" and m.group(2).lower() == "value"):
        return None
    ok, value = literal(m.group(2))
    return key, value if ok else m.group(2)


# ---- a whole log -------------------------------------------------------------------------------

def read_config(bodies: list[str], first_metric: int, code: dict | None = None) -> dict:
    """The settings printed in `bodies` (rank-free log lines; printed code already blanked).

    `code`, if given, receives the entrypoint and argv of a printed command line."""
    config: dict[str, Any] = {}
    nest: list[tuple[int, dict, str]] = []       # YAML-style `key:` lines opened: (indent, parent, key)
    ends: list[int | None] = []                  # dump_ends(bodies), once a dump may start
    i = 0
    while i < len(bodies):
        raw = bodies[i]
        text = raw.strip()
        before = i < first_metric
        i += 1
        if not text or ":::MLLOG" in text:
            nest.clear()
            continue
        if text.startswith("{") and before:
            ends = ends or dump_ends(bodies)
            end = ends[i - 1]
            data = literal_dict("\n".join(bodies[i - 1:end])) if end else None
            if data and not any("loss" in str(k) for k in data):
                config.update(json_safe(data))
            if data is not None:
                i = max(i, end)
            continue
        if (found := repr_config(text, any_name=before)) is not None:
            config.update(found)
        elif (m := ARGDOTS.match(raw)):
            ok, v = literal(m.group(2))
            if ok:
                config[m.group(1)] = v
        elif text.startswith("Overriding:"):
            if (m := ASSIGN.match(text)):
                _assign(config, m.group(1), m.group(2))
        elif not before:
            pass                                     # past the first step: only reprs and overrides
        elif (cmd := command_line(text)) is not None:
            config.update(cmd[0])
            if code is not None:
                code.update(cmd[1])
        elif (row := table_row(text)) is not None:
            config[row[0]] = row[1]
        elif PAIRS.match(text):
            for token in re.split(r"[\s,]+", text):
                if "=" in token:
                    key, _, val = token.partition("=")
                    _assign(config, key, val)
        elif (m := ASSIGN.match(text)):
            _assign(config, m.group(1), m.group(2))
        elif (m := COLON.match(raw)):
            _nested(config, nest, len(m.group(1).expandtabs()), m.group(2), m.group(3))
            continue
        elif nest and (m := LIST_ITEM.match(raw)):
            _list_item(nest, len(m.group(1).expandtabs()), m.group(2))
            continue
        nest.clear()
    return _prune(config)


def _assign(config: dict, key: str, raw: str) -> None:
    ok, value = literal(raw)
    # lowercase only: an echoed environment (PATH=..., CUDA_HOME=...) is not the run's config
    if ok and key not in STEP_KEYS and not key.isupper():
        config[key] = value


def _nested(config: dict, nest: list[tuple[int, dict, str]], indent: int, key: str, raw: str | None) -> None:
    """One YAML-style line: `key: value` into the dict its indentation puts it in, `key:` opens one."""
    while nest and nest[-1][0] >= indent:
        nest.pop()
    if len(nest) >= NEST_DEPTH:
        return                                   # deeper than a record holds: not a settings dump
    parent = nest[-1][1][nest[-1][2]] if nest else config
    if not isinstance(parent, dict):
        return                                   # a `key:` under a list item: not read
    if raw is None or raw == "":
        parent[key] = {}
        nest.append((indent, parent, key))
        return
    ok, value = _yaml_value(raw)
    if ok and key not in STEP_KEYS and not key.isupper():
        parent[key] = value


def _list_item(nest: list[tuple[int, dict, str]], indent: int, raw: str) -> None:
    """`- 0.9` under an opened `key:` (yaml.dump's block lists): the key holds a list."""
    opened, parent, key = nest[-1]
    if indent < opened:
        return
    if parent[key] == {}:
        parent[key] = []
    ok, value = _yaml_value(raw)
    if ok and isinstance(parent[key], list):
        parent[key].append(value)


def _yaml_value(raw: str) -> tuple[bool, Any]:
    return (True, YAML_WORDS[raw]) if raw in YAML_WORDS else literal(raw)


def _prune(config: dict) -> dict:
    """Drop the empty dicts a `config:` heading left when no indented keys followed it."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict) and v:
            v = _prune(v)
        if not (isinstance(v, dict) and not v):
            out[k] = v
    return out
