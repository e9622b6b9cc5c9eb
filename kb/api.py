"""The Python API: `KnowledgeBase.open()`, then ingest, query and read runs.

Opening is cheap (SQL only, schema upgraded if behind). The vector index and the
embedding model are opened the first time something needs them, so `kb runs` never
pays for them.
"""
from __future__ import annotations

import logging
import threading
from contextlib import closing, contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterable

from sqlalchemy import bindparam, func, select
from sqlmodel import Session

from kb.db import is_read_only, maintain_after_bulk_load, make_engine, migrate
from kb.errors import IndexBusy, IndexDamaged, InvalidRecord, NotFound, ReadOnlyStore
from kb.models import IndexPending, Note, Run
from kb.models import RunPublic
from kb.record_writer import IngestReport, RecordWriter
from kb.records import Parsed
from kb.runs import RunDetail, read_detail
from kb.settings import Settings
from kb.tracking import TrackedRun

log = logging.getLogger(__name__)
ANALYZE_AFTER = 1000     # runs written in one ingest before Postgres's tables are looked after (kb.db)


class KnowledgeBase:
    def __init__(self, settings: Settings, engine):
        self.settings = settings
        self.engine = engine
        self._index = None
        self._index_copy = None       # a read-only copy to search, when the index cannot be had
        self._embedder = None
        self._bulk: dict[int, _BulkLoad] = {}     # thread -> its open `with k.bulk():` block

    @classmethod
    def open(cls, settings: Settings | None = None, **overrides) -> "KnowledgeBase":
        settings = settings or Settings(**overrides)
        if not settings.database_url or not settings.qdrant_url:
            settings.home.mkdir(parents=True, exist_ok=True)
        engine = make_engine(settings.sql_url)
        migrate(engine, lock_path=settings.home / ".migrate.lock")
        return cls(settings, engine)

    def close(self) -> None:
        self.release_index()
        if self._index_copy is not None:
            self._index_copy.close()
            self._index_copy = None
        self.engine.dispose()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- writing -------------------------------------------------------------------------

    def ingest(self, *targets: str, format: str | None = None, project: str | None = None,
               mapping: dict[str, str] | None = None, index: bool = True,
               progress: Callable[[str, int], None] | None = None) -> IngestReport:
        """Read every target with its ingester and store each record in its own transaction.

        A bad record is reported and skipped; the others still go in. With `index`, the
        vectors are brought up to date afterwards unless another process holds the index.
        `mapping` ({column: key}) places a table's columns (see ingest.table).
        """
        from ingest import pipeline
        from ingest.base import check_options
        from ingest.detect import Plan, resolve

        report = IngestReport()
        # resolve every target first: a mistyped second path fails before anything is written
        plan = Plan()
        for target in targets:
            plan.extend(resolve(str(target), format))
        report.failed += plan.failed
        report.skipped += plan.skipped
        options = {"mapping": mapping} if mapping else {}
        check_options([r.ingester for r in plan.reads], options)
        workers = pipeline.worth_it(plan.reads, self.settings.ingest_workers)

        def tick(source: str) -> None:
            if progress:
                progress(source, report.added + report.updated + report.unchanged + len(report.failed))
        with RecordWriter(self.engine, report) as writer:
            if workers:     # a big input: read and prepared in worker processes while this one writes
                _write_outcomes(writer, pipeline.run(plan.reads, workers, options, project), tick)
            else:
                _write_reads(writer, plan.reads, options, project, tick)
        self._after_writes(report, index)
        report.pending_index = self.pending_index()
        return report

    def ingest_records(self, records: Iterable[dict], *, source: str = "api", source_kind: str = "native",
                       index: bool = True) -> IngestReport:
        """Native records given as dicts (the REST API, hooks and the runner write through this).
        Record i is reported as line i of `source`. A big list is read and prepared by the
        ingest workers (ingest.pipeline), as a big file is."""
        from ingest import pipeline
        from ingest.detect import Read
        from ingest.native import RecordsReader

        report = IngestReport()
        reads = [Read(source, RecordsReader(records, source_kind))]
        workers = pipeline.worth_it(reads, self.settings.ingest_workers)
        with RecordWriter(self.engine, report) as writer:
            if workers:
                _write_outcomes(writer, pipeline.run(reads, workers, {}, None), _no_tick)
            else:
                _write_reads(writer, reads, {}, None, _no_tick)
        self._after_writes(report, index)
        report.pending_index = self.pending_index()
        return report

    def track(self, project: str = "default", config: dict | None = None, name: str | None = None,
              **fields) -> TrackedRun:
        """`with k.track(project=..., config=...) as run: run.log({...}, step=...)`; ingested on exit."""
        return TrackedRun(self, project=project, config=config or {}, name=name, **fields)

    def mlflow_live(self):
        """Runs MLflow's client logs through `kb serve` (ingest.mlflow_live.LiveRuns): kept in SQL
        while open, stored as native runs under MLflow's run id when they end."""
        from ingest.mlflow_live import LiveRuns
        return LiveRuns(self)

    @contextmanager
    def bulk(self):
        """`with k.bulk(): ...` many ingest calls as one load: the ablation refresh, Postgres's
        upkeep and the vector sync that each call would run are run once, at the end of the
        block (also when it ends in an error: the runs written stay and get their ablations).

        Inside the block runs are stored and queryable at once; their ablations (and the
        `ablations.*` fields) appear at its end. The refresh there rebuilds each project that is
        mostly new whole, one transaction a project, whatever its size (90,000 runs of dense
        sweeps into a Postgres store of 10,000: 275 s in a block, 387 s call by call); on
        Postgres two projects at a time (kb.ablation_bulk). On SQLite that transaction holds
        the write lock while it runs (seconds for 10,000 runs).
        Calls from other threads sharing this KnowledgeBase (a server's) are not deferred."""
        me = threading.get_ident()
        if me in self._bulk:
            yield self          # nested: the outer block does it
            return
        self._bulk[me] = pending = _BulkLoad()
        try:
            yield self
        finally:
            del self._bulk[me]
            self._upkeep(pending.runs, pending.index, bulk=True)

    def _after_writes(self, report: IngestReport, index: bool) -> None:
        from kb.notes import drop_chunks_beyond
        for uri, n in report.note_chunks.items():
            with Session(self.engine) as s, s.begin():
                drop_chunks_beyond(s, uri, n)      # a document that got shorter
        written = report.added + report.updated
        pending = self._bulk.get(threading.get_ident())
        if pending is not None:
            pending.runs += written
            pending.index |= bool(index and written)
            return
        self._upkeep(written, index and bool(written))

    def _upkeep(self, written: int, index: bool, bulk: bool = False) -> None:
        """What follows the runs' commit: their ablations (and what a crash left queued), the
        tables' upkeep after many runs, the vector index."""
        from kb.ablation_bulk import refresh_bulk
        from kb.ablation_store import refresh_all
        if bulk:
            refresh_bulk(self.engine)
        else:
            refresh_all(self.engine)
        if written >= ANALYZE_AFTER:
            maintain_after_bulk_load(self.engine, written)
        if index:
            self.try_sync_index()

    # ---- reading -------------------------------------------------------------------------

    def runs(self, where: str | None = None, sort: str | None = None, limit: int | None = None,
             project: str | None = None) -> list[RunPublic]:
        from kb.query import Compare, render
        from kb.query_sql import choose_driver, test_sizes, top_ids, walk_ids

        if project:       # part of the query, so the plan knows about it
            scope = render(Compare(("project",), "=", project))
            where = f"({where}) and {scope}" if where else scope
        # rows straight off a connection, not ORM objects: the session and identity map cost
        # more than the indexed query itself
        with self.engine.connect() as conn:
            sizes = test_sizes(conn, where)      # counted once, for the driver and the walk
            driver = choose_driver(conn, where, sizes)
            terms = conn.dialect.name == "postgresql"        # Postgres keeps runs' terms (kb.field_terms)
            first = top_ids(where, sort, limit, driver, terms) if sort and limit and limit <= TOP_IDS_MAX else None
            if first is not None:        # the best few found from RunField alone, then read by id
                ids = walk_ids(conn, where, sort, limit, sizes, terms)
                if ids is None:
                    ids = list(conn.execute(first).scalars())
                found = {row.id: row for row in conn.execute(_RUNS_BY_ID, {"ids": ids})} if ids else {}
                return [RunPublic.of(found[i]) for i in ids if i in found]     # (deleted in between)
            stmt = _runs_statement(where, sort, limit, driver)
            return [RunPublic.of(row) for row in conn.execute(stmt)]

    def run(self, ref: str) -> RunDetail:
        """One run by id, or by name when the name is unique."""
        with Session(self.engine) as s:
            row = s.get(Run, ref)
            if row is None:
                named = s.execute(select(Run).where(Run.name == ref).limit(2)).scalars().all()
                if len(named) > 1:
                    raise NotFound(f"{ref!r} names several runs; use an id: {', '.join(r.id for r in named)}")
                row = named[0] if named else None
            if row is None:
                raise NotFound(f"no run {ref!r}")
            return read_detail(s, row)

    def count(self) -> dict:
        with Session(self.engine) as s:
            return {"runs": s.execute(select(func.count()).select_from(Run)).scalar_one(),
                    "notes": s.execute(select(func.count()).select_from(Note)).scalar_one(),
                    "pending_index": s.execute(select(func.count()).select_from(IndexPending)).scalar_one()}

    def pending_index(self) -> int:
        return self.count()["pending_index"]

    def record(self, kind: str, ref: str) -> dict:
        """A record a citation names, by kind and id: a run (as `kb show --json`), a note chunk
        (title, text, source), an ablation (factor, variants, effect) or a failure (kind, step,
        evidence, its run). NotFound when there is none."""
        if kind == "run":
            return self.run(ref).as_dict()
        from kb.record_views import read_record
        with Session(self.engine) as s:
            return read_record(s, kind, ref)

    def failures(self, kind: str | None = None, project: str | None = None, limit: int | None = None) -> list[dict]:
        """Failures across runs (kb.record_views.list_failures): kind, step, message, evidence, run."""
        from kb.record_views import list_failures
        with Session(self.engine) as s:
            return list_failures(s, kind=kind, project=project, limit=limit)

    def anomalies(self, kind: str | None = None, project: str | None = None, limit: int | None = None) -> list[dict]:
        """Anomalies found on runs' curves (loss spikes, plateaus, divergence), with their run."""
        from kb.record_views import list_anomalies
        with Session(self.engine) as s:
            return list_anomalies(s, kind=kind, project=project, limit=limit)

    def failure_counts(self, project: str | None = None) -> dict[str, dict[str, int]]:
        """{"failures": {kind: n}, "anomalies": {kind: n}} over every run (or one project's)."""
        from kb.record_views import failure_counts
        with Session(self.engine) as s:
            return failure_counts(s, project=project)

    # ---- vectors -------------------------------------------------------------------------

    @property
    def embedder(self):
        if self._embedder is None:
            from kb.embed import load_embedder
            self._embedder = load_embedder(self.settings.embedding_model, threads=self.settings.threads,
                                           backend=self.settings.embedding_backend)
        return self._embedder

    @property
    def index(self):
        """The vector index, opened (and reconciled with SQL) on first use; IndexBusy if held elsewhere."""
        if self._index is None:
            self.sync_index()
        return self._index

    def _open_index(self, rebuild: bool = False):
        if self._index is None or rebuild:
            from kb.vectors import open_index
            self.release_index()
            self._index = open_index(self.settings, self._embedding_dim(), rebuild=rebuild)
        return self._index

    def _embedding_dim(self) -> int:
        # from the model's config, so a busy index is found out before paying for a model load
        from kb.embed import embedding_dim
        return embedding_dim(self.settings.embedding_model, self.settings.threads)

    @property
    def writable(self) -> bool:
        """False for a knowledge base this process may only read (a shared, read-only KB_HOME)."""
        from kb.vectors import writable
        return not is_read_only(self.engine) and writable(self.settings)

    @property
    def search_index(self):
        """The index to search: this process's own, synced with SQL first; or, when another process
        holds it or the knowledge base is read-only, a private copy of what has been indexed (so
        readers never fail because a writer is indexing). IndexDamaged when its files are broken."""
        if self._index is None and self._index_copy is None and self.writable:
            try:
                self.sync_index()
            except IndexBusy:
                log.info("vector index held by another process; searching a copy of it")
        if self._index is not None:
            return self._index
        if self._index_copy is None:
            from kb.vectors import open_index_copy
            self._index_copy = open_index_copy(self.settings, self._embedding_dim())
        return self._index_copy

    def release_index(self) -> None:
        """Let another process (a server, a watcher) take the embedded index."""
        if self._index is not None:
            self._index.close()
            self._index = None

    def sync_index(self, progress=None):
        """Index what writers queued, after checking the index against SQL (a deleted folder, a crash)."""
        from kb import indexer
        return indexer.sync(self.engine, self._open_index(), _LazyEmbedder(self), progress=progress)

    def try_sync_index(self, progress=None) -> bool:
        """Sync unless the index cannot be had: another process holds it (then it indexes what is
        pending, since writers queue in SQL) or its files are damaged (what is pending waits for
        `kb reindex`). The one place that decision is made."""
        if not self.writable:
            return False
        try:
            self.sync_index(progress=progress)
        except IndexBusy:
            log.info("vector index held by another process; it will index what is pending")
            return False
        except IndexDamaged as exc:
            log.warning("%s", exc)
            return False
        return True

    def reindex(self, progress=None):
        """Rebuild the vector index from SQL, from scratch, whatever state its files are in."""
        from kb import indexer
        if not self.writable:
            raise ReadOnlyStore(f"knowledge base at {self.settings.home} is read-only; "
                                "`kb reindex` needs to write its vector index")
        index = self._open_index(rebuild=True)
        indexer.queue_everything(self.engine)
        return indexer.sync(self.engine, index, _LazyEmbedder(self), reconcile=False, progress=progress)

    def search(self, text: str, limit: int = 10, where: str | None = None, kind: str | list[str] | None = None,
               project: str | None = None) -> list:
        """Nearest run cards and notes to `text` (or the records of `kind`: run, note, failure,
        ablation, or a list of them). `where` is a run query (`status = 'diverged' and val/loss
        < 3.5`): hits are then runs that match it, ranked by similarity."""
        filters: dict = {k: v for k, v in (("kind", kind or ["note", "run"]), ("project", project)) if v}
        if where:
            from kb.query_sql import compile_where
            if kind and kind != "run" and "run" not in kind:
                return []
            with Session(self.engine) as s:
                ids = list(s.execute(select(Run.id).where(compile_where(where))).scalars())
            if not ids:
                return []
            filters |= {"kind": "run", "ref_id": ids}
        index = self.search_index          # before the model load: a damaged index fails fast
        vector = self.embedder.encode([text])[0]
        return index.search(vector, limit=limit, where=filters or None)


    # ---- questions ----------------------------------------------------------------------------

    def ask(self, question: str):
        """Answer a question about past experiments: an agents.evidence.Answer whose every sentence
        cites the records that support it, with the SQL it ran for quantitative questions."""
        return self.chat().ask(question)

    def chat(self):
        """A conversation: `c = kb.chat(); c.ask("best lr at 125M?"); c.ask("and at 350M?")`;
        `c.stream(question)` yields the answer's text in pieces for a UI."""
        from agents.answer import Agent
        return Agent(self, retriever=self._retriever())

    def _retriever(self):
        # one per KnowledgeBase: the keyword index is loaded once, not per question
        if getattr(self, "_retriever_obj", None) is None:
            from agents.retrieve import Retriever
            self._retriever_obj = Retriever(self)
        return self._retriever_obj

    # ---- scaling laws --------------------------------------------------------------------------

    def scaling_fit(self, y: str, form: str = "chinchilla", where: str | None = None, x: str | None = None,
                    bootstrap: int = 200, seed: int = 0):
        """A scaling law fitted over the runs `where` selects: a kb.scaling.ScalingFit with .params
        (bootstrap intervals), .predict(N=, D=) or .predict(X=), .compute_optimal(C), .to_json()."""
        from kb.scaling_points import fit_runs
        return fit_runs(self.runs(where=where), y, form, x, draws=bootstrap, seed=seed, where=where)

    def scaling_predict(self, y: str, form: str = "chinchilla", where: str | None = None, x: str | None = None,
                        params: float | None = None, tokens: float | None = None, compute: float | None = None,
                        bootstrap: int = 200, seed: int = 0) -> dict:
        """`kb scaling predict --json`: the loss at (params, tokens), or the compute-optimal point for
        `compute`, each with its interval."""
        from kb.scaling import prediction
        return prediction(self.scaling_fit(y, form, where, x, bootstrap, seed), params, tokens, compute)


    # ---- verdicts and mixtures -----------------------------------------------------------------

    def compare(self, baseline, variant, metric: str = "val/loss", level: float = 0.95, **options):
        """kb.verdicts.compare: a Verdict (better | worse | inconclusive against seed noise)."""
        from kb.verdicts import compare
        return compare(self, baseline, variant, metric=metric, level=level, **options)

    def transfer(self, baseline, variant, *, target: float, **options):
        """kb.transfer.transfer: does a gain measured at proxy scales hold at `target`?"""
        from kb.transfer import transfer
        return transfer(self, baseline, variant, target=target, **options)

    def patterns(self, **options):
        """kb.patterns.patterns: changes ablated in several projects or scales, with their record."""
        from kb.patterns import patterns
        return patterns(self, **options)

    def mixture_fit(self, project: str, metric: str = "val/loss", where: str | None = None, **options):
        """kb.mixture.fit_mixture: the metric as a law of the data mixture; .best() the optimum."""
        from kb.mixture import fit_mixture
        return fit_mixture(self, project, metric=metric, where=where, **options)

    # ---- hypotheses and reports ------------------------------------------------------------------

    def propose(self, goal: str = "", n: int = 3, project: str | None = None, **options) -> list[dict]:
        """New hypotheses grounded in the runs (agents.propose), stored as `proposed`: SPEC's
        Hypothesis dicts plus project, source, plan and decision. `options`: metric, budget_runs,
        budget_flops."""
        from agents.propose import propose
        return propose(self, goal=goal, n=n, project=project, **options)

    def hypotheses(self, status: str | None = None, project: str | None = None) -> list[dict]:
        from kb.hypotheses import listed
        return listed(self.engine, status=status, project=project)

    def hypothesis(self, ref: str) -> dict:
        from kb.hypotheses import get
        return get(self.engine, ref)

    def approve(self, ref: str, by: str, reason: str = "") -> dict:
        from kb.hypotheses import decide
        return decide(self.engine, ref, "approved", by, reason)

    def reject(self, ref: str, by: str, reason: str = "") -> dict:
        from kb.hypotheses import decide
        return decide(self.engine, ref, "rejected", by, reason)

    def report(self, ref: str | None = None, where: str | None = None, out: str = "reports",
               html: bool = False, metric: str | None = None):
        """A cited experiment report on an ablation, a hypothesis or the runs `where` selects,
        written under `out` (kb.reports.Report: .markdown path, .html path, .cited ids, .verdicts)."""
        from kb.reports import write_report
        return write_report(self, ref=ref, where=where, out=out, html=html, metric=metric)

    # ---- jobs and the experiment loop (runner/) --------------------------------------------------

    def submit(self, hypothesis: str | None = None, *, config: dict | None = None, backend: str = "local",
               scales: list[float] | None = None, seeds: int | None = None, **options) -> list[dict]:
        """Queue proxy trainings: an approved hypothesis's plan (baseline and variant x scales x seeds,
        runner.submit) or one `config`; returns SPEC's Jobs. `options`: project, name, max_attempts."""
        from runner.submit import submit_config, submit_hypothesis
        if (hypothesis is None) == (config is None):
            raise InvalidRecord("submit one thing: a hypothesis id or a config", field="submit")
        if hypothesis is not None:
            return submit_hypothesis(self, hypothesis, backend=backend, scales=scales, seeds=seeds, **options)
        return submit_config(self, config, backend=backend, scales=scales, seeds=seeds, **options)

    def jobs(self, status: str | None = None, hypothesis: str | None = None) -> list[dict]:
        from runner.queue import listed
        return listed(self.engine, status=status, hypothesis=hypothesis)

    def job(self, ref: str) -> dict:
        from runner.queue import get
        return get(self.engine, ref)

    def cancel(self, ref: str) -> dict:
        """Cancel a queued job now, or ask a running one to stop at its next check."""
        from runner.submit import cancel
        return cancel(self, ref)

    def work(self, backend: str = "local", once: bool = True, *, slots: int | None = None,
             max_jobs: int | None = None, job: str | None = None, token: str | None = None,
             on_change=None, on_progress=None) -> list[dict]:
        """Run queued jobs on `backend` (runner.worker) until the queue is empty (once) or forever;
        or the one job `job` in this process. Returns the jobs finished."""
        from runner.backends import build
        from runner.execute import execute
        from runner.worker import Worker, run_one
        if job is not None:
            return [run_one(self, job, token, on_progress=on_progress)]
        lease_s = self.settings.job_lease_s
        run_here = lambda lease: execute(self, lease, lease_s=lease_s, on_progress=on_progress)  # noqa: E731
        worker = Worker(self, build(backend, self.settings, run_here=run_here, slots=slots), lease_s=lease_s,
                        on_change=on_change)
        return worker.run(once=once, max_jobs=max_jobs)

    def loop(self, **options):
        """propose -> approve -> run -> verdict, repeated (runner.loop.run_loop); a LoopReport."""
        from runner.loop import run_loop
        return run_loop(self, **options)


