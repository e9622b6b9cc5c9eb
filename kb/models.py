"""Every table. SQL is the source of truth; the vector index is derived from these rows.

Runs keep hyperparameters as JSON plus promoted, indexed columns for what people
filter on; every leaf of config/summary/scale is also flattened into `RunField`,
typed, so `--where` queries on any dotted key use an index on both SQLite and Postgres.
"""
from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import JSON, BigInteger, Column, Float, Index, LargeBinary, PrimaryKeyConstraint, Text
from sqlalchemy import text as sql_text
from sqlmodel import Field, SQLModel

from kb.field_terms import POSTGRES_ONLY_TABLES
from kb.vocab import canonical_view

# plain JSON on Postgres too: it keeps the text as written (jsonb reorders keys and turns
# 1.9e18 into an integer), so both stores read a run back alike (migration 0004)
JSONType = JSON()


# bytes of the longest string value Postgres's (key, vtype, text) index holds (migration 0016)
TEXT_INDEXED = 1000


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def json_col(**kw) -> Column:
    return Column(JSONType, **kw)


def only_on(dialect: str, index: Index) -> Index:
    """An index one store has and the other has not: created on that dialect only, and marked
    (info["only_on"]) so a schema comparison elsewhere leaves it out (kb/migrations/env.py,
    tests/test_migrations.py)."""
    index.info["only_on"] = dialect
    return index.ddl_if(dialect=dialect)


def on_this_dialect(dialect: str):
    """An alembic `include_object` hook: compare only what this dialect is meant to have (and
    not Postgres's tables that no model declares: kb.field_terms)."""
    def include(obj, name, type_, reflected, compare_to) -> bool:
        if type_ == "table" and reflected and compare_to is None:
            return not (dialect == "postgresql" and name in POSTGRES_ONLY_TABLES)
        return reflected or type_ != "index" or obj.info.get("only_on", dialect) == dialect
    return include


class Provenance(SQLModel):
    """Where a record came from; re-ingesting the same content (same hash) changes nothing."""
    source_kind: str = Field(default="native", index=True)
    source_uri: str = ""
    ingested_at: datetime = Field(default_factory=utcnow, index=True)     # agents.sparse.signature reads the newest
    content_hash: str = ""


class RunBase(SQLModel):
    """A run as callers see it: the record's fields plus the promoted filter columns."""
    id: str = Field(primary_key=True)
    project: str = Field(default="default", index=True)
    name: str = Field(default="", index=True)       # questions, notes and `kb show` name runs
    status: str = Field(default="completed", index=True)
    config: dict = Field(default_factory=dict, sa_column=json_col(nullable=False))
    scale: dict = Field(default_factory=dict, sa_column=json_col(nullable=False))
    summary: dict = Field(default_factory=dict, sa_column=json_col(nullable=False))
    stats: dict = Field(default_factory=dict, sa_column=json_col(nullable=False))  # per-curve: final, best, ...
    tags: list = Field(default_factory=list, sa_column=json_col(nullable=False))
    notes: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    parent: str | None = Field(default=None, index=True)
    hypothesis: str | None = Field(default=None, index=True)
    started_at: datetime | None = None
    ended_at: datetime | None = None
    code: dict = Field(default_factory=dict, sa_column=json_col(nullable=False))
    meta: dict = Field(default_factory=dict, sa_column=json_col(nullable=False))
    # promoted from config/scale through kb.vocab, for filtering and sorting
    lr: float | None = Field(default=None, sa_column=Column(Float, index=True))
    batch_size: int | None = Field(default=None, sa_column=Column(BigInteger, index=True))
    params: int | None = Field(default=None, sa_column=Column(BigInteger, index=True))
    tokens: int | None = Field(default=None, sa_column=Column(BigInteger, index=True))
    flops: float | None = Field(default=None, sa_column=Column(Float, index=True))


class Run(RunBase, Provenance, table=True):
    card: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))


class RunPublic(RunBase):
    """A run as the API returns it: what was logged, where it came from, and the canonical
    names (kb.vocab) it answers to: {"val/loss": {"key": "summary.eval_loss", "value": 3.2}}."""
    source: dict = Field(default_factory=dict)
    canonical: dict = Field(default_factory=dict)

    @classmethod
    def of(cls, row: Run) -> "RunPublic":
        return cls(**{name: getattr(row, name) for name in RunBase.model_fields},
                   source={"kind": row.source_kind, "uri": row.source_uri,
                           "ingested_at": row.ingested_at.isoformat(), "content_hash": row.content_hash},
                   canonical=canonical_view(row.config, row.summary))

    def as_dict(self) -> dict:
        return self.model_dump(mode="json")


