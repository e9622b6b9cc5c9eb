"""A Plan as one SQL statement over the store's tables (run, runfield, failure, anomaly).

Values are read from the typed RunField rows by their canonical keys (`summary.val/loss`,
`hparams.lr`, `scale.params`), which every source's runs answer to whatever they logged
(kb.vocab), and only numbers count (vtype 'n': a NaN loss is stored as text and ranks nowhere).
Each statement is written to be read: the answer shows it, rendered with its literals
(agents.sql.render), and it runs again as printed.
"""
from __future__ import annotations

from sqlalchemy import and_, case, func, not_, or_, select
from sqlalchemy.sql import Select

from agents.planner_parse import Constraint, Plan
from agents.planner_words import OUTCOMES
from kb.fields import canonical
from kb.models import Anomaly, Failure, Run, RunField
from kb.query_sql import codepoint, unordered

run, field, failure, anomaly = Run.__table__, RunField.__table__, Failure.__table__, Anomaly.__table__

LIST_LIMIT = 10          # runs named in a count or a list: the count itself covers them all
GROUP_MEMBERS = 5        # runs cited per group of an aggregate (the best few; the mean covers all)
DIFF_NAMESPACES = ("config", "scale", "tags")


def statement(plan: Plan) -> Select:
    return BUILDERS[plan.shape](plan)


# ---- filters ---------------------------------------------------------------------------------

def condition(c: Constraint):
    """One constraint as a test on the run row: a run without the key matches none, and a
    negated one (`did not diverge`) is plain negation."""
    if c.dim == "project":
        cond = run.c.project.in_(c.values)
    elif c.dim == "runs":
        cond = run.c.id.in_(c.values)
    elif c.dim == "tag":
        cond = run.c.id.in_(select(field.c.run_id).where(
            field.c.key.in_([canonical(("tags", t)) for t in c.values]), field.c.vtype == "b", field.c.num == 1.0))
    elif c.dim == "outcome":
        statuses = sorted({s for o in c.values for s in OUTCOMES[o][0]})
        failures = sorted({f for o in c.values for f in OUTCOMES[o][1]})
        anomalies = sorted({a for o in c.values for a in OUTCOMES[o][2]})
        parts = [run.c.status.in_(statuses)] if statuses else []
        if failures:
            parts.append(run.c.id.in_(select(failure.c.run_id).where(failure.c.kind.in_(failures))))
        if anomalies:
            parts.append(run.c.id.in_(select(anomaly.c.run_id).where(anomaly.c.kind.in_(anomalies))))
        cond = or_(*parts)
    else:
        cond = run.c.id.in_(select(field.c.run_id).where(field.c.key == c.dim, _test(field, c)))
    return not_(cond) if c.negated else cond


def _from(plan: Plan, reads: list[tuple] = (), optional: list[tuple] = ()) -> tuple:
    """(FROM clause, WHERE tests), written in the order a reader follows: the rows of the
    question's numeric constraints (`scale.params BETWEEN ...`: an index range, usually the
    narrowest set), then the run, then the rows the answer reads (`reads`: (alias, key)
    pairs, inner joins) and those it shows when present (`optional`).

    Joins on (key, run_id), RunField's primary key, so none repeats a run, rather than
    `run.id IN (...)`: with IN and an ORDER BY an index could serve, Postgres (whose statistics
    on `num` mix every key's values, so a band of one key looks like a few rows) walked the
    metric's index and compared each row with every constraint row: 8.8 s at 10,000 runs,
    where joins and an ORDER BY no index serves (`unordered`) take ~0.2 s."""
    tests, scoped = [], []
    for i, c in enumerate(plan.where, 1):
        if c.dim in ("project", "runs", "tag", "outcome") or c.negated:
            tests.append(condition(c))
        else:
            scoped.append((field.alias(f"test{i}"), c))
    if scoped:
        first, c = scoped[0]
        source = first.join(run, run.c.id == first.c.run_id)
        tests = [first.c.key == c.dim, _test(first, c)] + tests
        for alias, c in scoped[1:]:
            source = source.join(alias, and_(alias.c.run_id == run.c.id, alias.c.key == c.dim, _test(alias, c)))
    else:
        source = run
    for alias, key, *vtype in reads:
        source = source.join(alias, _on(alias, key, *vtype))
    for alias, key in optional:
        source = source.outerjoin(alias, _on(alias, key))
    return source, tests