def open_kb(kb: KnowledgeBase | Settings | None = None) -> KnowledgeBase:
    """A KnowledgeBase from None (KB_* settings), a Settings, or an open KnowledgeBase.

    For hooks that take any of the three (the framework callbacks); it lives here, not in
    kb.tracking, because opening is the API's job and the core never imports the API."""
    if kb is None:
        return KnowledgeBase.open()
    if isinstance(kb, Settings):
        return KnowledgeBase.open(kb)
    return kb


TOP_IDS_MAX = 1000      # ids read back in one IN list (Postgres takes at most 65,535 parameters)
_RUNS_BY_ID = select(*Run.__table__.c).where(Run.__table__.c.id.in_(bindparam("ids", expanding=True)))


@lru_cache(maxsize=256)
def _runs_statement(where: str | None, sort: str | None, limit: int | None, driver: int | None):
    """The statement behind `KnowledgeBase.runs`, built once per query: building it (and its
    cache key, which SQLAlchemy keeps on the object) cost more than running it."""
    from kb.query_sql import apply_query

    stmt = apply_query(select(*Run.__table__.c), where=where, sort=sort, driver=driver)
    if not sort:
        stmt = stmt.order_by(Run.project, Run.name, Run.id)
    return stmt.limit(limit) if limit else stmt


