"""Ablations kept in SQL as runs come and change, at a cost that follows the change, not the project.

A run write queues the run (`queue_runs`, in the run's own transaction, so a crash loses nothing).
`refresh` takes the queue and recomputes only the buckets (kb.ablations) the queued runs were in,
through their ablations, and are in now, found by looking their bucket hashes up:

    1. each queued run's buckets rewritten (AblationSig): its whole config and one per key
    2. buckets to redo: those of a queued run that hold another config, and those of its old
       ablations; tags to redo: its tags, and the names of the config ablations it touched
    3. the runs in those buckets and tags read, grouped into configs, their ablations found
    4. old ablations replaced by the new (Ablation, AblationRun), and every run whose
       ablations changed gets its `ablations.*` fields written again from all it is in now

Writers never wait on each other's refresh inside their own transaction: the refresh runs after
their runs commit, one at a time (a Postgres advisory lock, SQLite's write lock), and reads
the queue only once it holds the lock, so the last refresh sees every run committed before it.
The result equals a recomputation from scratch (`rebuild`; tests/test_concurrency.py), which is
also what a project mostly made of queued runs gets (a bulk load of a new project): cheaper there.
"""
from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

from sqlalchemy import and_, delete, func, insert, select, text, union, update
from sqlalchemy.engine import Connection, Engine

from kb.ablations import (RUN_FIELDS, TAG, Config, bucket_ablations, covered_by, find_ablations, group_runs, name_of,
                          run_fields, signed, tag_ablation, tagged_factors)
from kb.db import bulk_insert, chunked, insert_dicts
from kb.fields import FIELD_COLUMNS, canonical, field_tuples
from kb.indexer import queue_refs
from kb.models import Ablation, AblationPending, AblationRun, AblationSig, Run, RunField
from kb.query_sql import codepoint

# a run's `ablations.*` fields by code-point key range, which the (key, run_id) primary key
# serves (LIKE is case-blind on SQLite, so no index can)
ABLATION_FIELDS = and_(codepoint(RunField.key) >= "ablations.", codepoint(RunField.key) < "ablations/")
LOCK_KEY = 7243002          # Postgres advisory lock of the refresh (7243001 guards migrations)
REFRESH_BATCH = 500         # queued runs per refresh transaction (~1 s: 2 ms a run at 10,000 runs)
WHOLE_REBUILD_MAX = 5000    # runs in a project rebuilt whole in one transaction (~0.7 ms a run)
THREADED_REBUILD_MIN = 500  # runs from which a rebuild writes its bucket rows from a thread (at 100
                            # runs the thread cost SQLite more than it saved; at 500, 10% less: ingest_cpu.py)

_RUNS = Run.__table__
_ABL = Ablation.__table__
_SIG = AblationSig.__table__
_MEMBER = AblationRun.__table__
_QUEUE = AblationPending.__table__
_READ = (_RUNS.c.id, _RUNS.c.project, _RUNS.c.config, _RUNS.c.summary, _RUNS.c.tags, _RUNS.c.parent,
         _RUNS.c.started_at)
_FIELD_READ = tuple(RunField.__table__.c[c] for c in FIELD_COLUMNS)
_ABL_READ = (_ABL.c.id, _ABL.c.project, _ABL.c.factor, _ABL.c.bucket, _ABL.c.variants)


def queue_runs(conn: Connection, run_ids: list[str]) -> None:
    """Mark runs' ablations for the next refresh (call it in the transaction that writes the runs)."""
    if run_ids:
        conn.execute(insert(_QUEUE), [{"run_id": r, "project": None} for r in run_ids])


def queue_project(conn: Connection, project: str) -> None:
    """Mark a whole project for recomputation from scratch at the next refresh."""
    conn.execute(insert(_QUEUE), {"run_id": None, "project": project})


