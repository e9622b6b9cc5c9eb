"""What an answer is made of: the text, the records that support it, and the SQL that produced
its numbers. The shape is the contract's Answer: {"answer", "citations": [{"kind", "id",
"quote"}], "sql"}."""
from __future__ import annotations

from dataclasses import dataclass, field

CITABLE_KINDS = ("run", "note", "ablation", "failure")


@dataclass(frozen=True)
class Citation:
    kind: str           # run | note | ablation | failure
    id: str             # the record's id in SQL (a run id, a note chunk id, ...)
    quote: str = ""     # the words or values of that record that support the sentence

    def as_dict(self) -> dict:
        return {"kind": self.kind, "id": self.id, "quote": self.quote}


@dataclass
class Answer:
    text: str
    citations: list[Citation] = field(default_factory=list)
    sql: str | None = None
    # The rows the SQL returned (column name -> value), kept so a verifier can check that
    # every number in the text was measured; not part of the contract's JSON.
    rows: list[dict] = field(default_factory=list)
    # The records the agent read to answer, best first, as "kind:id" keys: the SQL's runs for a
    # planned question, the diffed runs and their failures for an explanation, the hybrid hits
    # otherwise. What the evaluation's recall measures; not part of the contract's JSON.
    retrieved: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"answer": self.text, "citations": [c.as_dict() for c in self.citations],
                "sql": self.sql}


NO_EVIDENCE = "I found no evidence for that in the knowledge base."
