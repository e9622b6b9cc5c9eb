"""The words of quantitative questions: what the planner's parser (agents.planner_parse) reads.

A question is cut into items: numbers and model sizes (`125M`, `1.3 billion params`, `2.5B
tokens`), quantities the vocabulary knows (`val loss`, `learning rate`, `config.optim.lr`, each
as the RunField key it is stored under), outcome words (`diverged`, `OOMed`, `loss spike`),
comparators (`below`, `at least`), and the words that pick a shape (`lowest`, `how many`,
`mean`, `by`, `what changed`). Longest phrase first, so `loss spike` is an outcome and not a
loss, and `train loss` a metric and not the filler word `train`. Words it has no entry for stay
`word` items: they may name a run or a project (`link` looks them up), or the parser gives up.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from kb import vocab
from kb.errors import QueryError
from kb.fields import NAMESPACES, canonical
from kb.query import Exists, parse as parse_where

# outcome -> (run statuses, failure kinds, anomaly kinds); a run with any of them has it
OUTCOMES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "diverged": (("diverged",), ("diverged",), ("divergence",)),
    "failed": (("failed", "killed", "diverged"), ("oom", "nccl_timeout", "hardware", "killed", "exception", "diverged"), ()),
    "crashed": (("failed", "killed"), ("oom", "nccl_timeout", "hardware", "killed", "exception"), ()),
    "completed": (("completed",), (), ()),
    "killed": (("killed",), ("killed",), ()),
    "running": (("running",), (), ()),
    "oom": ((), ("oom",), ()),
    "nccl_timeout": ((), ("nccl_timeout",), ()),
    "hardware": ((), ("hardware",), ()),
    "exception": ((), ("exception",), ()),
    "loss_spike": ((), ("loss_spike",), ("loss_spike",)),
    "grad_spike": ((), (), ("grad_spike",)),
    "plateau": ((), ("plateau",), ("plateau",)),
}
# outcome -> (what runs that had it did, what runs that did not have it did not)
OUTCOME_WORDS = {"diverged": ("diverged", "did not diverge"), "failed": ("failed", "did not fail"),
                 "crashed": ("crashed", "did not crash"), "completed": ("completed", "did not complete"),
                 "killed": ("were killed", "were not killed"), "running": ("are running", "are not running"),
                 "oom": ("ran out of memory", "did not run out of memory"),
                 "nccl_timeout": ("hit an NCCL timeout", "hit no NCCL timeout"),
                 "hardware": ("hit a hardware failure", "hit no hardware failure"),
                 "exception": ("raised an exception", "raised no exception"),
                 "loss_spike": ("had a loss spike", "had no loss spike"),
                 "grad_spike": ("had a gradient-norm spike", "had no gradient-norm spike"),
                 "plateau": ("plateaued", "did not plateau")}
HIGHER_IS_BETTER = {"summary.val/accuracy", "summary.train/accuracy", "summary.mfu", "summary.tokens_per_sec"}
DEFAULT_METRIC = "summary.val/loss"


def label(key: str) -> str:
    """summary.val/loss -> val/loss, hparams.lr -> lr: the canonical name people say."""
    return key.split(".", 1)[1] if "." in key else key


@dataclass
class Item:
    kind: str
    text: str
    value: Any = None
    used: bool = False


# ---- items -----------------------------------------------------------------------------------

TOKEN = re.compile(r"""(?<!\w)'([^']+)'(?!\w)|"([^"]+)"|`([^`]+)`|(<=|>=|!=|==|=|<|>)"""
                   r"""|(\d{1,3}(?:,\d{3})+(?:\.\d+)?)|([^\s<>=!,;?()"`]+)""")
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?\Z")
SUFFIXED = re.compile(r"(\d+(?:\.\d+)?)([kmbt])(?:-?(params?|parameters?|tokens?|flops?|models?))?\Z")
COUNTED = re.compile(r"(\d+(?:\.\d+)?)-(?:steps?|iters?|iterations?|epochs?)\Z")
SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
MULTIPLIERS = {"thousand": 1e3, "million": 1e6, "billion": 1e9, "trillion": 1e12}
UNITS = {"param": "scale.params", "params": "scale.params", "parameter": "scale.params",
         "parameters": "scale.params", "model": "scale.params", "models": "scale.params",
         "token": "scale.tokens", "tokens": "scale.tokens", "flop": "scale.flops", "flops": "scale.flops"}