def refresh_all(engine: Engine, bulk: bool = False) -> int:
    """`refresh` in transactions of REFRESH_BATCH queued entries until the queue is empty (a bulk
    load's refresh holds SQLite's write lock about a second at a time, as its writes did).
    `bulk` (the end of KnowledgeBase.bulk): a mostly queued project is rebuilt whole whatever its
    size, each in a transaction of its own."""
    total = 0
    while True:
        with engine.begin() as conn:
            taken = refresh(conn, REFRESH_BATCH, bulk)
        total += taken
        # uncapped, a call may take one project's entries only: the queue is drained to the end
        if taken == 0 or (taken < REFRESH_BATCH and not bulk):
            return total


def refresh(conn: Connection, limit: int | None = None, bulk: bool = False) -> int:
    """Bring ablations up to date with the runs queued so far, the first `limit` entries of the
    queue when given; returns the entries taken. In the caller's transaction, for it to commit.
    Projects mostly queued are rebuilt whole: up to WHOLE_REBUILD_MAX runs, or with `bulk` any
    size, one project a call (a rebuild of a big project is a transaction of its own)."""
    if conn.execute(select(_QUEUE.c.id).limit(1)).first() is None:
        return 0                    # nothing queued: no lock taken (another writer may hold it)
    lock_refresh(conn)
    stmt = select(_QUEUE.c.id, _QUEUE.c.run_id, _QUEUE.c.project).order_by(_QUEUE.c.id)
    queued = conn.execute(stmt.limit(limit) if limit else stmt).all()
    if not queued:
        return 0
    whole = {q.project for q in queued if q.run_id is None}
    runs = {q.run_id for q in queued if q.run_id is not None}
    mostly_new, taken_with = _mostly_queued(conn, runs, None if bulk else WHOLE_REBUILD_MAX)
    if bulk and mostly_new:
        # one big project a transaction: the others' entries stay queued for the next call
        project = min(mostly_new)
        rebuild(conn, project)
        moved_in = held_elsewhere(conn, project)
        if moved_in:
            _Refresh(conn, {project}).run(moved_in)
        taken = [q.id for q in queued if q.project == project] + taken_with[project]
        delete_entries(conn, taken)
        return len(taken)
    whole |= mostly_new
    for project in sorted(whole):
        rebuild(conn, project)
    if runs:
        _Refresh(conn, whole).run(runs)
    # exactly the entries read: one queued meanwhile by a writer that committed after the read
    # (ids are not committed in order on Postgres) stays for the next refresh
    delete_entries(conn, [q.id for q in queued] + [i for p in sorted(mostly_new) for i in taken_with[p]])
    return len(queued)


def delete_entries(conn: Connection, ids: list[int]) -> None:
    """Queue entries taken: exactly these, not whatever was queued meanwhile."""
    for chunk in chunked(sorted(set(ids))):
        conn.execute(delete(_QUEUE).where(_QUEUE.c.id.in_(chunk)))


def _mostly_queued(conn: Connection, runs: set[str], rebuild_max: int | None) -> tuple[set[str], dict[str, list[int]]]:
    """Projects of the queued runs that are mostly queued (a bulk load of a new project) and small
    enough to rebuild in one transaction (`rebuild_max` runs; None: any): a rebuild costs half what
    the incremental refresh of the same runs does at a few thousand runs. Returns them and, per
    project, its queue entries, which the rebuild covers too."""
    if not runs:
        return set(), {}
    projects: set[str] = set()
    for chunk in chunked(sorted(runs)):
        projects |= set(conn.execute(select(_RUNS.c.project).where(_RUNS.c.id.in_(chunk)).distinct()).scalars())
    sizes = dict(conn.execute(select(_RUNS.c.project, func.count()).where(_RUNS.c.project.in_(sorted(projects)))
                              .group_by(_RUNS.c.project)).all())
    small = sorted(p for p in projects if rebuild_max is None or sizes.get(p, 0) <= rebuild_max)
    if not small:
        return set(), {}
    pending = conn.execute(select(_QUEUE.c.id, _RUNS.c.project).join(_RUNS, _RUNS.c.id == _QUEUE.c.run_id)
                           .where(_RUNS.c.project.in_(small))).all()
    queued_in: dict[str, list[int]] = defaultdict(list)
    for entry_id, project in pending:
        queued_in[project].append(entry_id)
    chosen = {p for p in small if mostly_queued(len(queued_in[p]), sizes[p])}
    return chosen, {p: queued_in[p] for p in chosen}