def _test(f, c: Constraint):
    """The row's value passes the constraint: a number in a band or past a bound, or (`is`) one
    of the listed strings."""
    if c.op == "is":
        return and_(f.c.vtype == "s", f.c.text.in_(c.values))
    if c.op == "near":
        test = or_(*(f.c.num.between(lo, hi) for lo, hi in c.values))
    else:
        test = {"<": f.c.num < c.values[0], "<=": f.c.num <= c.values[0],
                ">": f.c.num > c.values[0], ">=": f.c.num >= c.values[0]}[c.op]
    return and_(f.c.vtype == "n", test)


def _on(alias, key: str, vtype: str = "n"):
    """The join to the run's RunField row holding a number (or `vtype`) for key."""
    return and_(alias.c.run_id == run.c.id, alias.c.key == key, alias.c.vtype == vtype)


# ---- shapes ----------------------------------------------------------------------------------

def extreme(plan: Plan) -> Select:
    """The k runs at one end of the metric, with the reported keys and how many runs competed."""
    metric = field.alias("metric")
    reports = [(field.alias(f"report{i}"), key) for i, key in enumerate(plan.report, 1)]
    cols = [run.c.id.label("run_id"), run.c.name, run.c.project, metric.c.num.label(plan.metric)]
    cols += [alias.c.num.label(key) for alias, key in reports]
    source, tests = _from(plan, [(metric, plan.metric)], reports)
    order = unordered(metric.c.num).asc() if plan.lowest else unordered(metric.c.num).desc()
    return (select(*cols, func.count().over().label("candidates")).select_from(source)
            .where(*tests).order_by(order, codepoint(run.c.id)).limit(plan.k))


def count(plan: Plan) -> Select:
    """How many runs match, and the first few of them by id."""
    source, tests = _from(plan)
    return (select(run.c.id.label("run_id"), run.c.name, run.c.project, run.c.status,
                   func.count().over().label("runs"))
            .select_from(source).where(*tests).order_by(codepoint(run.c.id)).limit(LIST_LIMIT))


def values(plan: Plan) -> Select:
    """Each matching run's value of the reported key (which learning rates diverged), with the
    step of the first failure that made it match, when an outcome is asked about."""
    key = plan.report[0]
    value = field.alias("value")
    cols = [value.c.num.label(key), run.c.id.label("run_id"), run.c.name, run.c.status]
    kinds = sorted({f for c in plan.where if c.dim == "outcome" and not c.negated
                    for o in c.values for f in OUTCOMES[o][1]})
    if kinds:
        cols.append(select(func.min(failure.c.step)).where(failure.c.run_id == run.c.id, failure.c.kind.in_(kinds))
                    .scalar_subquery().label("failure_step"))
    source, tests = _from(plan, [(value, key)])
    return select(*cols).select_from(source).where(*tests).order_by(unordered(value.c.num), codepoint(run.c.id))


