"""The Chat tab: questions about past experiments answered with citations, and experiment proposals.

One agent per browser session (gr.State), so a follow-up reads the question before it: "best lr
at 125M?" then "and at 350M?". The answer streams in as the agent yields it; each [n] links to
the record it cites (?run=ID opens the Runs tab on that run); the SQL behind a number is folded
under the answer. "Propose experiments" (or a message starting with "propose") asks
KnowledgeBase.propose for three hypotheses towards the goal typed, each a link to the Hypotheses tab.

The agent and propose hold the server's lock (they share the vector index and the LLM with the
REST API and the indexing thread); the lock is held in one worker thread for the whole answer,
because Gradio may step a generator on a different thread each time and an RLock must be
released by the thread that took it.
"""
from __future__ import annotations

import logging
import queue
import re
import threading
from typing import Callable, Iterator

import gradio as gr

from kb.errors import KBError
from kb.ui.answers import answer_markdown, error_markdown, proposals_markdown
from kb.ui.records import esc

log = logging.getLogger(__name__)

ID, TITLE = "chat", "Chat"
PROPOSALS = 3
PROPOSE = re.compile(r"^\s*(?:please\s+)?(?:propose|suggest)\b[\s:,-]*(?:(?:experiments?|hypothes[ie]s)\b)?"
                     r"[\s:,-]*(?:(?:to|for)\b)?[\s:,-]*", re.I)
EXAMPLES = ["Which learning rate gave the lowest val/loss?", "Which runs diverged, and why?",
            "What do we know about warmup?", "Propose experiments to lower val/loss"]
THINKING = "_Searching the knowledge base…_"


def locked_stream(lock: threading.RLock, make: Callable[[], Iterator]) -> Iterator:
    """Iterate `make()` in a worker thread that holds `lock` throughout, yielding its items here as
    they come; an exception it raises is raised here."""
    items: queue.Queue = queue.Queue()

    def work():
        try:
            with lock:
                for item in make():
                    items.put(("item", item))
        except BaseException as exc:            # noqa: BLE001 - handed to the consumer
            items.put(("error", exc))
        else:
            items.put(("done", None))

    threading.Thread(target=work, name="kb-ui-agent", daemon=True).start()
    while True:
        tag, value = items.get()
        if tag == "item":
            yield value
        elif tag == "error":
            raise value
        else:
            return


def proposal_goal(message: str) -> str | None:
    """The goal of a message that asks for proposals ("propose experiments to lower val/loss" ->
    "lower val/loss"), or None for a question."""
    m = PROPOSE.match(message)
    return message[m.end():].strip() if m else None


def build(ui) -> None:
    agent = gr.State(None)          # agents.answer.Agent, made on this session's first question
    gr.Markdown("Ask about past experiments: every sentence of an answer cites the runs, notes, ablations "
                "or failures it rests on (click a citation to open the record). Follow-up questions "
                "keep the context. **Propose experiments** turns what you type into a goal for new "
                "hypotheses.")
    chatbot = gr.Chatbot(label="Knowledge base", height=560, latex_delimiters=[], feedback_options=None,
                         buttons=["copy"], placeholder="Ask a question about your training runs.",
                         examples=[{"text": e} for e in EXAMPLES], elem_id="kb-chat")
    with gr.Row():
        box = gr.Textbox(placeholder="e.g. Which learning rate diverged at 350M?", show_label=False,
                         scale=8, lines=1, max_lines=4, autofocus=True, elem_id="kb-chat-input")
        ask = gr.Button("Ask", variant="primary", size="md", scale=0, min_width=100)
        propose = gr.Button("Propose experiments", size="md", scale=0, min_width=190)
        clear = gr.Button("New conversation", size="md", scale=0, min_width=170)

    def respond(message: str, history: list, state):
        message = (message or "").strip()
        history = list(history or [])
        if not message:
            yield history, "", state
            return
        goal = proposal_goal(message)
        if goal is not None:
            yield from proposals(goal, history + [{"role": "user", "content": message}], state)
            return
        history += [{"role": "user", "content": message}, {"role": "assistant", "content": THINKING}]
        yield history, "", state
        holder = [state]

        def pieces():
            ui.kb.try_sync_index()      # what other processes queued is searched too, as /api/ask does
            if holder[0] is None:
                holder[0] = ui.kb.chat()
            yield from holder[0].stream(message)

        text = ""
        try:
            for piece in locked_stream(ui.lock, pieces):
                text += piece
                history[-1] = {"role": "assistant", "content": esc(text) + " ▍"}
                yield history, "", holder[0]
            answer = holder[0].history[-1].answer.as_dict()
            history[-1] = {"role": "assistant", "content": answer_markdown(answer)}
        except KBError as exc:
            history[-1] = {"role": "assistant", "content": error_markdown(str(exc))}
        except Exception as exc:            # noqa: BLE001 - one line in the chat, never a traceback
            log.exception("chat answer failed")
            history[-1] = {"role": "assistant", "content": error_markdown(f"{type(exc).__name__}: {exc}")}
        yield history, "", holder[0]

    def proposals(goal: str, history: list, state):
        history = history + [{"role": "assistant", "content": "_Looking for experiments worth running…_"}]
        yield history, "", state
        try:
            found = ui.locked(ui.kb.propose, goal=goal, n=PROPOSALS)
            history[-1] = {"role": "assistant", "content": proposals_markdown(found, goal)}
        except KBError as exc:
            history[-1] = {"role": "assistant", "content": error_markdown(str(exc))}
        except Exception as exc:            # noqa: BLE001
            log.exception("propose failed")
            history[-1] = {"role": "assistant", "content": error_markdown(f"{type(exc).__name__}: {exc}")}
        yield history, "", state

    def propose_clicked(message: str, history: list, state):
        goal = (message or "").strip()
        shown = f"Propose experiments{': ' + goal if goal else ''}"
        yield from proposals(goal, list(history or []) + [{"role": "user", "content": shown}], state)

    def example(evt: gr.SelectData, history: list, state):
        value = evt.value
        yield from respond(value.get("text", "") if isinstance(value, dict) else str(value), history, state)

    outputs = [chatbot, box, agent]
    ask.click(respond, [box, chatbot, agent], outputs)
    box.submit(respond, [box, chatbot, agent], outputs)
    propose.click(propose_clicked, [box, chatbot, agent], outputs)
    chatbot.example_select(example, [chatbot, agent], outputs)
    clear.click(lambda: ([], "", None), None, outputs)