class _LazyEmbedder:
    """Loads the model on the first text to embed: a sync with nothing pending costs no model load."""

    def __init__(self, kb: KnowledgeBase):
        self.kb = kb

    def encode(self, texts: list[str]):
        return self.kb.embedder.encode(texts)


@dataclass
class _BulkLoad:
    """What a `bulk` block's ingest calls leave for its end."""
    runs: int = 0           # written (added or updated)
    index: bool = False     # a call asked for the vector sync


def _no_tick(source: str) -> None:
    pass


def _write_reads(writer: RecordWriter, reads: list, options: dict, project: str | None,
                 tick: Callable[[str], None]) -> None:
    """Every item of the reads, read here, into the writer."""
    from ingest.base import options_for
    for read in reads:
        for item in read.ingester.read(read.source, **options_for(read.ingester, options)):
            if isinstance(item, Parsed):
                writer.add(read.settle(item, project))
            else:
                writer.report.failed.append(item.error.as_dict())
            tick(read.source)


def _write_outcomes(writer: RecordWriter, outcomes, tick: Callable[[str], None]) -> None:
    """What ingest.pipeline's workers read and prepared, into the writer (workers stopped at the end)."""
    with closing(outcomes):
        for out in outcomes:
            if out.rejected:
                writer.report.failed.append(out.rejected)
            elif out.error is not None:
                writer.reject(out.item, out.error)
            elif out.prepared is None:
                writer.add(out.item)        # a note: written here, whole
            else:
                writer.add_prepared(out.item, out.prepared)
            tick(out.source)