def mostly_queued(entries: int, runs: int) -> bool:
    """A project of `runs` runs with `entries` queue entries is rebuilt whole rather than refreshed."""
    return 2 * entries >= runs


def rebuild(conn: Connection, project: str) -> list[dict]:
    """Recompute a project's ablations from scratch (the reference the incremental refresh
    equals); returns them."""
    runs = conn.execute(select(*_READ).where(_RUNS.c.project == project)).all()
    ids = [r.id for r in runs]
    old = set(conn.execute(select(_ABL.c.id).where(_ABL.c.project == project)).scalars())
    known: dict = {}
    configs = group_runs(project, runs, known)
    if len(runs) < THREADED_REBUILD_MIN:
        _rewrite_sigs(conn, ids, configs)
        found = find_ablations(project, runs, known)
    else:
        # the bucket rows are written by a thread while this one finds the ablations: the database
        # does most of that writing without the GIL (the server's work on Postgres, SQLite's
        # b-tree inserts), so both cores work. Nothing else touches `conn` until it is done.
        with ThreadPoolExecutor(1, thread_name_prefix="kb-sigs") as pool:
            writing = pool.submit(_rewrite_sigs, conn, ids, configs)
            try:
                found = find_ablations(project, runs, known)
            finally:
                writing.result()
    _replace(conn, old, found, set(ids))
    return found


# memberships whose run is no longer in its ablation's project: the run moved since it was found
_MEMBERS_FULL = _MEMBER.join(_RUNS, _RUNS.c.id == _MEMBER.c.run_id).join(_ABL, _ABL.c.id == _MEMBER.c.ablation_id)
_MOVED = _RUNS.c.project != _ABL.c.project


def held_elsewhere(conn: Connection, project: str) -> set[str]:
    """The project's runs that an ablation of another project holds: runs that moved here since
    that ablation was found. A rebuild of this project leaves them there; the incremental
    refresh of those runs takes them out."""
    stmt = select(_MEMBER.c.run_id).select_from(_MEMBERS_FULL).where(_MOVED, _RUNS.c.project == project).distinct()
    return set(conn.execute(stmt).scalars())


def linked_by_moved_runs(conn: Connection, projects: list[str]) -> set[str]:
    """Those of the projects whose runs an ablation of another project holds, or whose ablations
    hold a run of another project; read from the projects' own runs and ablations, not the store."""
    pair = (_RUNS.c.project, _ABL.c.project)
    stmt = union(select(*pair).select_from(_MEMBERS_FULL).where(_MOVED, _RUNS.c.project.in_(projects)),
                 select(*pair).select_from(_MEMBERS_FULL).where(_MOVED, _ABL.c.project.in_(projects)))
    return {p for row in conn.execute(stmt) for p in row} & set(projects)


