"""The notes ingester: chunking on headings then paragraphs, stable ids, front matter, mentions,
and the trip through the real store (mentions resolved against real runs)."""
from __future__ import annotations

import re

import pytest
from sqlalchemy import select
from sqlmodel import Session

from ingest.notes import NotesIngester, chunks, mentions, note_records, sections
from kb.records import Parsed, Rejected


def words(n: int, seed: str) -> str:
    """n distinct words ending in a full stop, so sentences are recognisable."""
    return " ".join(f"{seed}{i}" for i in range(n)) + "."


def doc_with_sections() -> str:
    return "\n".join([
        "# Training postmortem", "",
        words(40, "intro"), "",
        "## Timeline", "",
        *[f"{words(60, f'day{d}x')}\n" for d in range(8)],       # 480 words in 8 paragraphs
        "### Day 3 detail", "",
        words(30, "detail"), "",
        "```python", "# not a heading", "x = 1", "```", "",
        "## Lessons", "",
        " ".join(words(20, f"s{k}x") for k in range(40)), "",     # one 840-word paragraph, 40 sentences
    ])


def test_chunks_follow_headings_and_stay_within_size():
    parts = chunks(doc_with_sections())
    paths = [tuple(p) for p, _ in parts]
    assert paths[0] == ("Training postmortem",)
    assert ("Training postmortem", "Timeline", "Day 3 detail") in paths
    assert all(len(text.split()) <= 300 for _, text in parts)
    timeline = [t for p, t in parts if tuple(p) == ("Training postmortem", "Timeline")]
    assert len(timeline) == 2 and all(len(t.split()) >= 180 for t in timeline)   # 480 words, packed
    lessons = [t for p, t in parts if p[-1] == "Lessons"]
    assert len(lessons) == 3 and all(t.endswith(".") for t in lessons)          # cut at sentence ends
    # nothing is lost or duplicated: every body word appears once, in order
    headings = {"# Training postmortem", "## Timeline", "### Day 3 detail", "## Lessons"}
    body = [w for line in doc_with_sections().split("\n") if line not in headings for w in line.split()]
    assert [w for _, t in parts for w in t.split()] == body


def test_code_fences_and_rst_headings():
    md = sections("Title\n=====\n\ntext\n\nPart\n----\n\n```\n# comment\n\nx = 1\n```\n\n# Next\n\nmore\n")
    assert [p for p, _ in md] == [["Title"], ["Title", "Part"], ["Next"]]
    assert md[1][1] == ["```\n# comment\n\nx = 1\n```"]              # a fence is one paragraph, blank lines and all
    rst = sections("=======\nOverview\n=======\n\nintro\n\nSetup\n*****\n\nsteps\n\nDetail\n^^^^^^\n\nx\n\n"
                   "Usage\n*****\n\ny\n")
    assert [p for p, _ in rst] == [["Overview"], ["Overview", "Setup"], ["Overview", "Setup", "Detail"],
                                   ["Overview", "Usage"]]


def test_records_ids_titles_and_front_matter(tmp_path):
    path = tmp_path / "pm.md"
    text = "---\nproject: gpt-small\ntitle: LR sweep postmortem\nruns:\n  - baseline\n---\n" + doc_with_sections()
    path.write_text(text)
    items = list(NotesIngester().read(str(path)))
    assert all(isinstance(i, Parsed) and i.source_kind == "notes" for i in items)
    notes = [i.record for i in items]
    assert [n.chunk for n in notes] == list(range(len(notes)))
    assert all(re.fullmatch(r"pm-[0-9a-f]{8}#\d+", n.id) and n.id.endswith(f"#{n.chunk}") for n in notes)
    assert {n.project for n in notes} == {"gpt-small"}
    assert notes[0].title == "LR sweep postmortem > Training postmortem"
    assert any(n.title == "LR sweep postmortem > Training postmortem > Timeline > Day 3 detail" for n in notes)
    assert all(n.mentions[0] == "baseline" for n in notes)                  # listed in front matter
    # same path: same ids, even after an edit (the chunks update in place); another path: other ids
    again = [i.record.id for i in NotesIngester().read(str(path))]
    assert again == [n.id for n in notes]
    path.write_text(text.replace("intro0", "introduction0"))
    assert [i.record.id for i in NotesIngester().read(str(path))] == again
    other = tmp_path / "sub"
    other.mkdir()
    (other / "pm.md").write_text(text)
    assert {r.id for r in note_records(other / "pm.md", text)}.isdisjoint(again)