NOT_SCALE = {"step", "steps", "iter", "iters", "iteration", "iterations", "batch", "batches", "sample",
             "samples", "sequence", "sequences", "example", "examples", "second", "seconds", "hour",
             "hours", "gpu", "gpus", "epoch", "epochs", "update", "updates"}

PHRASES: dict[tuple[str, ...], tuple[str, Any]] = {}


def _phrases(kind: str, value: Any, *texts: str) -> None:
    for t in texts:       # the first kind given to a phrase keeps it: fillers come last
        PHRASES.setdefault(tuple(t.split()), (kind, value))


_phrases("count", None, "how many", "number of", "count of", "count", "total number of")
_phrases("agg", "mean", "mean", "average", "avg", "on average", "typical")
_phrases("agg", "median", "median")
_phrases("by", None, "by", "per", "for each", "for every", "grouped by", "broken down by", "across", "for different")
_phrases("compare", None, "compare", "comparing", "comparison of")
_phrases("diff", None, "what changed", "what's different", "what is different", "what was different",
         "what differs", "difference", "differences", "differ", "differs", "diff", "changed", "change",
         "different")      # "what's different": the possessive is cut first, leaving "what" "different"
_phrases("config", None, "config", "configs", "configuration", "configurations", "setup", "settings",
         "hyperparameters", "hyperparameter settings", "hparams", "recipe")
_phrases("project_kw", None, "project", "projects")
_phrases("tag_kw", None, "tag", "tags", "tagged", "with tag", "labelled", "labeled")
_phrases("neg", None, "not", "never", "no", "without", "didn't", "don't", "doesn't", "wasn't", "weren't",
         "haven't", "hasn't", "isn't", "aren't", "non")
_phrases("conj", None, "and", "or", "vs", "vs.", "versus", "compared to", "compared with", "against")
_phrases("between", None, "between")
_phrases("sup", "min", "lowest", "minimum", "min", "smallest", "least", "lower", "fewest")
_phrases("sup", "max", "highest", "maximum", "max", "largest", "biggest", "greatest", "most", "higher")
_phrases("sup", "best", "best", "optimal", "better", "best-performing", "best performing")
_phrases("sup", "worst", "worst", "worse", "worst-performing")
_phrases("top", None, "top")
_phrases("cmp", "<", "<", "below", "under", "less than", "lower than", "smaller than", "fewer than", "beneath")
_phrases("cmp", "<=", "<=", "at most", "no more than", "up to")
_phrases("cmp", ">", ">", "above", "over", "more than", "greater than", "higher than", "larger than",
         "bigger than", "exceeding")
_phrases("cmp", ">=", ">=", "at least", "no less than")
_phrases("soft", "=", "=", "==", "of", "is", "at", "equal to", "equals", "set to", "was", "were", "with")
_phrases("outcome", "diverged", "diverged", "diverge", "diverges", "diverging", "divergent", "divergence",
         "blew up", "blow up", "blows up", "exploded", "explode", "went nan", "go nan", "nan", "nan'd")
_phrases("outcome", "failed", "failed", "fail", "fails", "failing", "failure", "failures")
_phrases("outcome", "crashed", "crashed", "crash", "crashes", "errored", "error", "errors")
_phrases("outcome", "completed", "completed", "complete", "succeeded", "succeed", "successful", "success",
         "finished", "finish")
_phrases("outcome", "killed", "killed", "preempted", "cancelled", "canceled")
_phrases("outcome", "running", "running", "still running", "in progress")
_phrases("outcome", "oom", "oom", "oomed", "ooms", "oom'd", "out of memory", "ran out of memory",
         "run out of memory", "out-of-memory")
_phrases("outcome", "nccl_timeout", "nccl timeout", "nccl timeouts", "nccl", "timed out")
_phrases("outcome", "hardware", "hardware failure", "hardware failures", "hardware error", "gpu failure")
_phrases("outcome", "exception", "exception", "exceptions", "raised an exception")
_phrases("outcome", "loss_spike", "loss spike", "loss spikes", "spiked", "spike", "spikes", "spiking")
_phrases("outcome", "grad_spike", "grad spike", "grad spikes", "gradient spike", "gradient spikes",
         "grad norm spike", "grad norm spikes", "gradient norm spike")