def lock_refresh(conn: Connection) -> None:
    """Hold the refresh's lock until the transaction ends: one refresh at a time."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": LOCK_KEY})
    else:
        # a write takes SQLite's write lock now (waiting out another writer), whatever began the
        # transaction; every read after it sees the last refresh's commit
        conn.execute(update(_QUEUE).where(text("1 = 0")).values(run_id=_QUEUE.c.run_id))


class _Refresh:
    """One incremental refresh: the queued runs' buckets and tags, found, redone and written."""

    def __init__(self, conn: Connection, skip: set[str]):
        self.conn, self.skip = conn, skip           # skip: projects rebuilt whole just now
        self.rows: dict[str, object] = {}          # run id -> its row (id, project, config, ...)
        self.sigs: dict[int, list[tuple[str, str]]] = {}     # bucket -> [(run id, key)]
        self._grouped: dict[str, Config] | None = None
        self.known: dict = {}                       # run id -> its config's parts, hashed once

    def run(self, queued: set[str]) -> None:
        conn = self.conn
        self._load(queued)
        live = [self.rows[r] for r in sorted(queued) if r in self.rows and self.rows[r].project not in self.skip]
        old = {a.id: a for a in self._ablations_holding(queued) if a.project not in self.skip}
        if not old and not live and all(r in self.rows for r in queued):
            return      # every queued run is in a project rebuilt just now, and held nothing elsewhere
        # 1. the queued runs' buckets, rewritten (a rebuilt project's are written already)
        for chunk in chunked(sorted(r for r in queued if r not in self.rows or self.rows[r].project not in self.skip)):
            conn.execute(delete(_SIG).where(_SIG.c.run_id.in_(chunk)))
        by_project: dict[str, list] = defaultdict(list)
        for r in live:
            by_project[r.project].append(r)
        mine = [(p, c) for p, rs in by_project.items() for c in group_runs(p, rs, self.known)]
        _write_sigs(conn, [c for _, c in mine])
        # 2. what to redo
        self._look_up({c.total for _, c in mine} | {c.bucket(k) for _, c in mine for k in c.sig})
        todo: set[tuple[str, str, int]] = set()          # (project, key, bucket)
        for p, c in mine:
            same = {rid for rid, key in self.sigs.get(c.total, ()) if key == ""}
            for k in c.sig:
                b = c.bucket(k)
                if any(key in (k, "") and rid not in same for rid, key in self.sigs.get(b, ())):
                    todo.add((p, k, b))
            todo.update((p, key, c.total) for rid, key in self.sigs.get(c.total, ()) if key)
        tags = {(r.project, f) for r in live for f in tagged_factors(r.tags)}
        for a in old.values():
            if a.bucket is None:
                tags.add((a.project, a.factor))
            else:
                todo.add((a.project, a.factor[len("config."):], a.bucket % (1 << 64)))
        # the ablations now in those buckets, and what they replace
        self._look_up({b for _, _, b in todo})
        self._load({rid for _, k, b in todo for rid, key in self.sigs.get(b, ()) if key in (k, "")})
        replaced = dict(old)
        for a in self._in_buckets(todo):
            replaced[a.id] = a
        configs = self._configs()
        found: dict[str, dict] = {}
        for p, k, b in sorted(todo):
            held = {id(c): c for rid, key in self.sigs.get(b, ()) if key in (k, "") and rid in configs
                    and self.rows[rid].project == p for c in [configs[rid]]}
            for a in bucket_ablations(p, k, b, list(held.values())):
                found[a["id"]] = a
        # a config ablation that gains or loses runs may now hold exactly a tag's runs, or no longer
        tags |= {(a.project, name_of(a.factor)) for a in replaced.values() if a.bucket is not None}
        tags |= {(a["project"], name_of(a["factor"])) for a in found.values()}
        self._redo_tags(tags, replaced, found)
        # a rebuilt project's runs had their fields written by the rebuild; one that an ablation of
        # another project held (a run that moved) is among that ablation's members below
        rebuilt = {r for r in queued if r in self.rows and self.rows[r].project in self.skip}
        _replace(conn, set(replaced), list(found.values()), set(queued) - rebuilt)

    def _redo_tags(self, tags: set[tuple[str, str]], replaced: dict, found: dict) -> None:
        """Tag ablations of (project, factor) pairs: the old replaced, the new into `found`."""
        if not tags:
            return
        tagged = self._tagged(tags)                       # (project, factor) -> run ids
        for a in self._tag_ablations(tags):
            replaced[a.id] = a
        self._load({rid for ids in tagged.values() for rid in ids})
        configs = self._configs()
        covered, config_ids = self._covered(tagged, replaced, found)
        for (p, f), ids in sorted(tagged.items()):
            rows = [self.rows[rid] for rid in ids if rid in self.rows and self.rows[rid].project == p]
            runs = [r for r in rows for g in tagged_factors(r.tags) if g == f]      # once per tag, as ever
            a = tag_ablation(p, f, runs, configs, covered)
            if a is not None and a["id"] not in config_ids:    # a tag `ablation:config.x` on a config ablation
                found[a["id"]] = a

    def _covered(self, tagged: dict, replaced: dict, found: dict) -> tuple[set[tuple], set[str]]:
        """`covered_by` and the ids of the config ablations (as they will be) holding a tagged run."""
        runs = {rid for ids in tagged.values() for rid in ids}
        keep = [{"id": a.id, "factor": a.factor, "variants": a.variants}
                for a in self._ablations_holding(runs) if a.id not in replaced and a.bucket is not None]
        held = keep + [a for a in found.values() if a["bucket"] is not None]
        return {covered_by(a) for a in held}, {a["id"] for a in held}

    # ---- reads ------------------------------------------------------------------------------

    def _load(self, ids: Iterable[str]) -> None:
        missing = sorted(set(ids) - set(self.rows))
        for chunk in chunked(missing):
            for r in self.conn.execute(select(*_READ).where(_RUNS.c.id.in_(chunk))):
                self.rows[r.id] = r
        if missing:
            self._grouped = None

    def _configs(self) -> dict[str, Config]:
        """Every loaded run's config, grouped per project once (configs compare in full once)."""
        if self._grouped is None:
            by_project: dict[str, list] = defaultdict(list)
            for r in self.rows.values():
                by_project[r.project].append(r)
            self._grouped = {r.id: c for p, rs in by_project.items() for c in group_runs(p, rs, self.known)
                            for r in c.runs}
        return self._grouped

    def _look_up(self, buckets: set[int]) -> None:
        """The AblationSig rows of these buckets, into self.sigs."""
        wanted = sorted(signed(b) for b in buckets if b not in self.sigs)
        for b in wanted:
            self.sigs[b % (1 << 64)] = []
        # plain driver statements: a 20,000-key run looks up 20,001 buckets, and SQLAlchemy's
        # statement and row handling cost more than the index lookups
        for chunk in chunked(wanted):
            if self.conn.dialect.name == "postgresql":
                # one array parameter: with 500 in an IN list and the table not analyzed yet (a
                # bulk load, autovacuum off or behind) Postgres scanned the whole table per list,
                # 33 ms at 31,000 runs and growing with them; = ANY keeps to the index (3 ms)
                sql, params = 'SELECT bucket, run_id, "key" FROM ablationsig WHERE bucket = ANY(%s)', (chunk,)
            else:
                sql, params = (f'SELECT bucket, run_id, "key" FROM ablationsig WHERE bucket IN '
                               f'({", ".join(["?"] * len(chunk))})', tuple(chunk))
            for b, rid, key in self.conn.exec_driver_sql(sql, params).fetchall():
                self.sigs[b % (1 << 64)].append((rid, key))

    def _ablations_holding(self, runs: Iterable[str]) -> list:
        out = {}
        for chunk in chunked(sorted(set(runs))):
            held = select(_MEMBER.c.ablation_id).where(_MEMBER.c.run_id.in_(chunk))
            for a in self.conn.execute(select(*_ABL_READ).where(_ABL.c.id.in_(held))):
                out[a.id] = a
        return list(out.values())

    def _in_buckets(self, todo: set[tuple[str, str, int]]) -> list:
        """The stored config ablations of these buckets (what recomputing them replaces)."""
        wanted = {(p, f"config.{k}", signed(b)) for p, k, b in todo}
        out = []
        for chunk in chunked(sorted({b for _, _, b in wanted})):
            for a in self.conn.execute(select(*_ABL_READ).where(_ABL.c.bucket.in_(chunk))):
                if (a.project, a.factor, a.bucket) in wanted:
                    out.append(a)
        return out

    def _tag_ablations(self, tags: set[tuple[str, str]]) -> list:
        out = []
        for chunk in chunked(sorted({f for _, f in tags})):
            for a in self.conn.execute(select(*_ABL_READ).where(_ABL.c.factor.in_(chunk), _ABL.c.bucket.is_(None))):
                if (a.project, a.factor) in tags:
                    out.append(a)
        return out

    def _tagged(self, tags: set[tuple[str, str]]) -> dict[tuple[str, str], list[str]]:
        """The runs each (project, factor) tag is on, by their `tags."ablation:<factor>"` fields."""
        keys = {canonical(("tags", TAG + f)): f for _, f in tags}
        out: dict[tuple[str, str], list[str]] = defaultdict(list)
        for chunk in chunked(sorted(keys)):
            stmt = (select(RunField.key, _RUNS.c.id, _RUNS.c.project)
                    .join(_RUNS, _RUNS.c.id == RunField.run_id).where(RunField.key.in_(chunk)))
            for key, rid, project in self.conn.execute(stmt):
                if (project, keys[key]) in tags:
                    out[(project, keys[key])].append(rid)
        for pf in tags:
            out.setdefault(pf, [])
        return out