def test_a_single_heading_is_the_title_else_the_file_name(tmp_path):
    (only,) = note_records(tmp_path / "design.md", "# Design: data mix\n\nWe use 60% web text.\n")
    assert only.title == "Design: data mix" and only.project == "default"
    parts = note_records(tmp_path / "review.md", "## Pros\n\ngood\n\n## Cons\n\nslow\n")
    assert [p.title for p in parts] == ["review > Pros", "review > Cons"]
    (plain,) = note_records(tmp_path / "ideas.txt", "try a higher lr\non the 350M model\n")
    assert plain.title == "ideas" and plain.text == "try a higher lr\non the 350M model"


def test_mentions_over_collect_run_like_tokens_but_not_prose():
    text = ("Run `lr-sweep-3e-3` diverged at step 1200; we compared it with run baseline and gpt-350m-seed1 "
            "(wandb 1a2b3c4d, mlflow 5f3c2b1a9d8e7f6a5b4c3d2e1f0a9b8c). On 2024-01-05, with Python 3.11, "
            "our state-of-the-art pre-training recipe and run_0042 we run the sweep again.")
    found = mentions(text)
    for expected in ("lr-sweep-3e-3", "baseline", "gpt-350m-seed1", "1a2b3c4d",
                     "5f3c2b1a9d8e7f6a5b4c3d2e1f0a9b8c", "run_0042"):
        assert expected in found
    for absent in ("2024-01-05", "3.11", "state-of-the-art", "pre-training", "the", "Python"):
        assert absent not in found
    assert len(found) == len(set(found))


def test_detection(tmp_path):
    md = tmp_path / "notes.md"
    md.write_text("iter 1: loss 2.0\niter 2: loss 1.9\niter 3: loss 1.8\n")
    assert NotesIngester().detect(str(md)) == 80           # Markdown is a note even when it quotes a log
    log = tmp_path / "out.txt"
    log.write_text("iter 1: loss 2.0\niter 2: loss 1.9\niter 3: loss 1.8\n")
    assert NotesIngester().detect(str(log)) == 0
    prose = tmp_path / "review.txt"
    prose.write_text("The 350M run looked fine until the data loader stalled.\n")
    assert NotesIngester().detect(str(prose)) == 60
    (tmp_path / "requirements.txt").write_text("torch==2.13.0\n")
    assert NotesIngester().detect(str(tmp_path / "requirements.txt")) == 0
    assert NotesIngester().detect(str(tmp_path)) == 0
    (tmp_path / "empty.md").write_text("# Only a heading\n")
    (item,) = NotesIngester().read(str(tmp_path / "empty.md"))
    assert isinstance(item, Rejected) and "empty.md" in str(item.error)


def test_notes_through_the_store_resolve_mentions(engine, tmp_path):
    from kb.models import Note
    from kb.notes import write_note
    from kb.records import parse_run
    from kb.runs import write_run

    with Session(engine) as s, s.begin():
        _, run_id = write_run(s, parse_run({"id": "run-7", "name": "lr-sweep-3e-3", "config": {"lr": 3e-3}}),
                              "native", "test")
    path = tmp_path / "pm.md"
    path.write_text("# PM\n\nRun `lr-sweep-3e-3` diverged; gpt-999m-seed9 never existed.\n")
    (item,) = NotesIngester().read(str(path))
    with Session(engine) as s, s.begin():
        outcome, note_id = write_note(s, item.record, item.source_kind, item.source_uri)
    with Session(engine) as s, s.begin():
        again, _ = write_note(s, item.record, item.source_kind, item.source_uri)
    with Session(engine) as s:
        note = s.get(Note, note_id)
        assert note.mentions == [run_id] and note.title == "PM"
    assert (outcome, again) == ("added", "unchanged") and note_id == item.record.id


def test_kb_ingest_applies_the_project_flag(tmp_path):
    from kb.api import KnowledgeBase
    from kb.models import Note

    path = tmp_path / "design.md"
    path.write_text("# Design\n\n" + words(400, "w") + "\n")
    with KnowledgeBase.open(home=tmp_path / "kb") as k:
        first = k.ingest(str(path), project="gpt-small", index=False)
        second = k.ingest(str(path), project="gpt-small", index=False)
        with Session(k.engine) as s:
            projects = set(s.execute(select(Note.project)).scalars())
    assert first.added == 2 and second.unchanged == 2 and projects == {"gpt-small"}


@pytest.mark.slow         # indexes: the first test to embed loads the model
def test_shorter_document_drops_its_old_chunks(kb, tmp_path):
    doc = tmp_path / "design.md"
    doc.write_text("\n\n".join(f"# Part {i}\n\n" + ("word " * 200) for i in range(4)))
    first = kb.ingest(str(doc))
    assert first.added == 4 and kb.count()["notes"] == 4
    doc.write_text("# Part 0\n\nonly this remains now")
    kb.ingest(str(doc))
    assert kb.count()["notes"] == 1
    assert kb.index.count() == 1
