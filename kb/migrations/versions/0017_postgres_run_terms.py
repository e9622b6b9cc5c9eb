"""Postgres keeps each run's equality-testable fields as one array of exact terms, under GIN

A filter of several equalities, each true of many runs, made the RunField plan read one test's
whole range and probe the rest (at 100,000 runs, `lr = X and batch_size = Y and warmup = Z`:
10,000 rows read for ~100 matches, 16-34 ms). GIN intersects the terms' posting lists instead
(kb.field_terms says what a term is and which fields have one).

The table is written by statement-level triggers on runfield, from the statement's own rows
(transition tables): an insert adds its runs' terms, a delete or an update recomputes the terms
of the runs it touched. Every writer of fields (ingest's COPY, a run's update, a store copy)
keeps it exact without knowing it exists. The functions run with the search path they were
created under, so they write the runterm beside the runfield that fired them. Existing runs
get their terms here.

Revision ID: 0017
Revises: 0016
"""
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

# kb.field_terms.TERM_NAMESPACES, TERM_MAX_BYTES and field_term's spelling, as of this revision
NAMESPACES = "'config', 'hparams', 'scale', 'tags', 'failure', 'anomalies'"
MAX_BYTES = 1000
TERM = """vtype || length(key) || ':' || key || CASE vtype WHEN 's' THEN text WHEN 'z' THEN ''
    ELSE encode(float8send(num + 0.0), 'hex') END"""
PENDING_KB = 512
HAS_TERM = f"vtype IN ('n', 's', 'b', 'z') AND split_part(key, '.', 1) IN ({NAMESPACES})"


def terms_of(rows: str, runs: str | None = None) -> str:
    """SELECT run_id, terms from `rows` (a table of runfield's columns), of `runs` only if given."""
    within = f" AND run_id = ANY({runs})" if runs else ""
    return (f"SELECT run_id, array_agg(term) FROM (SELECT run_id, {TERM} AS term FROM {rows} "
            f"WHERE {HAS_TERM}{within}) fields WHERE octet_length(term) <= {MAX_BYTES} GROUP BY run_id")


FUNCTIONS = {
    # a run's new fields add to its terms (a key a run has is never inserted twice: the primary key)
    "kb_runterm_on_insert": f"""
        INSERT INTO runterm AS t (run_id, terms) {terms_of('kb_new_fields')}
        ON CONFLICT (run_id) DO UPDATE SET terms = t.terms || EXCLUDED.terms;""",
    "kb_runterm_on_delete": f"""
        PERFORM kb_runterm_redo(ARRAY(SELECT DISTINCT run_id FROM kb_old_fields WHERE {HAS_TERM}));""",
    "kb_runterm_on_update": f"""
        PERFORM kb_runterm_redo(ARRAY(SELECT run_id FROM kb_old_fields WHERE {HAS_TERM}
                                      UNION SELECT run_id FROM kb_new_fields WHERE {HAS_TERM}));""",
    "kb_runterm_on_truncate": "TRUNCATE runterm;",
}
TRIGGERS = {
    "kb_runterm_on_insert": "AFTER INSERT ON runfield REFERENCING NEW TABLE AS kb_new_fields",
    "kb_runterm_on_delete": "AFTER DELETE ON runfield REFERENCING OLD TABLE AS kb_old_fields",
    "kb_runterm_on_update": "AFTER UPDATE ON runfield REFERENCING OLD TABLE AS kb_old_fields NEW TABLE AS kb_new_fields",
    "kb_runterm_on_truncate": "AFTER TRUNCATE ON runfield",
}


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    # no parallel scans: starting workers took longer than the search (16.8 against 9.4 ms for a
    # 1,000-run match at 100,000 runs, on 2 cores)
    op.execute('CREATE TABLE runterm (run_id VARCHAR PRIMARY KEY, terms TEXT[] COLLATE "C" NOT NULL) '
               "WITH (parallel_workers = 0)")
    op.execute(f"INSERT INTO runterm (run_id, terms) {terms_of('runfield')}")
    # GIN keeps new entries in a pending list that every search reads until it is merged into
    # the index (by the insert that fills it, or a vacuum): 1.9 MB of it added 3.2 ms to a
    # search; the default fills at 4 MB
    op.execute(f"CREATE INDEX ix_runterm_terms ON runterm USING gin (terms) WITH (gin_pending_list_limit = {PENDING_KB})")
    op.execute("ANALYZE runterm")       # kb.query_sql.term_share reads its statistics
    op.execute(f"""CREATE FUNCTION kb_runterm_redo(runs text[]) RETURNS void LANGUAGE plpgsql
        SET search_path FROM CURRENT AS $$ BEGIN
        IF cardinality(runs) = 0 THEN RETURN; END IF;
        DELETE FROM runterm WHERE run_id = ANY(runs);
        INSERT INTO runterm (run_id, terms) {terms_of('runfield', 'runs')};
        END $$""")
    for name, body in FUNCTIONS.items():
        op.execute(f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT "
                   f"AS $$ BEGIN {body} RETURN NULL; END $$")
        op.execute(f"CREATE TRIGGER {name} {TRIGGERS[name]} FOR EACH STATEMENT EXECUTE FUNCTION {name}()")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for name in TRIGGERS:
        op.execute(f"DROP TRIGGER {name} ON runfield")
        op.execute(f"DROP FUNCTION {name}()")
    op.execute("DROP FUNCTION kb_runterm_redo(text[])")
    op.execute("DROP TABLE runterm")