# ---- writes -----------------------------------------------------------------------------------


def _rewrite_sigs(conn: Connection, ids: list[str], configs: list[Config]) -> None:
    for chunk in chunked(ids):
        conn.execute(delete(_SIG).where(_SIG.c.run_id.in_(chunk)))
    _write_sigs(conn, configs)


def _write_sigs(conn: Connection, configs: list[Config]) -> None:
    rows = []
    for c in configs:
        for r in c.runs:
            rows.append((signed(c.total), r.id, 0, ""))
            rows.extend((signed(c.bucket(k)), r.id, slot, k) for slot, k in enumerate(c.sig, start=1))
    rows.sort()         # in primary-key order: each b-tree page is visited once, not once per row
    bulk_insert(conn, "ablationsig", ("bucket", "run_id", "slot", "key"), rows)


def _replace(conn: Connection, old: set[str], new: list[dict], touched: set[str]) -> None:
    """Old ablations out, new in, and `ablations.*` fields written again where they may change:
    all of a `touched` run's, and of any other run either holds, those of the names they go by.
    A run's fields of one name come from its ablations of that name alone, so a run joining an
    `lr` ablation leaves its members' other fields be (at 40,000 runs of dense sweeps, reading
    every field and ablation of each member was a third of a refresh)."""
    queue_refs(conn, "ablation", sorted(old | {a["id"] for a in new}))     # their points follow
    names: dict[str, set[str]] = defaultdict(set)        # run id -> names whose fields may change
    for chunk in chunked(sorted(old)):
        was = select(_MEMBER.c.run_id, _ABL.c.factor).join(_ABL, _ABL.c.id == _MEMBER.c.ablation_id)
        for rid, factor in conn.execute(was.where(_MEMBER.c.ablation_id.in_(chunk))):
            names[rid].add(name_of(factor))
        conn.execute(delete(_MEMBER).where(_MEMBER.c.ablation_id.in_(chunk)))
        conn.execute(delete(_ABL).where(_ABL.c.id.in_(chunk)))
    insert_dicts(conn, _ABL, new)       # every column given (kb.ablations._build)
    links: set[tuple[str, str]] = set()
    for a in new:
        name = name_of(a["factor"])
        for v in a["variants"]:
            for rid in v["runs"]:
                links.add((rid, a["id"]))
                names[rid].add(name)
    bulk_insert(conn, "ablationrun", ("run_id", "ablation_id"), sorted(links))
    for rid in touched:
        names.pop(rid, None)
    stored = _stored_fields(conn, touched, names)
    per_run = run_fields(_holding(conn, touched, names, {a["id"]: a for a in new}))
    rows = []
    for rid in sorted(touched | set(names)):
        fields = per_run.get(rid, {})
        if rid in names:
            fields = {n: f for n, f in fields.items() if n in names[rid]}
        rows += field_tuples(rid, {"ablations": fields})
    _write_changed(conn, stored, rows)


