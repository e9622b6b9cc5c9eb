"""Quantitative questions parsed into a Plan, without an LLM.

    "Which learning rate gave the lowest val loss for the 125M runs?"
    -> Plan(shape="extreme", metric="summary.val/loss", lowest=True, report=("hparams.lr",),
            where=(Constraint("scale.params", "near", ((112.5e6, 137.5e6),), "at ~125M params"),))

The question is cut into items (numbers, model sizes, quantities the vocabulary knows, outcome
words, comparators, shape words), words that may name a run or a project are looked up
(`link`), constraints are attached, and the shape is read off what is left. Every word must be
accounted for: one the parser does not understand makes it give up (None), because answering
"how many runs used rotary embeddings" as "how many runs" would be a confident wrong number.
The shapes: extreme (lowest/highest X), count and runs (how many / which runs), aggregate (mean
or median of X, by a group or between listed values), diff (what changed between two runs),
best_config (the config of the best run), values (which learning rates diverged).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from agents.planner_words import DEFAULT_METRIC, HIGHER_IS_BETTER, OUTCOME_WORDS, Item, Linker, items, label, link

# Nominal model sizes name a family, not a count: GPT-2 "125M" is 124.4M or 123.6M depending on
# how the embeddings are counted. ±10% takes those in, and the usual ladder (125M, 350M, 760M,
# 1.3B, ...) steps by well over 20%, so two sizes never share a band. Token counts likewise.
SCALE_BAND = 0.10
# An hparam named by value ("lr 3e-4") matches within 0.01%: float32 storage (3e-4 logged as
# 0.0003000000142) passes, two values of any real sweep never do.
VALUE_BAND = 1e-4
MAX_K = 20


@dataclass(frozen=True)
class Constraint:
    dim: str            # a RunField key (hparams.lr, scale.params), or project | runs | tag | outcome
    op: str             # near (values: (lo, hi) bands, any holds) | < | <= | > | >= | in | is (text values)
    values: tuple
    words: str          # what it means, in the question's own numbers, for the answer's scope
    negated: bool = False
    labels: tuple = ()  # near: each band as the question wrote it ("125M", "1000"), to name groups


@dataclass(frozen=True)
class Plan:
    shape: str                      # extreme | count | runs | aggregate | diff | best_config | values
    metric: str | None = None       # the measured RunField key
    lowest: bool = True             # extreme, best_config: which end
    k: int = 3                      # extreme: runs shown
    aggregate: str = "mean"         # aggregate: mean | median
    group: str | None = None        # aggregate: grouped by this RunField key
    report: tuple[str, ...] = ()    # keys shown beside the measured one ("which learning rate")
    where: tuple[Constraint, ...] = ()
    runs: tuple[str, ...] = ()      # diff: the two runs

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        where = tuple(Constraint(c["dim"], c["op"], tuple(tuple(v) if isinstance(v, list) else v for v in c["values"]),
                                 c["words"], c.get("negated", False), tuple(c.get("labels", ())))
                      for c in d.get("where", ()))
        return cls(**{**d, "where": where, "report": tuple(d.get("report", ())), "runs": tuple(d.get("runs", ()))})


# ---- constraints -----------------------------------------------------------------------------

def _band(value: float, rel: float) -> tuple[float, float]:
    lo, hi = value * (1 - rel), value * (1 + rel)
    return (min(lo, hi), max(lo, hi))


def _next(its: list[Item], j: int) -> int:
    """The index of the next item that is not an article."""
    while j < len(its) and its[j].kind == "filler" and its[j].text.lower() in ("the", "a", "an"):
        j += 1
    return j


def _values(its: list[Item], j: int, key: str | None = None) -> tuple[list[Item], int]:
    """A list of values starting at j ("1000 and 2000", "3e-4, 1e-3 or 3e-3", "125M and 350M"),
    all of one kind, and the index after them. With `key`, only values that key can take: a
    model size is a value of scale.params, never of a learning rate or a loss."""
    def fits(it: Item) -> bool:
        if it.used or it.kind not in ("num", "scale"):
            return False
        if vals:
            return it.kind == vals[0].kind and (it.kind == "num" or it.value[1] == vals[0].value[1])
        return key is None or it.kind == "num" or it.value[1] == key

    vals: list[Item] = []
    while j < len(its) and fits(its[j]):
        vals.append(its[j])
        j += 1
        if j + 1 < len(its) and its[j].kind == "conj" and fits(its[j + 1]):
            j += 1
    return vals, j


def _number_of(it: Item) -> float:
    return it.value[0] if it.kind == "scale" else it.value


CMP_WORDS = {"<": "below", "<=": "at most", ">": "above", ">=": "at least"}


def _describe(key: str, op: str, texts: list[str]) -> str:
    name = label(key)
    if key == "scale.params":
        return "at " + " or ".join(f"~{t} params" for t in texts) if op == "near" else \
            f"with params {CMP_WORDS.get(op, op)} {texts[0]}"
    if key == "scale.tokens":
        return "trained on " + " or ".join(f"~{t} tokens" for t in texts) if op == "near" else \
            f"with tokens {CMP_WORDS.get(op, op)} {texts[0]}"
    if op == "near":
        return f"with {name} " + " or ".join(texts)
    if op == "between":
        return f"with {name} between {texts[0]} and {texts[1]}"
    return f"with {name} {CMP_WORDS.get(op, op)} {texts[0]}"


def constraints(its: list[Item], grouping: bool) -> list[Constraint]:
    """Attach the constraints the items state, marking the items they use. `grouping`: the
    question compares or averages, so "between 125M and 350M" is two groups, not a range."""
    out: list[Constraint] = []
    for i, it in enumerate(its):                  # quantity, then its test: "lr 3e-4", "val loss below 3.3"
        if it.kind != "qty" or it.used:
            continue
        j = _next(its, i + 1)
        if j < len(its) and its[j].kind == "cmp" and (k := _next(its, j + 1)) < len(its) and _values(its, k, it.value)[0]:
            out.append(Constraint(it.value, its[j].value, (_number_of(its[k]),),
                                  _describe(it.value, its[j].value, [its[k].text])))
            it.used = its[j].used = its[k].used = True
            continue
        if (j < len(its) and its[j].kind == "between" and not grouping and j + 3 < len(its)
                and its[j + 1].kind in ("num", "scale") and its[j + 2].kind == "conj" and its[j + 3].kind in ("num", "scale")):
            lo, hi = sorted((_number_of(its[j + 1]), _number_of(its[j + 3])))
            out.append(Constraint(it.value, "near", ((lo, hi),),
                                  _describe(it.value, "between", [its[j + 1].text, its[j + 3].text])))
            for x in its[i:j + 4]:
                x.used = True
            continue
        if j < len(its) and its[j].kind == "soft":
            if it.value.startswith("summary.") and its[j].text.lower() in ("at", "with"):
                continue                          # "lowest val loss at 3e-4": the 3e-4 of what?
            j = _next(its, j + 1)
        vals, end = _values(its, j, it.value)
        if vals:
            out.append(_near(it.value, vals))
            it.used = True
            for x in its[i:end]:
                if x.kind in ("soft", "conj", "num", "scale"):
                    x.used = True
    for i, it in enumerate(its):                  # numbers, then the hparam: "2000 warmup steps"
        if it.kind != "num" or it.used:
            continue
        vals, end = _values(its, i)
        if end < len(its) and its[end].kind == "qty" and not its[end].used and its[end].value.startswith("hparams."):
            out.append(_near(its[end].value, vals))
            for x in its[i:end + 1]:
                x.used = True
    for i, it in enumerate(its):                  # model sizes and token counts on their own
        if it.kind != "scale" or it.used:
            continue
        prev = its[i - 1] if i else None
        key = it.value[1]
        if prev is not None and prev.kind == "cmp":
            out.append(Constraint(key, prev.value, (it.value[0],), _describe(key, prev.value, [it.text])))
            it.used = prev.used = True
            continue
        if (prev is not None and prev.kind == "between" and not grouping and i + 2 < len(its)
                and its[i + 1].kind == "conj" and its[i + 2].kind == "scale"):
            lo, hi = sorted((it.value[0], its[i + 2].value[0]))
            out.append(Constraint(key, "near", ((lo, hi),), _describe(key, "between", [it.text, its[i + 2].text])))
            prev.used = it.used = its[i + 1].used = its[i + 2].used = True
            continue
        vals, end = _values(its, i)
        out.append(_near(key, vals))
        for x in its[i:end]:
            x.used = True
    out += _outcomes(its)
    out += _config_values(its)
    for i, it in enumerate(its):                  # project P, P project, tagged T, linked runs
        if it.kind in ("project_kw", "tag_kw") and not it.used:
            # "project X" or "the X project"; a tag only after: "tagged X"
            places = [_next(its, i + 1)] + ([i - 1] if it.kind == "project_kw" else [])
            j = next((j for j in places if 0 <= j < len(its) and _name(its[j]) is not None), None)
            if j is None:
                continue
            name = _name(its[j])
            if it.kind == "project_kw":
                out.append(Constraint("project", "in", (name,), f"in project {name}"))
            else:
                out.append(Constraint("tag", "in", (name,), f"tagged {name}"))
            it.used = its[j].used = True
    for it in its:
        if it.kind == "project" and not it.used:
            out.append(Constraint("project", "in", (it.value[1],), f"in project {it.value[1]}"))
            it.used = True
    return out


DETERMINERS = {"the", "a", "an", "this", "that", "these", "those", "our", "my", "each", "every", "all", "any"}


def _name(it: Item) -> str | None:
    """The project or tag an item may name ("sweep" is a filler word, and a project too)."""
    if it.used or it.text.lower() in DETERMINERS:
        return None
    if it.kind == "project":
        return it.value[1]
    return it.text if it.kind in ("word", "filler", "run", "qty", "outcome") else None


def _near(key: str, vals: list[Item]) -> Constraint:
    rel = SCALE_BAND if key.startswith("scale.") else VALUE_BAND
    return Constraint(key, "near", tuple(_band(_number_of(v), rel) for v in vals),
                      _describe(key, "near", [v.text for v in vals]), labels=tuple(v.text for v in vals))


def _config_values(its: list[Item]) -> list[Constraint]:
    """Config values named by themselves ("rmsnorm runs", "rope and learned position embeddings"):
    values of one key joined by and/or/vs are one constraint that lists them, so a mean or a
    comparison groups by them."""
    out: list[Constraint] = []
    i = 0
    while i < len(its):
        it = its[i]
        if it.kind != "value" or it.used:
            i += 1
            continue
        key, texts, j = it.value[1], [it.value[2]], i + 1
        it.used = True
        while j < len(its):
            nxt = its[j]
            if nxt.kind == "value_noun" or (nxt.kind == "filler" and nxt.text.lower() in ("the", "a", "an")):
                nxt.used = True
            elif nxt.kind == "conj" and j + 1 < len(its) and its[j + 1].kind == "value" and its[j + 1].value[1] == key:
                nxt.used = its[j + 1].used = True
                texts.append(its[j + 1].value[2])
                j += 1
            else:
                break
            j += 1
        name = label(key)
        out.append(Constraint(key, "is", tuple(texts), f"with {name} " + " or ".join(texts), labels=tuple(texts)))
        i = j
    return out


def _outcomes(its: list[Item]) -> list[Constraint]:
    """Outcome words, negated by a not/never/without up to three items before them, and merged
    when joined by "or" ("diverged or crashed"; "did not diverge or crash" is neither)."""
    out: list[Constraint] = []
    last = None                                   # index of the previous outcome item
    for i, it in enumerate(its):
        if it.kind != "outcome" or it.used:
            continue
        negated = None
        for j in range(i - 1, max(-1, i - 4), -1):
            if its[j].kind == "neg" and not its[j].used:
                negated, its[j].used = True, True
                break
            if its[j].kind not in ("filler", "soft"):
                break
        it.used = True
        gap = its[last + 1:i] if last is not None else []
        ored = bool(gap) and all(g.kind in ("conj", "filler") for g in gap) and \
            any(g.kind == "conj" and g.text.lower() == "or" for g in gap)
        last = i
        if ored and out and out[-1].dim == "outcome" and negated in (None, out[-1].negated):
            prev = out.pop()
            for g in gap:
                g.used = True
            word = OUTCOME_WORDS[it.value][1 if prev.negated else 0].removeprefix("did not ")
            out.append(replace(prev, values=prev.values + (it.value,),
                               words=f"{prev.words} or {word}"))
            continue
        negated = bool(negated)
        words = "that " + OUTCOME_WORDS[it.value][int(negated)]
        out.append(Constraint("outcome", "in", (it.value,), words, negated))
    return out


# ---- shapes ----------------------------------------------------------------------------------

def parse(question: str, linker: Linker | None = None) -> Plan | None:
    """The plan for a standalone question, or None when it is not one of the shapes."""
    its = items(question)
    link(its, linker)
    kinds = {it.kind for it in its}
    if kinds & {"diff", "compare"} and sum(it.kind == "run" for it in its) == 2 and "qty" not in kinds:
        return _diff(its)
    where = constraints(its, grouping=bool(kinds & {"agg", "compare", "diff"}))
    runs = tuple(dict.fromkeys(it.value[1] for it in its if it.kind == "run"))
    for it in its:
        if it.kind == "run":
            it.used = True
    if runs:
        where.append(Constraint("runs", "in", runs, "among runs " + ", ".join(runs)))
    free = [it for it in its if it.kind == "qty" and not it.used]
    if "count" in kinds:
        plan = Plan("count", where=tuple(where))
        _use(its, "count")
    elif kinds & {"agg", "compare", "diff"}:     # "difference in val loss between lr 3e-4 and 1e-3"
        plan = _aggregate(its, free, where)
    elif "sup" in kinds or "top" in kinds:
        plan = _extreme(its, free, where)
    elif "wh" in kinds and len(free) == 1 and where:
        plan = Plan("values", report=(free[0].value,), where=tuple(where))
        free[0].used = True
    elif "wh" in kinds and not free and where:
        plan = Plan("runs", where=tuple(where))
    else:
        return None
    return plan if plan is not None and _all_understood(its) else None


def follow_up(question: str, previous: Plan, linker: Linker | None = None) -> Plan | None:
    """A follow-up ("and at 350M?", "what about the 1.3B runs?", "and the highest?", "and by
    warmup?") as the previous plan with what it changes: a constraint replaces the previous one
    on the same dimension, a superlative the direction, a metric the measured quantity, a
    quantity after "by" the group. None when it changes nothing the previous shape has."""
    its = items(question)
    link(its, linker)
    if {it.kind for it in its} & {"count", "diff", "config", "compare"}:
        return None
    where = constraints(its, grouping=previous.shape == "aggregate")
    runs = tuple(dict.fromkeys(it.value[1] for it in its if it.kind == "run"))
    for it in its:
        if it.kind == "run":
            it.used = True
    changes: dict[str, Any] = {}
    if previous.shape == "diff":
        if where or len(runs) != 2:
            return None                             # a diff changes only by its two runs
        changes["runs"] = runs
    elif runs:
        where.append(Constraint("runs", "in", runs, "among runs " + ", ".join(runs)))
    direction = None
    for i, it in enumerate(its):
        if it.used:
            continue
        if it.kind == "sup" and previous.shape in ("extreme", "best_config"):
            direction, it.used = it.value, True
        elif it.kind == "agg" and previous.shape == "aggregate":
            changes["aggregate"], it.used = it.value, True
        elif it.kind == "by" and previous.shape == "aggregate" and i + 1 < len(its) and its[i + 1].kind == "qty":
            changes["group"], it.used, its[i + 1].used = its[i + 1].value, True, True
        elif it.kind == "qty" and previous.shape in ("extreme", "aggregate", "best_config") and it.value.startswith("summary."):
            changes["metric"], it.used = it.value, True
        elif it.kind == "qty" and previous.shape in ("extreme", "values"):
            changes["report"], it.used = (it.value,), True     # "and which warmup?", "and the batch size?"
    if direction is not None:
        changes["lowest"] = _lowest(direction, changes.get("metric", previous.metric or DEFAULT_METRIC))
    if not where and not changes or not _all_understood(its):
        return None
    dims = {c.dim for c in where}
    merged = tuple(c for c in previous.where if c.dim not in dims) + tuple(where)
    return replace(previous, where=merged, **changes)


def _diff(its: list[Item]) -> Plan | None:
    runs = tuple(dict.fromkeys(it.value[1] for it in its if it.kind == "run"))
    if len(runs) != 2:
        return None
    for it in its:
        if it.kind in ("run", "diff", "compare", "between", "conj"):
            it.used = True
    return Plan("diff", runs=runs) if _all_understood(its) else None


def _aggregate(its: list[Item], free: list[Item], where: list[Constraint]) -> Plan | None:
    agg = next((it.value for it in its if it.kind == "agg"), "mean")
    _use(its, "agg", "compare", "diff")
    group = None
    for i, it in enumerate(its):                   # "by learning rate", "per 125M/350M"
        if it.kind == "by" and (j := _next(its, i + 1)) < len(its) and its[j].kind == "qty" and not its[j].used:
            group, it.used, its[j].used = its[j].value, True, True
            break
    metric = next((q for q in free if not q.used), None)
    if metric is None:
        metric_key = DEFAULT_METRIC
    else:
        metric_key, metric.used = metric.value, True
    if group is None:                               # "between warmup 1000 and 2000": the listed values
        listed = [c for c in where if c.op in ("near", "is") and len(c.values) > 1 and c.dim != metric_key]
        if len(listed) == 1:
            group = listed[0].dim
        elif any(c.dim == "runs" and len(c.values) > 1 for c in where):
            group = "run"                           # "compare val loss of A and B": run by run
        for it in its:
            if it.kind == "between":
                it.used = True
    return Plan("aggregate", metric=metric_key, aggregate=agg, group=group, where=tuple(where))


def _extreme(its: list[Item], free: list[Item], where: list[Constraint]) -> Plan | None:
    sup_i = next(i for i, it in enumerate(its) if it.kind in ("sup", "top"))
    sup = its[sup_i]
    direction = sup.value or "best"
    k = None
    for j in (sup_i + 1, sup_i - 1):                # "top 5", "the 3 lowest"
        if 0 <= j < len(its) and its[j].kind == "num" and not its[j].used and float(its[j].value).is_integer() \
                and 1 <= its[j].value <= MAX_K:
            k, its[j].used = int(its[j].value), True
            break
    sup.used = True
    config = next((it for it in its if it.kind == "config"), None)
    measured = None
    j = _next(its, sup_i + 1)
    if j < len(its) and its[j].kind == "qty" and not its[j].used:
        measured = its[j]
    elif (b := next((i for i, it in enumerate(its) if it.kind == "by"), None)) is not None and \
            b + 1 < len(its) and its[b + 1].kind == "qty" and not its[b + 1].used:
        measured, its[b].used = its[b + 1], True    # "top 3 runs by val loss"
    if measured is not None and direction in ("best", "worst") and not measured.value.startswith("summary."):
        measured = None                             # "the best learning rate": shown, ranked by the loss
    if measured is None and direction in ("min", "max") and config is None:
        return None                                 # "the lowest run": lowest in what?
    metric = measured.value if measured else DEFAULT_METRIC
    if measured:
        measured.used = True
    if config is not None:
        config.used = True
        for q in free:                              # "best lr/warmup/batch setup": the config shows them
            q.used = True
        return Plan("best_config", metric=metric, lowest=_lowest(direction, metric), where=tuple(where))
    report = tuple(dict.fromkeys(q.value for q in free if not q.used and q.value != metric))
    for q in free:
        q.used = True
    return Plan("extreme", metric=metric, lowest=_lowest(direction, metric), k=k or 3,
                report=report, where=tuple(where))


def _lowest(direction: str, metric: str) -> bool:
    if direction in ("min", "max"):
        return direction == "min"
    better_low = metric not in HIGHER_IS_BETTER
    return better_low if direction == "best" else not better_low


def _use(its: list[Item], *kinds: str) -> None:
    for it in its:
        if it.kind in kinds:
            it.used = True


# what may be left over: words that carry no constraint of their own ("over" also reads as the
# preposition: "mean val loss over the 125M runs")
HARMLESS = {"filler", "wh", "soft", "conj", "by", "between"}


def _all_understood(its: list[Item]) -> bool:
    return all(it.used or it.kind in HARMLESS or (it.kind == "cmp" and it.text.lower() == "over") for it in its)