def aggregate(plan: Plan) -> Select:
    """Mean (or median) of the metric per group, each group's size, and its best few runs.

    One statement with window functions, so the numbers and the runs they cite come back
    together: `members` is every matching run's value, `ranked` adds its group's size, mean
    and its rank in the group, and the median is the mean of the middle one or two ranks
    (2·rank within [n, n + 2]: no integer division, which the two databases spell apart)."""
    metric = field.alias("metric")
    cols, reads = [run.c.id.label("run_id"), run.c.name], [(metric, plan.metric)]
    if plan.group and plan.group != "run":
        grp = field.alias("grp")
        textual = any(c.dim == plan.group and c.op == "is" for c in plan.where)
        reads.append((grp, plan.group, "s") if textual else (grp, plan.group))
        cols.append((grp.c.text if textual else grp.c.num).label(plan.group))
        listed = next((c for c in plan.where if c.dim == plan.group and c.op == "near" and len(c.labels) > 1), None)
        if listed:
            # values the question listed ("between 125M and 350M", "warmup 1000 and 2000") group
            # by their band, named as written: a 123.6M and a 124.4M run are both "125M"
            cols.append(case(*((grp.c.num.between(lo, hi), label) for (lo, hi), label in zip(listed.values, listed.labels)))
                        .label("group"))
    source, tests = _from(plan, reads)
    members = select(*cols, metric.c.num.label(plan.metric)).select_from(source).where(*tests).cte("members")
    value = members.c[plan.metric]
    by = "run_id" if plan.group == "run" else "group" if "group" in members.c else plan.group
    part = [members.c[by]] if plan.group else []
    ranked = select(members, func.count().over(partition_by=part).label("runs"),
                    func.avg(value).over(partition_by=part).label("mean"),
                    func.row_number().over(partition_by=part, order_by=[value, codepoint(members.c.run_id)])
                    .label("rank")).cte("ranked")
    stats = ranked
    if plan.aggregate == "median":
        middle = and_(ranked.c.rank * 2 >= ranked.c.runs, ranked.c.rank * 2 <= ranked.c.runs + 2)
        stats = select(ranked, func.avg(case((middle, ranked.c[plan.metric]))).over(
            partition_by=[ranked.c[c.name] for c in part]).label("median")).cte("stats")
    order = [stats.c[c.name] for c in part] + [stats.c.rank]
    return select(stats).where(stats.c.rank <= GROUP_MEMBERS).order_by(*order)


def diff(plan: Plan) -> Select:
    """The config, scale and tag keys on which two runs differ, each run's value side by side."""
    a, b = plan.runs

    def side(run_id: str, col):
        return func.max(case((field.c.run_id == run_id, col)))

    within = or_(*(and_(codepoint(field.c.key) >= f"{ns}.", codepoint(field.c.key) < f"{ns}/")
                   for ns in DIFF_NAMESPACES))
    # a key differs when one run lacks it or the two rows disagree; NULL <> NULL is never true,
    # so two equal rows (or two nulls) drop out
    differs = or_(func.count() < 2, func.min(field.c.vtype) != func.max(field.c.vtype),
                  func.min(field.c.num) != func.max(field.c.num), func.min(field.c.text) != func.max(field.c.text))
    return (select(field.c.key,
                   side(a, field.c.vtype).label("a_vtype"), side(a, field.c.num).label("a_num"),
                   side(a, field.c.text).label("a_text"),
                   side(b, field.c.vtype).label("b_vtype"), side(b, field.c.num).label("b_num"),
                   side(b, field.c.text).label("b_text"))
            .where(field.c.run_id.in_((a, b)), within)
            .group_by(field.c.key).having(differs).order_by(codepoint(field.c.key)))


def best_config(plan: Plan) -> Select:
    """The best run by the metric and every config leaf it logged."""
    metric = field.alias("metric")
    order = unordered(metric.c.num).asc() if plan.lowest else unordered(metric.c.num).desc()
    source, tests = _from(plan, [(metric, plan.metric)])
    best = (select(run.c.id.label("run_id"), run.c.name, metric.c.num.label(plan.metric),
                   func.count().over().label("candidates"))
            .select_from(source).where(*tests)
            .order_by(order, codepoint(run.c.id)).limit(1).cte("best"))
    leaf = and_(field.c.run_id == best.c.run_id, codepoint(field.c.key) >= "config.",
                codepoint(field.c.key) < "config/")
    return (select(best, field.c.key, field.c.vtype, field.c.num, field.c.text)
            .select_from(best.outerjoin(field, leaf)).order_by(codepoint(field.c.key)))


BUILDERS = {"extreme": extreme, "count": count, "runs": count, "values": values, "aggregate": aggregate,
            "diff": diff, "best_config": best_config}
