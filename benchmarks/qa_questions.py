"""Questions about the generated history (benchmarks/qa_history.py), with their answers computed
from the generated facts, never from the system under test.

    qs = make_questions(history)              # ~180 for the full plan, ~70 for "ci"
    qs = stratified(qs, 40)                   # a slice with every shape in it

Each Question has gold records (what a retriever should return, named symbolically because
note, failure and ablation ids are only known once the store assigns them; `resolve` turns them
into `kind:id` keys), and for questions with one right answer an `expect`: the run it must name,
numbers it must state, numbers it must not, words it must use. Phrasing varies the way
researchers write: val loss / validation loss / eval loss, lr / learning rate, 125M / 125m.
"""
from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass, field

from benchmarks.qa_history import MLFLOW_PROJECT, SIZES, TB_PROJECT, History
from benchmarks.qa_notes import FACT_QUESTIONS, NOTE_FACTS

QUANTITATIVE = {"lowest", "highest", "count", "mean", "diff", "best_config", "diverged_lrs", "named_run",
                "followup"}


@dataclass
class Question:
    id: str
    shape: str
    text: str
    gold: list[str] = field(default_factory=list)     # run:ID, run@PROJECT/NAME, failure:RUN, note~PHRASE, ablation:PROJECT/FACTOR
    expect: dict = field(default_factory=dict)        # run: [id, name], numbers, absent, count, mentions: [[alternatives]]
    answerable: bool = True
    history: list[str] = field(default_factory=list)  # earlier questions of the same chat

    @property
    def quantitative(self) -> bool:
        return self.shape in QUANTITATIVE

    def as_dict(self) -> dict:
        return asdict(self)


VAL = ("val loss", "validation loss", "eval loss", "val/loss")
LR = ("learning rate", "lr", "LR")
LR_WORDS = ["lr", "learning rate", "learning_rate"]
KEY_WORDS = {"lr": LR_WORDS, "warmup": ["warmup"], "batch": ["batch"], "norm": ["norm"],
             "pos": ["pos", "position", "rope", "learned"], "mix": ["mixture", "mix"],
             "seq_len": ["seq_len", "seq len", "context", "sequence"], "rope_theta": ["rope_theta", "theta"]}


class _Maker:
    def __init__(self, h: History, seed: int):
        self.h, self.rng = h, random.Random(seed)
        self.facts = [f for f in h.facts]
        self.out: list[Question] = []

    def pick(self, options):
        return self.rng.choice(list(options))

    def size_word(self, size: str) -> str:
        return self.pick((size, size.lower(), f"{size}-param"))

    def add(self, shape: str, text: str, gold=(), expect=None, answerable=True, history=()):
        self.out.append(Question(f"{shape}-{len(self.out):03d}", shape, text, list(gold), expect or {},
                                 answerable, list(history)))

    def runs(self, **where) -> list[dict]:
        def ok(f):
            return all((f.get(k) in v) if isinstance(v, (set, tuple, list)) else f.get(k) == v
                       for k, v in where.items())
        return [f for f in self.facts if ok(f)]


def _ref(f: dict) -> str:
    return f"run:{f['id']}" if f.get("id") else f"run@{f['project']}/{f['name']}"


def _names(f: dict) -> list[str]:
    return [x for x in (f.get("id"), f.get("name")) if x]


def best(rows: list[dict], key: str = "val", lowest: bool = True) -> dict | None:
    """The run with the lowest (highest) value, or None when none has one or the top two tie at
    the 4 decimals written (a question with two right answers tests nothing)."""
    have = sorted((f for f in rows if isinstance(f.get(key), (int, float))), key=lambda f: f[key],
                  reverse=not lowest)
    if not have or (len(have) > 1 and abs(have[0][key] - have[1][key]) < 1e-4):
        return None
    return have[0]


def _mean(rows: list[dict]) -> float | None:
    v = [f["val"] for f in rows if isinstance(f.get("val"), (int, float))]
    return statistics.fmean(v) if v else None


def sizes_in(m: _Maker) -> list[str]:
    return [s for s in SIZES if m.runs(size=s)]


# ---- quantitative shapes -----------------------------------------------------------------------