class RunField(SQLModel, table=True):
    """One typed leaf of a run's config, summary or scale, keyed by its canonical dotted path.

    Keyed (key, run_id), clustered on SQLite: one key's rows sit together, so a query that
    probes each candidate run's value of a key reads few pages (migration 0005)."""
    __table_args__ = (
        PrimaryKeyConstraint("key", "run_id"),
        # on Postgres the run id rides along in the index (SQLite's has it already, as the primary
        # key's tail): a test's range then names its runs without a read of the table's rows
        # (migration 0012)
        Index("ix_runfield_key_num", "key", "vtype", "num", postgresql_include=["run_id"]),
        # string tests only: a NULL text never matches one, and most leaves are numbers. On
        # Postgres a btree row holds at most 2,704 bytes and a 1 MB config string must go in, so
        # there it holds the values of at most TEXT_INDEXED bytes (kb.query_sql.short_text says a
        # query's value is one of them; migration 0016), with the run id along as above
        only_on("sqlite", Index("ix_runfield_key_text", "key", "vtype", "text",
                                sqlite_where=sql_text("text IS NOT NULL"))),
        only_on("postgresql", Index("ix_runfield_key_short_text", "key", "vtype", "text", postgresql_include=["run_id"],
                                    postgresql_where=sql_text(f"text IS NOT NULL AND octet_length(text) <= {TEXT_INDEXED}"))),
        Index("ix_runfield_run_id", "run_id"),
        {"sqlite_with_rowid": False},
    )
    # no foreign key: the store writes these rows with their run, and a check per row (~100 a
    # run) cost ~20% of a Postgres ingest (migration 0015; ablationsig and ablationrun alike)
    run_id: str = Field(primary_key=True)
    key: str = Field(primary_key=True)
    vtype: str = Field(max_length=1)          # n number, s string, b bool, z null, l list/dict
    num: float | None = Field(default=None, sa_column=Column(Float))
    text: str | None = Field(default=None, sa_column=Column(Text))


class MetricSeries(SQLModel, table=True):
    """One curve of a run (its series of step, value, wall time), the points packed into
    little-endian arrays by kb.series: a curve is written and read whole, and a row per point
    made most of an ingest's cost (migration 0011). `seq` is the curve's place in the record."""
    __table_args__ = {"sqlite_with_rowid": False}
    run_id: str = Field(primary_key=True, foreign_key="run.id", ondelete="CASCADE")
    key: str = Field(primary_key=True)
    seq: int
    points: int
    step_bytes: bytes = Field(sa_column=Column(LargeBinary, nullable=False))      # int64
    value_bytes: bytes = Field(sa_column=Column(LargeBinary, nullable=False))     # float64; NaN also for null
    wall_bytes: bytes | None = Field(default=None, sa_column=Column(LargeBinary))     # float64
    flag_bytes: bytes | None = Field(default=None, sa_column=Column(LargeBinary))     # kb.series flags


class Failure(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(foreign_key="run.id", index=True, ondelete="CASCADE")
    kind: str = Field(index=True)
    step: int | None = Field(default=None, sa_column=Column(BigInteger))
    message: str = ""
    evidence: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    origin: str = "reported"                 # reported | log | curve


class Anomaly(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(foreign_key="run.id", index=True, ondelete="CASCADE")
    kind: str = Field(index=True)            # loss_spike | divergence | plateau | grad_spike
    key: str = ""
    step: int | None = Field(default=None, sa_column=Column(BigInteger))
    value: float | None = Field(default=None, sa_column=Column(Float))
    score: float | None = Field(default=None, sa_column=Column(Float))
    evidence: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))


class Ablation(Provenance, table=True):
    id: str = Field(primary_key=True)
    project: str = Field(index=True)
    factor: str = Field(index=True)
    metric: str = ""
    baseline_run: str = Field(foreign_key="run.id", ondelete="CASCADE")
    variants: list = Field(default_factory=list, sa_column=json_col(nullable=False))
    effect: dict = Field(default_factory=dict, sa_column=json_col(nullable=False))
    # the bucket (kb.ablations) a config ablation was found in; NULL for a tag ablation
    bucket: int | None = Field(default=None, sa_column=Column(BigInteger, index=True))


class AblationSig(SQLModel, table=True):
    """A run's ablation buckets (kb.ablations): its whole config (key '') and its config without
    each key, as 64-bit hashes. A run finds those it forms ablations with by looking its buckets
    up here, never by comparing configs; clustered by bucket on SQLite (migration 0007)."""
    __table_args__ = (Index("ix_ablationsig_run_id", "run_id"), {"sqlite_with_rowid": False})
    bucket: int = Field(sa_column=Column(BigInteger, primary_key=True))
    run_id: str = Field(primary_key=True)      # no foreign key: see RunField
    slot: int = Field(primary_key=True)       # 0 the whole config, i the config without its i-th key
    key: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))   # the key left out


class AblationRun(SQLModel, table=True):
    """The runs each ablation holds: where a changed run's old ablations are found. Written and
    deleted with its ablation by the refresh alone, so without foreign keys (see RunField)."""
    run_id: str = Field(primary_key=True)
    ablation_id: str = Field(primary_key=True, index=True)


class AblationPending(SQLModel, table=True):
    """Runs written since their ablations were last refreshed (queued in the run's own transaction),
    or a project to recompute whole (run_id NULL)."""
    id: int | None = Field(default=None, primary_key=True)
    run_id: str | None = None
    project: str | None = None