_phrases("outcome", "plateau", "plateau", "plateaued", "plateaus", "stalled")
_phrases("wh", None, "which", "what", "who", "list", "show", "name", "tell me", "give me", "find",
         "did any", "were any", "was any", "have any", "has any", "are there", "is there", "were there", "was there")
_phrases("filler", None, *"""the a an model models for in on among amongst from to our my we us you i all any each every
    run runs experiment experiments trained train training trainings did do does done had has have having
    are be been being gave give gives giving got get gets getting reach reached reaches achieve achieved
    achieves produce produced produces yield yielded yields lead led leads showed shows end ended ends
    final finally overall total value values result results there this that those these it its ever so far
    scale scales size sized sizes used use uses using tried try tries tested sweep swept sweeps ran
    launched one ones about how when where then now also only just than as up out seen reported logged
    measured recorded their they them both same hit hits""".split(),
         "what about", "how about", "same for", "same question for", "so far", "and what about", "and for",
         "please")
PHRASE_MAX = max(map(len, PHRASES))


def _alias_index(table: dict[str, tuple[str, ...]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for canon, aliases in table.items():
        for alias in (canon, *aliases):
            out.setdefault(vocab.fold(alias), canon)
    return out


# exact aliases only for phrases of several words: vocab.metric_name also strips a tracker's
# section prefix ("charts/val_loss"), which would read "lowest loss" as a metric named loss
_SCALE, _HPARAM, _METRIC = (_alias_index(t) for t in (vocab.SCALE, vocab.HPARAMS, vocab.METRICS))


def quantity(words: list[str]) -> str | None:
    """The RunField key a phrase names: scale first, then hyperparameters, then metrics (the order
    of kb.query's bare names), or a dotted key written out (config.optim.lr)."""
    if len(words) == 1 and "." in words[0] and words[0].split(".", 1)[0] in NAMESPACES:
        try:
            node = parse_where(f"{words[0]} exists")
        except QueryError:
            return None
        return canonical(node.key) if isinstance(node, Exists) else None
    phrase = " ".join(words)
    candidates = [phrase]
    if phrase.endswith("es") and len(phrase) > 4:
        candidates.append(phrase[:-2])
    if phrase.endswith("s") and len(phrase) > 2:          # "lrs", "LRs"
        candidates.append(phrase[:-1])
    for p in candidates:
        f = vocab.fold(p)
        if f == "loss":
            # a question's bare "loss" is the held-out one: ranking runs by final train loss
            # rewards memorising; the answer names the metric, so the reading is visible
            return DEFAULT_METRIC
        if f in _SCALE:
            return canonical(("scale", _SCALE[f]))
        if f in _HPARAM:
            return canonical(("hparams", _HPARAM[f]))
        # a tracker's section prefix ("charts/val_loss") only on a single token with a slash:
        # run ids join with dashes ("base-lr" is a run, not the lr of a section "base")
        metric = _METRIC.get(f) or (vocab.metric_name(p) if len(words) == 1 and "/" in p else None)
        if metric:
            return canonical(("summary", metric))
    return None


def tokens(question: str) -> list[tuple[str, bool]]:
    """(token, quoted) pairs; sentence punctuation and possessives stripped."""
    out = []
    for m in TOKEN.finditer(question):
        quoted = next((g for g in m.groups()[:3] if g is not None), None)
        if quoted is not None:
            out.append((quoted.strip(), True))
            continue
        tok = (m.group(4) or m.group(5) or m.group(6)).strip(".:!'")
        if tok.lower().endswith("'s"):
            tok = tok[:-2]
        if tok.lower().startswith("non-") and len(tok) > 4:
            out += [("non", False), (tok[4:], False)]
        elif tok:
            out.append((tok, False))
    return out


def items(question: str) -> list[Item]:
    toks = tokens(question)
    low = [t.lower() for t, _ in toks]
    out: list[Item] = []
    i = 0
    while i < len(toks):
        text, quoted = toks[i]
        if quoted:
            out.append(Item("word", text))           # a name: only the linker reads it
            i += 1
            continue
        if (num := _number(low, i)) is not None:
            item, i = num
            out.append(item)
            continue
        best: tuple[int, str, Any] | None = None
        for n in range(min(PHRASE_MAX, len(toks) - i), 0, -1):
            if tuple(low[i:i + n]) in PHRASES:
                best = (n, *PHRASES[tuple(low[i:i + n])])
                break
        for n in range(min(4, len(toks) - i), (best[0] if best else 0), -1):
            if any(q for _, q in toks[i:i + n]):
                continue
            if (key := quantity(low[i:i + n])) is not None:
                best = (n, "qty", key)
                break
        if best is None and "/" in text and (keys := _listed_quantities(low[i])):
            out += [Item("qty", part, key) for part, key in zip(text.split("/"), keys)]
            i += 1
            continue
        if best is None:
            out.append(Item("word", text))
            i += 1
        else:
            n, kind, value = best
            out.append(Item(kind, " ".join(t for t, _ in toks[i:i + n]), value))
            i += n
    return out


def _listed_quantities(tok: str) -> list[str] | None:
    """ "lr/warmup/batch": quantities listed with slashes, when every part is one."""
    # a list abbreviates: "batch" is the batch size, "warmup" the warmup steps
    keys = [quantity([part]) or quantity([part, "size"]) or quantity([part, "steps"]) for part in tok.split("/")]
    return keys if len(keys) > 1 and all(keys) else None


def _number(low: list[str], i: int) -> tuple[Item, int] | None:
    """A number or a model size at low[i] (with its multiplier and unit words), and where it ends."""
    tok = low[i]
    if m := COUNTED.match(tok):                  # "a 500-step warmup": the 500 of the warmup
        return Item("num", m.group(1), float(m.group(1))), i + 1
    if m := SUFFIXED.match(tok):
        value, end, unit = float(m.group(1)) * SUFFIX[m.group(2)], i + 1, m.group(3)
        tok = m.group(1) + m.group(2)
    elif NUMBER.match(tok.replace(",", "")):
        value, end, unit = float(tok.replace(",", "")), i + 1, None
        if end < len(low) and low[end] in MULTIPLIERS:
            value *= MULTIPLIERS[low[end]]
            end += 1
            unit = unit or "params"
    else:
        return None
    text = " ".join([tok.upper() if SUFFIXED.match(tok) else tok, *low[i + 1:end]])
    nxt = low[end] if end < len(low) else ""
    if nxt in ("training", "train") and end + 1 < len(low) and low[end + 1] in ("tokens", "token"):
        end, nxt = end + 1, low[end + 1]
    if nxt in UNITS:
        return Item("scale", text, (value, UNITS[nxt])), end + 1
    if unit or SUFFIXED.match(tok):
        if nxt in NOT_SCALE:          # "10k steps": a size we cannot place
            return Item("word", text), end
        return Item("scale", text, (value, UNITS.get(unit or "params", "scale.params"))), end
    return Item("num", text, value), end


Linker = Callable[[list[str]], dict[str, tuple[str, str]]]


def link(its: list[Item], linker: Linker | None) -> None:
    """Words that may name a run or a project, looked up once: `linker(words)` returns
    {word: ("run", id) | ("project", name)} for those it knows."""
    words = [it.text for it in its if it.kind == "word"]
    if not words or linker is None:
        return
    found = linker(words)
    for it in its:
        if it.kind == "word" and it.text in found:
            it.kind, it.value = found[it.text][0], found[it.text]
    for i, it in enumerate(its):
        # "learned position embeddings", "rmsnorm layers": the words after a config value that
        # name its key ("pos" -> position) or say what kind of thing it is
        if it.kind == "word" and i and its[i - 1].kind in ("value", "value_noun"):
            key = its[i - 1].value[1] if its[i - 1].kind == "value" else its[i - 1].value
            leaf = key.rsplit(".", 1)[-1].lower()
            w = it.text.lower()
            if w in VALUE_NOUNS or (len(leaf) >= 3 and (w.startswith(leaf) or leaf.startswith(w))):
                it.kind, it.value = "value_noun", key


# what a config value is a kind of: "learned position embeddings", "the rope variant"
VALUE_NOUNS = {"embedding", "embeddings", "encoding", "encodings", "layer", "layers", "variant",
               "variants", "type", "types", "option", "options", "setting", "scheme", "schemes",
               "position", "positions", "positional", "normalization", "normalisation", "norm", "norms"}
