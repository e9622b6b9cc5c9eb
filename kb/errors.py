"""Domain errors. Library code raises these; the CLI, REST server and UI translate them."""


class KBError(Exception):
    """Base of every error pretrain-kb raises on purpose."""


class InvalidRecord(KBError):
    """A record failed validation. Names the source, line and field so a person can fix it."""

    def __init__(self, error: str, *, source: str = "", line: int | None = None, field: str = ""):
        self.source, self.line, self.field, self.error = source, line, field, error
        where = source + (f":{line}" if line else "")
        super().__init__(f"{where}: {field + ': ' if field else ''}{error}" if where else
                         f"{field + ': ' if field else ''}{error}")

    def at(self, source: str, line: int | None = None) -> "InvalidRecord":
        return InvalidRecord(self.error, source=source, line=line or self.line, field=self.field)

    def as_dict(self) -> dict:
        return {"source": self.source, "line": self.line, "field": self.field, "error": self.error}



class AlreadyExists(InvalidRecord):
    """A record that must be unique (an MLflow experiment's name) is there already: MLflow's
    clients read this as RESOURCE_ALREADY_EXISTS and take the existing one."""

class QueryError(KBError):
    """A --where or --sort expression that does not parse or names an unknown key."""


class NotFound(KBError):
    """No record with that id."""


class IndexUnavailable(KBError):
    """The vector index cannot be used now. SQL is unaffected: what waits to be indexed stays queued."""


class IndexBusy(IndexUnavailable):
    """The embedded vector index is held by another process (usually `kb serve`)."""


class IndexDamaged(IndexUnavailable):
    """The embedded vector index cannot be read (garbage, truncated or missing files): `kb reindex`
    rebuilds it from SQL, the source of truth."""


class ReadOnlyStore(KBError):
    """A write asked of a knowledge base that can only be read (a shared, read-only KB_HOME)."""


class UnknownFormat(KBError):
    """No ingester recognises a path, or several do."""


class LLMError(KBError):
    """The configured language model cannot run: its package or model file is missing, or it failed."""


class LLMOutputInvalid(LLMError):
    """The language model's output is not the JSON its schema asks for (after the allowed retry)."""


class InsufficientData(QueryError):
    """Too little, or degenerate, data for an analysis: no seed repeats to measure noise with, one
    scale, a mixture that never varies. Bad input to that analysis (exit 2); the message says what
    runs are missing."""
