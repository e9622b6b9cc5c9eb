"""The embedded LLM's speed on CPU: load time, and the latency of a short RAG-like prompt
(~300 tokens of retrieved run records in, 40 tokens out), with llama.cpp's own token rates.

    .venv/bin/python benchmarks/llm_latency.py [--threads 1] [--repeats 7] [--json]

Every request evaluates its whole prompt (no prompt cache), as a new question with new sources
would; generation runs to exactly --out tokens (end-of-text ignored) so runs compare. Beside wall
time it prints the process's CPU time per request: on a machine whose cores other work keeps
busy, that is what the request would take on a quiet core.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from llama_index.core.llms import ChatMessage

from agents.llamacpp import EmbeddedLLM, default_gguf


def rag_prompt(i: int) -> list[ChatMessage]:
    records = "\n".join(
        f"[{n}] run gpt-small-lr{n}e-4 (project gpt-small): 125M params, 2.5B tokens, lr {n}e-4, "
        f"warmup 200 steps, batch 256, val/loss {3.05 + 0.04 * ((n * 7 + i) % 9):.2f}, status completed."
        for n in range(1, 5))
    question = f"Which learning rate gave the lowest val loss for the 125M runs? (asked {i})"
    return [ChatMessage(role="system", content="Answer only from the numbered sources and cite them."),
            ChatMessage(role="user", content=f"<sources>\n{records}\n</sources>\n\nQuestion: {question}")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=int, default=40, help="tokens generated per request")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    llm = EmbeddedLLM(model_path=str(default_gguf()), threads=args.threads, verbose=False)
    t0, c0 = time.perf_counter(), time.process_time()
    llm.load()
    load_s, load_cpu_s = time.perf_counter() - t0, time.process_time() - c0

    rows = []
    for i in range(args.repeats + 1):             # the first request warms caches: not counted
        t0, c0 = time.perf_counter(), time.process_time()
        raw = llm.chat(rag_prompt(i), max_tokens=args.out, ignore_eos=True, cache_prompt=False).raw
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if i:
            t = raw["timings"]
            rows.append({"s": wall, "cpu_s": cpu, "prompt_tokens": t["prompt_n"], "out_tokens": t["predicted_n"],
                         "prompt_tok_s": t["prompt_per_second"], "gen_tok_s": t["predicted_per_second"]})
    result = {
        "model": default_gguf().name, "threads": args.threads, "load_s": round(load_s, 3),
        "load_cpu_s": round(load_cpu_s, 3),
        "requests": len(rows),
        "prompt_tokens": rows[0]["prompt_tokens"], "out_tokens": rows[0]["out_tokens"],
        "p50_s": round(statistics.median(r["s"] for r in rows), 3),
        "max_s": round(max(r["s"] for r in rows), 3),
        "p50_cpu_s": round(statistics.median(r["cpu_s"] for r in rows), 3),
        "prompt_tok_s": round(statistics.median(r["prompt_tok_s"] for r in rows), 1),
        "gen_tok_s": round(statistics.median(r["gen_tok_s"] for r in rows), 1),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['model']}, {args.threads} thread(s): load {result['load_s']:.2f} s "
          f"(CPU {result['load_cpu_s']:.2f} s)")
    print(f"RAG-like prompt, {result['prompt_tokens']} tokens in, {result['out_tokens']} out, "
          f"{result['requests']} requests: p50 {result['p50_s']:.2f} s (max {result['max_s']:.2f} s), "
          f"p50 CPU time {result['p50_cpu_s']:.2f} s")
    print(f"prompt eval {result['prompt_tok_s']:.0f} tokens/s, generation {result['gen_tok_s']:.1f} tokens/s")


if __name__ == "__main__":
    main()
