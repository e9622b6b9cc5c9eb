"""Ablations found in the runs themselves: within a project, runs whose configs differ in exactly
one key (seeds aside), or that share an `ablation:<factor>` tag, form an Ablation with a factor,
a baseline, variants and their effect on the final metric.

Runs that differ only in their seed are one configuration measured several times: their
spread is the noise floor, and each effect says whether it clears it (|delta| > 2 sigma,
sigma the pooled seed standard deviation).

Configurations that differ in one key `k` are those equal once `k` is left out: they share a
*bucket* (the config without `k`; one without `k` at all sits in the bucket of its whole
config). A bucket is named by a 64-bit sum of hashes of its (key, value) items, so leaving a
key out is one subtraction: finding every bucket costs time linear in the config, and a new
run finds the runs it forms ablations with by looking its buckets up (kb.ablation_store).
A sum can collide, so membership is always confirmed on the configs themselves.
"""
from __future__ import annotations

import hashlib
import json
import math
import statistics
from collections import defaultdict
from functools import lru_cache
from json.encoder import encode_basestring_ascii

from kb.fields import canonical
from kb.models import utcnow

SEED_KEYS = {"seed", "data_seed", "random_seed", "init_seed", "shuffle_seed"}
METRICS = ("val/loss", "val_loss", "eval/loss", "eval_loss", "valid/loss", "loss", "train/loss", "train_loss")
MISSING = "<missing>"
TAG = "ablation:"
_MOD = 1 << 64


def _signature(config: dict) -> dict[str, str]:
    """Config leaves (seeds left out) as canonical key -> JSON text, so values compare exactly.
    `kb.fields.leaves`' walk, appending as it goes (a refresh signs every run it reads); the
    same lines as `kb.fields.field_tuples`' walk, kept apart: a shared walk calling back per
    leaf made the writer's field rows a third slower."""
    sig: dict[str, str] = {}

    def walk(value, path: tuple[str, ...]) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, path + (str(k),))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, path + (str(i),))
        elif path and path[-1] not in SEED_KEYS:
            sig[_canonical(path)] = _json_text(value)
    walk(config, ())
    return sig


_canonical = lru_cache(maxsize=1 << 16)(canonical)    # the same paths in every run of a project


def _json_text(v) -> str:
    """json.dumps(v) for a JSON leaf, without the encoder's set-up (a project has ~20 per run)."""
    if v is None or v is True or v is False:
        return "null" if v is None else "true" if v else "false"
    if type(v) is str:
        return encode_basestring_ascii(v)
    if type(v) is int or (type(v) is float and math.isfinite(v)):
        return repr(v)
    return json.dumps(v, sort_keys=True)