def lowest(m: _Maker) -> None:
    for size in sizes_in(m):
        b = best(m.runs(size=size))
        if b:
            m.add("lowest", f"Which {m.pick(LR)} gave the lowest {m.pick(VAL)} for the {m.size_word(size)} runs?",
                  [_ref(b)], {"run": _names(b), "numbers": [b["lr"]]})
            m.add("lowest", f"Which {m.size_word(size)} run reached the best {m.pick(VAL)}, and what was it?",
                  [_ref(b)], {"run": _names(b), "numbers": [b["val"]]})
        for project in ("gpt-sweep", "gpt-arch", "data-mix"):
            b = best(m.runs(size=size, project=project))
            if b:
                m.add("lowest", f"In {project}, which {m.size_word(size)} run has the lowest {m.pick(VAL)}?",
                      [_ref(b)], {"run": _names(b), "numbers": [b["val"]]})
        for lr in (3e-4, 1e-3):
            b = best(m.runs(size=size, lr=lr))
            if b:
                m.add("lowest", f"Among {m.size_word(size)} runs at {m.pick(LR)} {lr:g}, which had the lowest "
                      f"{m.pick(VAL)}?", [_ref(b)], {"run": _names(b), "numbers": [b["val"]]})
        b = best(m.runs(size=size, project="gpt-sweep", warmup=500))
        if b:
            m.add("lowest", f"Lowest {m.pick(VAL)} for {m.size_word(size)} runs in gpt-sweep with a 500-step warmup?",
                  [_ref(b)], {"run": _names(b), "numbers": [b["val"]]})
    for project in ("scaling-laws", "long-ctx", "prod-1b3", MLFLOW_PROJECT, TB_PROJECT):
        b = best(m.runs(project=project))
        if b:
            m.add("lowest", f"What is the lowest {m.pick(VAL)} in the {project} project, and which run got it?",
                  [_ref(b)], {"run": _names(b), "numbers": [b["val"]]})
    b = best(m.runs(project=TB_PROJECT))
    if b:
        m.add("lowest", f"Which warmup gave the best {m.pick(VAL)} in the {TB_PROJECT} runs?",
              [_ref(b)], {"run": _names(b), "numbers": [b["warmup"]]})


def highest(m: _Maker) -> None:
    for size in sizes_in(m):
        b = best(m.runs(size=size, project="gpt-sweep"), lowest=False)
        if b:
            m.add("highest", f"Which {m.size_word(size)} run in gpt-sweep ended with the highest {m.pick(VAL)}?",
                  [_ref(b)], {"run": _names(b), "numbers": [b["val"]]})
    for lr in (1e-4, 6e-4):
        b = best(m.runs(lr=lr), lowest=False)
        if b:
            m.add("highest", f"What was the worst {m.pick(VAL)} among runs with {m.pick(LR)} {lr:g}?",
                  [_ref(b)], {"run": _names(b), "numbers": [b["val"]]})


def count(m: _Maker) -> None:
    def ask(text: str, rows: list[dict], cite: bool = False):
        if rows:        # "how many" with none is answered by "no runs", which reads as an abstention
            m.add("count", text, [_ref(f) for f in rows] if cite else [], {"count": len(rows)})

    for size in sizes_in(m):
        ask(f"How many runs diverged at {m.size_word(size)}?", m.runs(size=size, status="diverged"))
        ask(f"How many {m.size_word(size)} runs completed?", m.runs(size=size, status="completed"))
    ask(m.pick(("How many runs ran out of memory?", "How many OOM failures did we have?")),
        m.runs(failure="oom"), cite=True)
    ask("How many runs hit an NCCL timeout?", m.runs(failure="nccl_timeout"), cite=True)
    for project in sorted({f["project"] for f in m.facts}):
        ask(f"How many runs are in the {project} project?", m.runs(project=project))
    for lr in (3e-4, 1e-3):
        ask(f"How many runs used {m.pick(LR)} {lr:g}?", m.runs(lr=lr))
    ask("How many gpt-arch runs used rmsnorm?", m.runs(project="gpt-arch", norm="rmsnorm"))
    for mix in ("web+books", "web+code+math"):
        ask(f"How many data-mix runs trained on the {mix} mixture?", m.runs(project="data-mix", mix=mix))
    ask(f"How many runs failed in {MLFLOW_PROJECT}?", m.runs(project=MLFLOW_PROJECT, status="failed"))