def _stored_fields(conn: Connection, whole: set[str], names: dict[str, set[str]]) -> dict[tuple[str, str], tuple]:
    """The stored `ablations.*` fields (run id, key) -> (vtype, num, text): all of the `whole`
    runs', and of the others those of their `names`."""
    by_name: dict[str, list[str]] = defaultdict(list)
    for rid, wanted in names.items():
        for name in wanted:
            by_name[name].append(rid)
    reads = [(sorted(whole), ABLATION_FIELDS)]
    reads += [(sorted(rids), RunField.key.in_(_field_keys(name))) for name, rids in sorted(by_name.items())]
    stored: dict[tuple[str, str], tuple] = {}
    for rids, keys in reads:
        for chunk in chunked(rids):
            for rid, key, *value in conn.execute(select(*_FIELD_READ).where(RunField.run_id.in_(chunk), keys)):
                stored[(rid, key)] = tuple(value)
    return stored


def _field_keys(name: str) -> list[str]:
    """The keys of a run's `ablations.<name>` fields (kb.ablations.run_fields writes them all)."""
    return [row[1] for row in field_tuples("", {"ablations": {name: dict.fromkeys(RUN_FIELDS)}})]


def _holding(conn: Connection, whole: set[str], names: dict[str, set[str]], new: dict[str, dict]) -> list[dict]:
    """The ablations the fields to write come from: every one a `whole` run is in, and those of
    the other runs' `names`; `new` as given (just written), the rest read."""
    wanted: set[str] = set()
    held = select(_MEMBER.c.run_id, _MEMBER.c.ablation_id, _ABL.c.factor).join(_ABL, _ABL.c.id == _MEMBER.c.ablation_id)
    for chunk in chunked(sorted(whole | set(names))):
        for rid, aid, factor in conn.execute(held.where(_MEMBER.c.run_id.in_(chunk))):
            if aid not in new and (rid not in names or name_of(factor) in names[rid]):
                wanted.add(aid)
    out = list(new.values())
    for chunk in chunked(sorted(wanted)):
        out += [{"id": a.id, "factor": a.factor, "bucket": a.bucket, "variants": a.variants}
                for a in conn.execute(select(*_ABL_READ).where(_ABL.c.id.in_(chunk)))]
    return out


