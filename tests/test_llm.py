"""The LLM backends (agents/llm.py, agents/llamacpp.py) on real models: SmolLM2's GGUF run in-process by llama.cpp,
the same GGUF served over HTTP by llama.cpp's own OpenAI-compatible server for OpenAILike, and a
tiny Hugging Face model written here by transformers for HuggingFaceLLM.

    pytest tests/test_llm.py -q            (-m "not slow" skips the ones that load a model)
"""
from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from llama_index.core.callbacks import CallbackManager, EventPayload, LlamaDebugHandler
from llama_index.core.llms import ChatMessage

from agents.llamacpp import MAX_CONTEXT, EmbeddedLLM, default_gguf, gguf_context_length
from agents.llm import _parse_valid, complete_json, get_llm, schema_problem
from kb.errors import LLMError, LLMOutputInvalid
from kb.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is the capital of France? Answer in one word."
RUN_SCHEMA = {
    "type": "object",
    "properties": {"run": {"type": "string"}, "lr": {"type": "number"}},
    "required": ["run", "lr"],
    "additionalProperties": False,
}
# the shape the answering agent asks for: sentences, each with the sources it rests on
SENTENCES_SCHEMA = {
    "type": "object",
    "properties": {"sentences": {"type": "array", "maxItems": 3, "items": {
        "type": "object",
        "properties": {"text": {"type": "string", "maxLength": 200},
                       "sources": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
        "required": ["text", "sources"]}}},
    "required": ["sentences"],
}


def embedded_settings(**kw) -> Settings:
    return Settings(llm_backend="llamacpp", llm_model=None, threads=1, **kw)


@pytest.fixture(scope="module")
def embedded():
    return get_llm(embedded_settings())


# ---- the embedded default -------------------------------------------------------------------

@pytest.mark.slow
def test_embedded_model_answers_a_short_prompt(embedded):
    assert isinstance(embedded, EmbeddedLLM)
    assert embedded.metadata.is_chat_model
    answer = embedded.complete(QUESTION, max_tokens=16).text
    assert "Paris" in answer
    # deterministic: temperature 0 and a fixed seed give the same text again
    assert embedded.complete(QUESTION, max_tokens=16).text == answer


@pytest.mark.slow
def test_stream_yields_tokens_that_add_up_to_the_complete_text(embedded):
    prompt = "Name three colours, one per line."
    full = embedded.complete(prompt, max_tokens=24).text
    chunks = list(embedded.stream_complete(prompt, max_tokens=24))
    assert len(chunks) >= 5                               # token by token, not one block
    assert "".join(c.delta for c in chunks) == full
    assert chunks[-1].text == full

    messages = [ChatMessage(role="system", content="You are brief."),
                ChatMessage(role="user", content=prompt)]
    said = embedded.chat(messages, max_tokens=24).message.content
    streamed = list(embedded.stream_chat(messages, max_tokens=24))
    assert len(streamed) >= 5
    assert "".join(r.delta for r in streamed) == said == streamed[-1].message.content


@pytest.mark.slow
def test_a_stream_abandoned_early_stops_and_leaves_the_model_usable(embedded):
    stream = embedded.stream_complete("Write a long story about a dragon.", max_tokens=300)
    first = next(stream)
    stream.close()                        # the worker thread must end, not hang or keep generating
    assert first.delta
    assert "Paris" in embedded.complete(QUESTION, max_tokens=16).text


@pytest.mark.slow
def test_complete_json_returns_a_dict_that_fits_the_schema(embedded):
    out = complete_json(embedded, "Run lr-3e-4 used learning rate 0.0003. Give the run id and its lr.",
                        RUN_SCHEMA)
    assert set(out) == {"run", "lr"} and schema_problem(out, RUN_SCHEMA) is None
    assert isinstance(out["lr"], float)

    messages = [{"role": "system", "content": "Answer from the numbered sources; cite them."},
                {"role": "user", "content": "[1] run lr-3e-4 reached val/loss 3.28.\n"
                                            "Question: what val loss did lr-3e-4 reach?"}]
    out = complete_json(embedded, messages, SENTENCES_SCHEMA, max_tokens=160)
    assert schema_problem(out, SENTENCES_SCHEMA) is None


@pytest.mark.slow
def test_json_cut_off_by_max_tokens_is_a_clear_error(embedded):
    with pytest.raises(LLMOutputInvalid) as err:
        complete_json(embedded, "Give the run id lr-3e-4 and its lr 0.0003.", RUN_SCHEMA, max_tokens=3)
    assert "\n" not in str(err.value) and "not JSON matching the schema" in str(err.value)


@pytest.mark.slow
def test_the_model_loads_once_per_process(embedded):
    assert get_llm(embedded_settings()) is embedded
    server = embedded.load()
    # another EmbeddedLLM over the same file and threads shares the loaded model
    twin = EmbeddedLLM(model_path=embedded.model_path, threads=1)
    assert twin.load() is server and embedded.load() is server


@pytest.mark.slow
def test_llama_index_callbacks_see_each_call(embedded):
    debug = LlamaDebugHandler()
    llm = EmbeddedLLM(model_path=embedded.model_path, threads=1,
                      callback_manager=CallbackManager([debug]))
    llm.chat([ChatMessage(role="user", content=QUESTION)], max_tokens=8)
    list(llm.stream_complete(QUESTION, max_tokens=8))
    assert len(debug.get_llm_inputs_outputs()) == 2


def test_nothing_loads_at_import_or_in_get_llm():
    code = ("import sys, agents.llm, agents.llamacpp; from kb.settings import Settings; "
            "agents.llm.get_llm(Settings(llm_backend='llamacpp', llm_model=None)); "
            "print(json.dumps([n in sys.modules for n in ('xllamacpp', 'torch', 'openai', 'transformers')]"
            " + [len(agents.llamacpp._SERVERS)]))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, False, False, False, 0]


# ---- errors ---------------------------------------------------------------------------------

def test_a_missing_model_is_one_clear_line(tmp_path):
    missing = tmp_path / "nowhere.gguf"
    with pytest.raises(LLMError) as err:
        get_llm(Settings(llm_backend="llamacpp", llm_model=str(missing)))
    assert str(missing) in str(err.value) and "\n" not in str(err.value)


def test_a_file_that_is_not_a_gguf_fails_on_first_use_in_one_line(tmp_path):
    bogus = tmp_path / "notes.gguf"
    bogus.write_text("not a model\n")
    llm = get_llm(Settings(llm_backend="llamacpp", llm_model=str(bogus)))   # lazy: nothing loaded yet
    with pytest.raises(LLMError) as err:
        llm.complete("hello")
    assert str(bogus) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("settings, says", [
    (dict(llm_backend="gpt5"), "known: ['hf', 'llamacpp', 'openai']"),
    (dict(llm_backend="openai", llm_model="m"), "KB_LLM_BASE_URL"),
    (dict(llm_backend="openai", llm_base_url="http://127.0.0.1:9/v1"), "KB_LLM_MODEL"),
    (dict(llm_backend="hf"), "KB_LLM_MODEL"),
    (dict(llm_backend="hf", llm_model="/no/such/model"), "no Hugging Face model folder at /no/such/model"),
])
def test_a_backend_misconfigured_is_one_clear_line(settings, says):
    with pytest.raises(LLMError) as err:
        get_llm(Settings(**settings))
    assert says in str(err.value) and "\n" not in str(err.value)


# ---- the GGUF header and JSON checks (no model run) ---------------------------------------------

def test_context_window_comes_from_the_gguf_header(tmp_path):
    path = str(default_gguf())
    assert gguf_context_length(path) == 8192                  # SmolLM2-135M was trained on 8k
    assert EmbeddedLLM(model_path=path).metadata.context_window == min(8192, MAX_CONTEXT)
    other = tmp_path / "x.gguf"
    other.write_bytes(b"GGML" + bytes(64))
    assert gguf_context_length(str(other)) is None


def test_schema_problems_are_named_by_path():
    good = {"sentences": [{"text": "lr 3e-4 was best.", "sources": [1, 2]}]}
    assert schema_problem(good, SENTENCES_SCHEMA) is None
    assert schema_problem({}, SENTENCES_SCHEMA) == "$.sentences: missing"
    assert schema_problem({"sentences": [{"text": "x", "sources": ["1"]}]}, SENTENCES_SCHEMA) == \
        "$.sentences[0].sources[0]: expected integer, got string"
    assert schema_problem({"sentences": [good["sentences"][0]] * 4}, SENTENCES_SCHEMA) == \
        "$.sentences: more than 3 items"
    assert schema_problem({"run": "a", "lr": 1, "x": 2}, RUN_SCHEMA) == "$.x: not allowed"
    assert schema_problem({"run": "a", "lr": True}, RUN_SCHEMA) == "$.lr: expected number, got boolean"
    assert schema_problem({"run": "a" * 201}, {"properties": {"run": {"maxLength": 200}}}) == \
        "$.run: longer than 200 characters"


def test_json_is_found_inside_prose_or_a_code_fence():
    text = 'Sure! Here it is:\n```json\n{"run": "lr-3e-4", "lr": 0.0003}\n```'
    assert _parse_valid(text, RUN_SCHEMA) == {"run": "lr-3e-4", "lr": 0.0003}
    with pytest.raises(LLMOutputInvalid, match=r"\$\.lr: missing"):
        _parse_valid('{"run": "lr-3e-4"}', RUN_SCHEMA)
    with pytest.raises(LLMOutputInvalid, match="no JSON object"):
        _parse_valid("I cannot answer that.", RUN_SCHEMA)


# ---- OpenAI-compatible endpoint, over real HTTP ---------------------------------------------------

@pytest.fixture(scope="module")
def llama_cpp_http_server():
    """llama.cpp's own OpenAI-compatible HTTP server (xllamacpp starts it with every Server) on a
    free loopback port with SmolLM2's GGUF and an API key: a real endpoint, as vLLM or Ollama
    would be."""
    xlc = pytest.importorskip("xllamacpp")
    params = xlc.CommonParams()
    params.model.path = str(default_gguf())
    params.n_ctx = 2048
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = 1
    params.verbosity = -1
    params.warmup = False
    params.hostnames = ["127.0.0.1"]
    params.port = 0                       # the OS picks a free port; listening_address names it
    key = secrets.token_hex(8)
    params.api_keys = [key]
    server = xlc.Server(params)
    yield server.listening_address, key
    del server


@pytest.mark.slow
def test_openai_like_talks_to_an_openai_compatible_server(llama_cpp_http_server, embedded):
    pytest.importorskip("llama_index.llms.openai_like", reason="needs the `openai` extra")
    url, key = llama_cpp_http_server
    llm = get_llm(Settings(llm_backend="openai", llm_base_url=f"{url}/v1", llm_model="smollm2",
                           llm_api_key=key))
    assert type(llm).__name__ == "OpenAILike" and llm.metadata.is_chat_model
    answer = llm.complete(QUESTION).text
    # same weights, same template, greedy: the endpoint says what the in-process model says
    assert "Paris" in answer and answer == embedded.complete(QUESTION).text
    chunks = list(llm.stream_chat([ChatMessage(role="user", content=QUESTION)]))
    assert len(chunks) >= 3 and "".join(c.delta for c in chunks) == answer

    out = complete_json(llm, "Run lr-3e-4 used learning rate 0.0003. Give the run id and its lr.",
                        RUN_SCHEMA)
    assert set(out) == {"run", "lr"} and schema_problem(out, RUN_SCHEMA) is None


# ---- Hugging Face, on a tiny model written here ------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_hf_model(tmp_path_factory):
    """A 1-layer Llama with random weights and a 16-word tokenizer, saved by transformers itself:
    a real local HF model folder, so the hf backend runs here with no download (SmolLM2 only
    ships as a GGUF, which transformers takes ~23 s to dequantize)."""
    pytest.importorskip("llama_index.llms.huggingface", reason="needs the `hf` extra")
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    words = ["<unk>", "<s>", "</s>", "user", "assistant", "system", "{", "}", '"', ":",
             "run", "lr", "hello", "the", "loss", "0.0003"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% endif %}")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2, pad_token_id=0))
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_hf_backend_runs_a_local_model_and_retries_json_once(tiny_hf_model):
    llm = get_llm(Settings(llm_backend="hf", llm_model=str(tiny_hf_model), threads=1))
    assert type(llm).__name__ == "HuggingFaceLLM"
    assert llm.metadata.context_window == 128 and llm.metadata.is_chat_model
    text = llm.complete("hello the loss").text
    assert isinstance(text, str) and text == llm.complete("hello the loss").text     # greedy
    debug = LlamaDebugHandler()
    llm.callback_manager = CallbackManager([debug])
    # random weights never write valid JSON: the prompt, one retry naming the fault, then the error
    with pytest.raises(LLMOutputInvalid) as err:
        complete_json(llm, "hello", RUN_SCHEMA)
    assert "\n" not in str(err.value)
    # HuggingFaceLLM's chat calls its complete: count the chat calls, the ones carrying messages
    chats = [start for start, _ in debug.get_llm_inputs_outputs() if EventPayload.MESSAGES in start.payload]
    assert len(chats) == 2
    assert "not valid" in chats[1].payload[EventPayload.MESSAGES][-1].content    # the retry says why