def _hash(tag: bytes, text: str) -> int:
    # surrogatepass: a key may hold a lone surrogate (values are ASCII JSON text already)
    return int.from_bytes(hashlib.blake2b(tag + text.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                          "little")


@lru_cache(maxsize=1 << 16)       # a sweep's runs share most (key, value) items
def _item_hash(key: str, value: str) -> int:
    return _hash(b"k", f"{key}\x00{value}")      # value is JSON text: no NUL, so the split is unique


def signed(h: int) -> int:
    """A 64-bit hash as SQL's BIGINT holds it."""
    return h - _MOD if h >= 1 << 63 else h


Parts = tuple[dict, dict, int]      # a run's signature, its items' hashes and their sum


def parts_of(project: str, config: dict) -> Parts:
    sig = _signature(config)
    items = {k: _item_hash(k, v) for k, v in sig.items()}
    return sig, items, (_hash(b"p", project) + sum(items.values())) % _MOD


class Config:
    """Runs with one configuration: several seeds of it, or one; with the hashes naming its buckets."""

    def __init__(self, parts: Parts, runs: list):
        self.sig, self.items, self.total = parts
        self.runs = sorted(runs, key=lambda r: r.id)

    def bucket(self, key: str) -> int:
        """The bucket this config shares with those that differ from it in `key` alone."""
        h = self.items.get(key)
        return self.total if h is None else (self.total - h) % _MOD

    def values(self, metric: str) -> list[float]:
        return [float(r.summary[metric]) for r in self.runs if isinstance(r.summary.get(metric), (int, float))]

    def mean(self, metric: str) -> float | None:
        v = self.values(metric)
        # each term scaled first: fmean's sum overflows for losses near the float limit
        return math.fsum(x / len(v) for x in v) if v else None


def group_runs(project: str, runs: list, known: dict[str, Parts] | None = None) -> list[Config]:
    """Runs grouped by configuration (exactly equal signatures), in first-seen order. `known`
    keeps each run's parts (run id -> Parts) for the next call, so a config is hashed once."""
    known = {} if known is None else known
    by_total: dict[int, list[Config]] = defaultdict(list)
    out = []
    for r in runs:
        parts = known.get(r.id)
        if parts is None:
            parts = known[r.id] = parts_of(project, r.config)
        same = next((c for c in by_total[parts[2]] if c.sig is parts[0] or c.sig == parts[0]), None)
        if same is None:
            same = Config(parts, [])
            by_total[parts[2]].append(same)
            out.append(same)
        same.runs.append(r)
    for c in out:
        c.runs.sort(key=lambda r: r.id)
    return out


def _metric(runs: list) -> str | None:
    """The first of METRICS that any run reports (a diverged variant has no final, and says so)."""
    for m in METRICS:
        if any(isinstance(r.summary.get(m), (int, float)) for r in runs):
            return m
    return None


def _baseline(groups: list[Config]) -> Config:
    members = {r.id for g in groups for r in g.runs}

    def rank(g: Config):
        tagged = any("baseline" in r.tags for r in g.runs)
        is_parent = any(r.parent in {x.id for x in g.runs} for o in groups for r in o.runs if r.parent in members)
        first = min((r.started_at.isoformat() if r.started_at else "", r.id) for r in g.runs)
        return (not tagged, not is_parent, first)
    return min(groups, key=rank)


def pooled_sd(groups: list[Config], metric: str) -> tuple[float | None, int]:
    """(pooled seed standard deviation, its degrees of freedom) over the groups with two or more
    values of `metric`; (None, 0) when no group has. kb.verdicts tests effects against it."""
    ss, dof = 0.0, 0
    for g in groups:
        v = g.values(metric)
        if len(v) >= 2:
            ss += _variance(v) * (len(v) - 1)
            dof += len(v) - 1
    return ((ss / dof) ** 0.5 if dof else None), dof


def _variance(v: list[float]) -> float:
    # statistics.variance is exact (fractions), and converting a spread past the float limit back
    # raised OverflowError inside the ablation refresh, failing that ingest and every one after
    # (fuzzing found seeds at 1e279)
    try:
        return statistics.variance(v)
    except OverflowError:
        return math.inf


def _pooled_sigma(groups: list[Config], metric: str) -> float | None:
    return pooled_sd(groups, metric)[0]


def _build(project: str, factor: str, groups: list[Config], key: str | None, twin: bool = False) -> dict:
    """One Ablation row as a dict of its columns (constructing the ORM object cost more than
    finding the ablation). `key` is the config key that varies; None for a tag ablation.

    Its id names what it is, not whom it holds: the project, factor and bucket (the configs it
    compares, all but `key`), so a hypothesis, report or answer that cites it still finds it when
    one more seed or variant lands (an id of the members changed with every run that joined).
    `twin`: another ablation shares the bucket (two sums of key hashes met), told apart by members."""
    # one order, whatever order the groups were found in: sigma's float sum comes out the same
    groups = sorted(groups, key=lambda g: g.runs[0].id)
    runs = [r for g in groups for r in g.runs]
    metric = _metric(runs)
    base = _baseline(groups)
    sigma = _finite(_pooled_sigma(groups, metric)) if metric else None
    base_mean = base.mean(metric) if metric else None
    variants = []
    for g in groups:
        value = json.loads(g.sig[key]) if key and key in g.sig else (MISSING if key else None)
        if key is None:     # tag ablation: the value is whatever differs from the baseline
            value = {k: json.loads(v) for k, v in g.sig.items() if base.sig.get(k) != v} or "baseline"
        mean = g.mean(metric) if metric else None
        delta = _finite(mean - base_mean) if mean is not None and base_mean is not None else None
        variants.append({"runs": [r.id for r in g.runs], "run": g.runs[0].id, "value": value,
                         "metric": mean, "seeds": len(g.runs), "delta": delta,
                         "exceeds_seed_spread": (abs(delta) > 2 * sigma) if delta is not None and sigma else None,
                         "baseline": g is base})
    variants.sort(key=lambda v: (not v["baseline"], json.dumps(v["value"], sort_keys=True, default=str)))
    members = sorted(r.id for r in runs)
    bucket = signed(groups[0].bucket(key)) if key is not None else None
    identity = [project, factor, bucket] + ([members] if twin else [])
    name = hashlib.sha1(json.dumps(identity).encode()).hexdigest()[:10]
    digest = hashlib.sha1(json.dumps([factor, members]).encode()).hexdigest()[:10]
    return dict(id=f"abl-{factor}-{name}", project=project, factor=factor, metric=metric or "",
                baseline_run=base.runs[0].id, variants=variants,
                effect={"seed_sigma": sigma, "baseline_metric": base_mean,
                        "best": min((v for v in variants if v["metric"] is not None),
                                    key=lambda v: v["metric"], default={}).get("run")},
                source_kind="derived", source_uri=f"project:{project}", content_hash=digest,
                ingested_at=utcnow(), bucket=bucket)


def _finite(x: float | None) -> float | None:
    """x, or None past the float limit (a spread or difference of losses near it): JSON has no
    infinity, and Postgres refuses one where SQLite would store it."""
    return x if x is None or math.isfinite(x) else None


def _same_but(a: Config, b: Config, key: str) -> bool:
    """a and b agree on every key but `key` (which either may lack)."""
    if len(a.sig) - (key in a.sig) != len(b.sig) - (key in b.sig):
        return False
    other = b.sig
    return all(k == key or other.get(k) == v for k, v in a.sig.items())


def bucket_ablations(project: str, key: str, bucket: int, configs: list[Config]) -> list[dict]:
    """The ablations of `key` among configs found in one bucket: those really in it (a hash names
    it, the configs confirm it), grouped by what they share, each group of two or more with `key`
    somewhere an ablation (a collision of sums is the only way to more than one)."""
    inside = [c for c in configs if c.bucket(key) == bucket % _MOD]
    classes: list[list[Config]] = []
    for c in inside:
        home = next((cl for cl in classes if _same_but(cl[0], c, key)), None)
        if home is None:
            classes.append([c])
        else:
            home.append(c)
    found = [cl for cl in classes if len(cl) >= 2 and any(key in c.sig for c in cl)]
    return [_build(project, f"config.{key}", cl, key, twin=len(found) > 1) for cl in found]


def tagged_factors(tags: list) -> list[str]:
    """The factors a run's `ablation:<factor>` tags name (one per tag, repeats kept)."""
    return [t[len(TAG):] for t in tags if isinstance(t, str) and t.startswith(TAG) and len(t) > len(TAG)]


def tag_ablation(project: str, factor: str, runs: list, configs: dict[str, Config],
                 covered: set[tuple]) -> dict | None:
    """The ablation of the runs tagged `ablation:<factor>` (`runs`, repeated once per such tag),
    unless it has one config only, or a config ablation of that name already holds exactly them
    (`covered`: (name, sorted run ids) of the config ablations)."""
    distinct = list(dict.fromkeys(id(configs[r.id]) for r in runs))      # first-seen order
    if len(distinct) < 2 or (factor, tuple(sorted(r.id for r in runs))) in covered:
        return None
    by_id = {id(configs[r.id]): configs[r.id] for r in runs}
    sub = [_TagGroup(by_id[i], [r for r in runs if id(configs[r.id]) == i]) for i in distinct]
    return _build(project, factor, sub, None)


class _TagGroup(Config):
    """A config's tagged runs only (a tag ablation holds the runs that carry the tag)."""

    def __init__(self, config: Config, runs: list):
        super().__init__((config.sig, config.items, config.total), runs)


def name_of(factor: str) -> str:
    """The name an ablation is queried by: `ablations.<name>.role` (a config key's last segment)."""
    return factor.rsplit(".", 1)[-1] if factor.startswith("config.") else factor


def covered_by(ablation: dict) -> tuple:
    """(name, member ids) of a config ablation: a tag of that name on exactly those runs adds nothing."""
    return (ablation["factor"].rsplit(".", 1)[-1], tuple(sorted(x for v in ablation["variants"] for x in v["runs"])))


def find_ablations(project: str, runs: list, known: dict[str, Parts] | None = None) -> list[dict]:
    """The project's ablations as Ablation rows (dicts of its columns), config ablations first,
    each kind by factor: the order in which `run_fields` lets a later one win a name."""
    configs = group_runs(project, runs, known)
    buckets: dict[tuple[int, str], list[Config]] = defaultdict(list)
    whole: dict[int, list[Config]] = defaultdict(list)
    for c in configs:
        whole[c.total].append(c)
        for k in c.sig:
            buckets[(c.bucket(k), k)].append(c)
    found = []
    for (b, k), having in buckets.items():
        lacking = [c for c in whole.get(b, ()) if k not in c.sig]
        if len(having) + len(lacking) >= 2:
            found += bucket_ablations(project, k, b, having + lacking)
    found.sort(key=lambda a: (a["factor"], a["id"]))
    covered = {covered_by(a) for a in found}
    config_of = {r.id: c for c in configs for r in c.runs}
    tagged: dict[str, list] = defaultdict(list)
    for r in runs:
        for f in tagged_factors(r.tags):
            tagged[f].append(r)
    ids = {a["id"] for a in found}
    for factor, rs in sorted(tagged.items()):
        a = tag_ablation(project, factor, rs, config_of, covered)
        if a is not None and a["id"] not in ids:        # a tag `ablation:config.x` on a config ablation
            found.append(a)
    return found


def precedence(ablation: dict) -> tuple:
    """Config ablations before tag ablations, each by factor: where two share a name, the later wins."""
    return (ablation["bucket"] is None, ablation["factor"], ablation["id"])


RUN_FIELDS = ("role", "id", "delta", "exceeds_seed_spread")     # a member's fields of each ablation name


def run_fields(ablations: list[dict]) -> dict[str, dict]:
    """Each member run's `ablations.<name>` fields: {run id: {name: {role, id, delta, exceeds_seed_spread}}}."""
    per_run: dict[str, dict] = defaultdict(dict)
    for a in sorted(ablations, key=precedence):
        name = name_of(a["factor"])
        for v in a["variants"]:
            for rid in v["runs"]:
                per_run[rid][name] = {"role": "baseline" if v["baseline"] else "variant", "id": a["id"],
                                      "delta": v["delta"], "exceeds_seed_spread": v["exceeds_seed_spread"]}
    return per_run