def mean(m: _Maker) -> None:
    def groups(text: str, project: str, field_: str, values: tuple, **where):
        rows = {v: m.runs(project=project, **{field_: v}, **where) for v in values}
        means = [_mean(r) for r in rows.values()]
        if all(x is not None for x in means):
            m.add("mean", text, expect={"numbers": means})
    groups(f"What's the mean {m.pick(VAL)} of rmsnorm vs layernorm runs in gpt-arch?", "gpt-arch", "norm",
           ("rmsnorm", "layernorm"))
    groups(f"Compare the average {m.pick(VAL)} of rope and learned position embeddings in gpt-arch.",
           "gpt-arch", "pos", ("rope", "learned"))
    for size in ("350M", "760M"):
        groups(f"Average {m.pick(VAL)} of the web vs web+books mixtures at {m.size_word(size)}?", "data-mix",
               "mix", ("web", "web+books"), size=size)
    for size in sizes_in(m):
        rows = m.runs(project="gpt-sweep", size=size, lr=SIZES[size][4])
        if _mean(rows) is not None:
            m.add("mean", f"What's the average {m.pick(VAL)} of the {m.size_word(size)} runs in gpt-sweep at "
                  f"{m.pick(LR)} {SIZES[size][4]:g}?", expect={"numbers": [_mean(rows)]})
        groups(f"Mean {m.pick(VAL)} with warmup 500 vs 2000 for {m.size_word(size)} in gpt-sweep, at "
               f"{m.pick(LR)} 1e-4?", "gpt-sweep", "warmup", (500, 2000), size=size, lr=1e-4)


DIFF_KEYS = ("lr", "warmup", "batch", "norm", "pos", "mix", "seq_len", "rope_theta")


def _differs(a: dict, b: dict) -> list[str]:
    return [k for k in DIFF_KEYS if a.get(k) != b.get(k)]


def _pairs(m: _Maker, n: int, keys: int, completed: bool) -> list[tuple[dict, dict]]:
    """Same size, project and seed, differing in exactly `keys` of DIFF_KEYS."""
    native = [f for f in m.facts if f.get("id") and f["project"] != "prod-1b3"
              and (not completed or f["status"] == "completed")]
    by = {}
    for f in native:
        by.setdefault((f["project"], f["size"], f["seed"], f["tokens"]), []).append(f)
    cands = [(a, b) for group in by.values() for a in group for b in group
             if a["id"] < b["id"] and len(_differs(a, b)) == keys]
    m.rng.shuffle(cands)
    out, seen = [], set()
    for a, b in cands:                      # spread over projects and factors
        kind = (a["project"], tuple(_differs(a, b)))
        if kind not in seen or len(seen) * 3 < len(out):
            out.append((a, b))
            seen.add(kind)
        if len(out) == n:
            break
    return out