class Note(Provenance, table=True):
    id: str = Field(primary_key=True)
    project: str = Field(default="default", index=True)
    title: str = ""
    text: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    chunk: int = 0
    mentions: list = Field(default_factory=list, sa_column=json_col(nullable=False))


class Hypothesis(SQLModel, table=True):
    id: str = Field(primary_key=True)
    title: str = ""
    rationale: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    baseline_run: str | None = None
    change: dict = Field(default_factory=dict, sa_column=json_col(nullable=False))
    evidence: list = Field(default_factory=list, sa_column=json_col(nullable=False))
    predicted: dict = Field(default_factory=dict, sa_column=json_col(nullable=False))
    risks: list = Field(default_factory=list, sa_column=json_col(nullable=False))
    status: str = Field(default="proposed", index=True)
    result: dict | None = Field(default=None, sa_column=json_col(nullable=True))
    created_at: datetime = Field(default_factory=utcnow)
    # what the proposer and the human gate add (migration 0008); NULL on older rows
    project: str | None = Field(default=None, index=True)
    source: str | None = None                 # surrogate | ablation | pattern | mixture | llm
    goal: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    plan: dict | None = Field(default=None, sa_column=json_col(nullable=True))   # scales, seeds, steps
    # the resolved config (baseline + change, seeds aside) as kb.hypotheses.config_key names it:
    # a configuration proposed once is never proposed again
    config_hash: str | None = Field(default=None, index=True)
    decided_by: str | None = None
    decided_at: datetime | None = None
    decision_reason: str | None = Field(default=None, sa_column=Column(Text, nullable=True))


class Job(SQLModel, table=True):
    id: str = Field(primary_key=True)
    hypothesis: str | None = Field(default=None, index=True)
    status: str = Field(default="queued", index=True)
    backend: str = "local"
    attempts: int = 0
    run_id: str | None = None
    error: str | None = None
    spec: dict = Field(default_factory=dict, sa_column=json_col(nullable=False))
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)
    # the lease (runner.queue, migration 0009): who holds a running job and until when; a lease
    # not renewed in time puts the job back in the queue, to resume from its workdir's checkpoint
    worker: str | None = None                  # the holder's token: worker id and attempt
    lease_until: datetime | None = None
    heartbeat_at: datetime | None = None
    max_attempts: int = 3
    cancel_requested: bool = False             # a running job stops at its next check
    workdir: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    started_at: datetime | None = None
    finished_at: datetime | None = None
    progress: dict | None = Field(default=None, sa_column=json_col(nullable=True))   # step, metrics at the last eval


class IndexPending(SQLModel, table=True):
    """What awaits (re)indexing: writers record it, the process holding the index drains it."""
    kind: str = Field(primary_key=True)      # run | note | ablation
    ref_id: str = Field(primary_key=True)
    queued_at: datetime = Field(default_factory=utcnow)


class MlflowExperiment(SQLModel, table=True):
    """An experiment of the MLflow-compatible tracking endpoints of `kb serve`: MLflow's client
    addresses experiments by number; the name is the project of the runs logged under it."""
    id: int | None = Field(default=None, primary_key=True)     # 0 is MLflow's "Default"
    name: str = Field(sa_column=Column(Text, nullable=False, unique=True))
    artifact_location: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    tags: dict = Field(default_factory=dict, sa_column=json_col(nullable=False))
    created_at: datetime = Field(default_factory=utcnow)


class MlflowRun(SQLModel, table=True):
    """A run MLflow's client logs through `kb serve` (ingest.mlflow_live). Kept here while it is
    open, so a server that dies loses none of it; stored as a native run under the same id when
    it ends, and again whenever it changes after that (migration 0010)."""
    id: str = Field(primary_key=True)                    # MLflow's run_id: 32 hex digits
    experiment_id: int = Field(foreign_key="mlflowexperiment.id", index=True)
    name: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    user_id: str = ""
    status: str = "RUNNING"                # MLflow's words: RUNNING, SCHEDULED, FINISHED, FAILED, KILLED
    start_time: int | None = Field(default=None, sa_column=Column(BigInteger))    # ms since the epoch
    end_time: int | None = Field(default=None, sa_column=Column(BigInteger))
    params: dict = Field(default_factory=dict, sa_column=json_col(nullable=False))
    tags: dict = Field(default_factory=dict, sa_column=json_col(nullable=False))
    stored: bool = Field(default=False, index=True)      # the ended run is in the knowledge base as it is now


class MlflowPoint(SQLModel, table=True):
    """One logged metric value of an MLflow run, in arrival order (MLflow allows repeated steps).
    SQLite stores a NaN as NULL, and MLflow's values are never null: a NULL value is NaN."""
    seq: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(foreign_key="mlflowrun.id", index=True)
    key: str = Field(sa_column=Column(Text, nullable=False))
    step: int = Field(sa_column=Column(BigInteger, nullable=False))
    timestamp: int = Field(sa_column=Column(BigInteger, nullable=False))      # ms since the epoch
    value: float | None = Field(default=None, sa_column=Column(Float))