def _write_changed(conn: Connection, stored: dict[tuple[str, str], tuple], rows: list[tuple]) -> None:
    """Make the stored `ablations.*` fields (run id, key) -> (vtype, num, text) equal `rows`,
    writing only the rows that differ: a run joining an ablation changes its members' fields of
    that ablation, not those from their other ablations (a bulk load into a 30,000-run store
    recomputed 35 field rows per new run, of which 15 differed)."""
    wanted = {(r[0], r[1]): tuple(r[2:]) for r in rows}
    stale: dict[str, list[str]] = defaultdict(list)
    for (rid, key), value in stored.items():
        if wanted.get((rid, key)) != value:
            stale[key].append(rid)
    for key, rids in sorted(stale.items()):
        for chunk in chunked(sorted(rids)):
            conn.execute(delete(RunField).where(RunField.key == key, RunField.run_id.in_(chunk)))
    bulk_insert(conn, "runfield", FIELD_COLUMNS, [r for r in rows if stored.get((r[0], r[1])) != tuple(r[2:])])


# ---- inspection -------------------------------------------------------------------------------


def snapshot(conn: Connection, project: str) -> dict:
    """What a project's ablations left in SQL, less the time each was written: equal snapshots
    are equal ablations, members, bucket rows and `ablations.*` fields."""
    runs = select(_RUNS.c.id).where(_RUNS.c.project == project)
    ablations = {a.id: {k: v for k, v in a._mapping.items() if k != "ingested_at"}
                 for a in conn.execute(select(_ABL).where(_ABL.c.project == project))}
    members = sorted(conn.execute(select(_MEMBER.c.run_id, _MEMBER.c.ablation_id)
                                  .where(_MEMBER.c.ablation_id.in_(select(_ABL.c.id).where(_ABL.c.project == project))))
                     .all())
    fields = sorted(tuple(r) for r in conn.execute(select(*RunField.__table__.c)
                                                   .where(RunField.run_id.in_(runs), ABLATION_FIELDS)))
    sigs = sorted(tuple(r) for r in conn.execute(select(_SIG).where(_SIG.c.run_id.in_(runs))))
    return {"ablations": ablations, "members": [tuple(m) for m in members], "fields": fields, "sigs": sigs}