def diff(m: _Maker, n: int) -> None:
    for i, (a, b) in enumerate(_pairs(m, n // 2, 1, False) + _pairs(m, n - n // 2, 2, False)):
        keys = _differs(a, b)
        numbers = [f[k] for k in keys for f in (a, b) if isinstance(f[k], (int, float))]
        words = [[str(f[k])] for k in keys for f in (a, b) if isinstance(f[k], str)]
        text = m.pick(("What changed between run {a} and run {b}?", "How do the configs of {a} and {b} differ?",
                       "Diff {a} vs {b}: what's different?")).format(a=a["id"], b=b["id"])
        m.add("diff", text, [_ref(a), _ref(b)],
              {"numbers": numbers, "mentions": [KEY_WORDS[k] for k in keys] + words})


def best_config(m: _Maker) -> None:
    for size in sizes_in(m):
        b = best(m.runs(size=size, project="gpt-sweep"))
        if b:
            m.add("best_config", m.pick(("What's the best config at {s} in gpt-sweep?",
                                         "Best lr/warmup/batch setup for {s} models in gpt-sweep?",
                                         "Which gpt-sweep settings work best at {s}?")).format(s=m.size_word(size)),
                  [_ref(b)], {"run": _names(b), "numbers": [b["lr"], b["warmup"]]})


def diverged_lrs(m: _Maker) -> None:
    for size in sizes_in(m):
        bad = sorted({f["lr"] for f in m.runs(size=size, status="diverged")})
        fine = sorted({f["lr"] for f in m.runs(size=size, status="completed")} - set(bad))
        if bad:
            m.add("diverged_lrs", f"Which {m.pick(LR)}s diverged at {m.size_word(size)}?",
                  [_ref(f) for f in m.runs(size=size, status="diverged")], {"numbers": bad, "absent": fine})
        for warmup in (500, 2000):
            rows = m.runs(size=size, project="gpt-sweep", warmup=warmup)
            bad = sorted({f["lr"] for f in rows if f["status"] == "diverged"})
            fine = sorted({f["lr"] for f in rows} - set(bad))
            if bad:
                m.add("diverged_lrs", f"At {m.size_word(size)}, which {m.pick(LR)}s blew up with a {warmup}-step "
                      "warmup in gpt-sweep?", [_ref(f) for f in rows if f["status"] == "diverged"],
                      {"numbers": bad, "absent": fine})


def named_run(m: _Maker, n: int) -> None:
    native = [f for f in m.facts if f.get("id")]
    m.rng.shuffle(native)
    done = 0
    for f in native:
        if done >= n:
            break
        if f["val"] is not None and done % 4 == 0:
            m.add("named_run", f"What was the final {m.pick(VAL)} of run {f['id']}?", [_ref(f)],
                  {"numbers": [f["val"]]})
        elif done % 4 == 1:
            m.add("named_run", f"What {m.pick(LR)} did {f['id']} use?", [_ref(f)], {"numbers": [f["lr"]]})
        elif done % 4 == 2:
            m.add("named_run", f"How many tokens was {f['id']} trained on?", [_ref(f)], {"numbers": [f["tokens"]]})
        elif f["status"] != "completed" and f.get("fail_step"):
            m.add("named_run", f"At what step did {f['id']} fail?", [_ref(f), f"failure:{f['id']}"],
                  {"numbers": [f["fail_step"]]})
        else:
            continue
        done += 1
    for f in m.runs(project=MLFLOW_PROJECT)[:2] + m.runs(project=TB_PROJECT)[:1]:
        m.add("named_run", f"What was the final {m.pick(VAL)} of {f['name']} in {f['project']}?", [_ref(f)],
              {"numbers": [f["val"]]})


def followups(m: _Maker) -> None:
    sizes = sizes_in(m)
    for first, then in zip(sizes, sizes[1:]):
        b = best(m.runs(size=then))
        q1 = f"Which {m.pick(LR)} gave the lowest {m.pick(VAL)} at {first}?"
        if b:
            m.add("followup", m.pick(("and at {s}?", "What about {s}?", "And for the {s} runs?")).format(s=then),
                  [_ref(b)], {"run": _names(b), "numbers": [b["lr"]]}, history=[q1])
        if m.runs(size=then, status="diverged"):
            m.add("followup", f"and how many of the {then} runs diverged?",
                  expect={"count": len(m.runs(size=then, status="diverged"))},
                  history=[f"How many runs diverged at {first}?"])


# ---- explanations, knowledge, notes ------------------------------------------------------------

def why_worse(m: _Maker, n: int) -> None:
    for a, b in _pairs(m, n, 1, True) + _pairs(m, n // 3, 2, True):
        if a["val"] > b["val"]:
            a, b = b, a
        if b["val"] - a["val"] < 0.003:
            continue            # within seed noise: there is no "why"
        keys = _differs(a, b)
        m.add("why_worse", m.pick(("Why did {b} do worse than {a}?", "Why did run {b} end up worse than run {a}?",
                                   "Why was {b} worse than {a}?")).format(a=a["id"], b=b["id"]),
              [_ref(a), _ref(b)], {"mentions": [KEY_WORDS[k] for k in keys]})


def why_diverged(m: _Maker, n: int) -> None:
    blown = [f for f in m.facts if f.get("id") and f["status"] == "diverged"]
    m.rng.shuffle(blown)
    special = [f for f in blown if f["id"] == "sw-350m-lr1e-3-wu500-b256-s0"]
    for f in special + [f for f in blown if f not in special][: n - len(special)]:
        gold = [_ref(f), f"failure:{f['id']}"]
        m.add("why_diverged", m.pick(("Why did {x} diverge?", "Why did run {x} blow up?",
                                      "What made {x} go NaN?")).format(x=f["id"]), gold,
              {"mentions": [LR_WORDS + ["nan"]]})
    for rid, kind, fact, words in (("prod-1b3-a07", "nccl_timeout", "ib_cause", ["nccl", "timeout"]),
                                   ("prod-1b3-a03", "oom", "oom_cause", ["memory", "oom"])):
        if rid in m.h.by_id():
            m.add("why_failed", f"Why did {rid} fail?", [f"run:{rid}", f"failure:{rid}", f"note~{NOTE_FACTS[fact]}"],
                  {"mentions": [words]})


KNOW = [("rmsnorm", "What do we know about rmsnorm vs layernorm?", ["ablation:gpt-arch/config.model.norm",
                                                                    "note~rms_speed"]),
        ("warmup", "What have we learned about warmup length?", ["ablation:gpt-sweep/config.optim.warmup_steps",
                                                                 "note~warmup_owner"]),
        ("mixture", "What do we know about the data mixture?", ["ablation:data-mix/config.data.mixture",
                                                                "note~code_share"]),
        ("rope_theta", "Summarize what we know about rope_theta for long context.",
         ["ablation:long-ctx/config.model.rope_theta", "note~rope_base"]),
        ("batch", "What do we know about batch size 256 vs 512?", ["ablation:gpt-sweep/config.data.batch_size"]),
        ("pos", "What have we learned about learned vs rotary position embeddings?",
         ["ablation:gpt-arch/config.model.pos"]),
        ("nccl", "What do we know about the NCCL timeouts?", ["failures:nccl_timeout", "note~ib_cause"]),
        ("oom", "What do we know about the OOMs at 1.3B?", ["failures:oom", "note~oom_cause", "note~oom_fit"])]


def know(m: _Maker) -> None:
    for _, text, gold in KNOW:
        refs = []
        for g in gold:
            if g.startswith("note~"):
                if any(NOTE_FACTS[g[5:]] in t for t in m.h.notes.values()):
                    refs.append(f"note~{NOTE_FACTS[g[5:]]}")
            elif g.startswith("failures:"):
                refs += [f"failure:{f['id']}" for f in m.runs(failure=g.split(":")[1])]
            elif m.runs(project=g.split(":")[1].split("/")[0]):
                refs.append(g)
        if refs:
            m.add("know", text, refs)


def note_facts(m: _Maker) -> None:
    notes = " ".join(m.h.notes.values())
    for key, (text, expect) in FACT_QUESTIONS.items():
        if NOTE_FACTS[key] in " ".join(notes.split()):
            m.add("note_fact", text, [f"note~{NOTE_FACTS[key]}"], expect)


UNANSWERABLE = [
    "What val loss did the 13B model reach?",
    "Which learning rate worked best for the 7B runs?",
    "How did the Lion optimizer compare with AdamW?",
    "What was the MMLU score of the best 1.3B run?",
    "Why did the mixture-of-experts run collapse its router?",
    "What HellaSwag accuracy did our 350M model get?",
    "Which runs were trained in FP8?",
    "What did the RLHF reward model ablation show?",
    "How long did the tokenizer take to train on TPU v5?",
    "What happened in the vision-transformer project?",
    "Which runs used the Sophia optimizer?",
    "What's the best dropout for the 2.7B model?",
    "Why was the speech model's word error rate so high?",
    "Which runs were trained on the Japanese web crawl?",
    "What throughput in tokens per second did the 760M runs get?",
    "Did muP transfer work for our width sweep?",
    "What was the result of the 30B dense run?",
    "How did DPO fine-tuning affect toxicity?",
    "Which model had the best HumanEval pass@1?",
    "What did we learn from the BLOOM replication in 2023?",
    "What was the validation loss of run gpt-13b-final?",
    "Why did run sw-2.7b-lr3e-4-s0 diverge?",
    "How many GPUs did the diffusion model use?",
    "What was the KL penalty in our PPO runs?",
]


def unanswerable(m: _Maker) -> None:
    for text in UNANSWERABLE:
        m.add("unanswerable", text, answerable=False)


def make_questions(h: History, seed: int = 0) -> list[Question]:
    m = _Maker(h, seed)
    full = h.plan == "full"
    lowest(m)
    highest(m)
    count(m)
    mean(m)
    diff(m, 12 if full else 6)
    best_config(m)
    diverged_lrs(m)
    named_run(m, 16 if full else 8)
    followups(m)
    why_worse(m, 10 if full else 5)
    why_diverged(m, 8 if full else 4)
    know(m)
    note_facts(m)
    unanswerable(m)
    return m.out


def stratified(questions: list[Question], n: int, seed: int = 0) -> list[Question]:
    """About n questions with every shape represented in proportion (at least 2 each)."""
    if n >= len(questions):
        return list(questions)
    rng = random.Random(seed)
    by: dict[str, list[Question]] = {}
    for q in questions:
        by.setdefault(q.shape, []).append(q)
    out = []
    for shape, qs in by.items():
        take = max(2, round(n * len(qs) / len(questions)))
        out += rng.sample(qs, min(take, len(qs)))
    return sorted(out, key=lambda q: q.id)


def from_dicts(rows: list[dict]) -> list[Question]:
    return [Question(**r) for r in rows]
