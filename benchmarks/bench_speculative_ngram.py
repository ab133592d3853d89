"""Batch-1 greedy output tok/s with and without n-gram speculative decoding (--speculative-algorithm NGRAM), on
copy-heavy prompts (the answer repeats the prompt) and free prompts, against servers this script starts.

    python benchmarks/bench_speculative_ngram.py [--model HuggingFaceTB/SmolLM2-135M-Instruct] [--max-new-tokens 128]
        [--num-draft-tokens N] [--tree-breadth 10] [--rounds 1]

With --tree-breadth a third server drafts trees of that breadth (--speculative-ngram-max-bfs-breadth; SGLang's
default is 10) beside the default (chains on CPU).

All servers are started first (each warmed up by one request); then each workload runs on one server after the
other: each prompt once, one request at a time (then the 16-concurrent workload: 16 prompts at once), streamed; the
figures are output tokens over wall time, and decoding alone: the tokens after the first over the time after the
first token (no prefill), summed over the requests. Each workload starts from flushed caches, so every prompt is new
to the servers and drafts come from the request itself (within a workload, finished requests join NGRAM's cache).
With --rounds N all of it runs N times, the servers still in turn. Outputs are compared token for token.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from sglang.test.test_utils import find_free_port, popen_launch_server
from sglang.utils import terminate_process

TEXTS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the fox runs into the forest, "
    "where the birds sing and the river flows past the old mill. In the evening the miller closes the gates, counts "
    "the sacks of flour and walks home along the river, where the fox watches him from the reeds.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
    "def fact(n):\n    return 1 if n < 2 else n * fact(n - 1)\n\n"
    "for i in range(10):\n    print(i, fib(i), fact(i))\n",
    "Alice went to the market to buy apples, bread and milk. On her way home she met Bob, who was walking his cat "
    "along the river. They talked about the weather, the coming festival and the new bakery near the station, which "
    "sells the best bread in town. Then Alice went home and baked an apple pie for her family.",
    "SELECT users.name, orders.total FROM users JOIN orders ON orders.user_id = users.id WHERE orders.total > 100 "
    "ORDER BY orders.total DESC LIMIT 10;",
    "The museum opens at nine in the morning and closes at six in the evening. Tickets cost twelve dollars for "
    "adults and six dollars for children. Guided tours start every hour from the main hall.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
]
FREE = ["Tell me a story about a dragon who learns to cook.", "Explain how a bicycle works.",
        "Write a poem about autumn leaves.", "What should I pack for a week at the beach?",
        "Describe your ideal weekend.", "Why is the sky blue?"]


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def one(url: str, prompt: str, max_new: int) -> tuple[dict, float]:
    """The last streamed chunk of a greedy request, and the time from its first chunk to its end."""
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": max_new}, "stream": True}
    first, last = None, {}
    with requests.post(f"{url}/generate", json=body, timeout=600, stream=True) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                first = first or time.perf_counter()
                last = json.loads(line[6:])
    return last, time.perf_counter() - (first or time.perf_counter())


def run(url: str, prompts: list[str], max_new: int, concurrency: int = 1
        ) -> tuple[float, list[list[int]], float, float]:
    """(output tok/s, outputs, mean tokens per decode forward, decode tok/s: the tokens after the first over the time
    after the first, summed over the requests) over one pass of `prompts`, `concurrency` at a time, streamed."""
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda p: one(url, p, max_new), prompts))
    elapsed = time.perf_counter() - start
    metas = [last["meta_info"] for last, _ in done]
    tokens = sum(m["completion_tokens"] for m in metas)
    forwards = sum(m.get("spec_verify_ct", m["completion_tokens"] - 1) for m in metas)
    decode_time = sum(t for _, t in done)
    return (tokens / elapsed, [last["output_ids"] for last, _ in done], (tokens - len(prompts)) / max(forwards, 1),
            (tokens - len(prompts)) / decode_time)


Results = dict[tuple[str, str], tuple[float, list[list[int]], float, float]]


def workloads() -> dict[str, list[str]]:
    """Batch 1: copy-heavy and free prompts; then both kinds, 16 at a time (NGRAM pauses above 4 running)."""
    copy = [chat(f"Repeat this text exactly: {t}") for t in TEXTS]
    free = [chat(q) for q in FREE]
    mixed = copy + free + [chat(f"Copy this, word for word: {t}") for t in TEXTS[:2]] + [
        chat(f"{q} Answer in two sentences.") for q in FREE[:2]]
    return {"copy-heavy": copy, "free": free, "16 concurrent": mixed}


CONCURRENCY = {"16 concurrent": 16}


# Each server's KV pool: all of them are up at once (plenty for these prompts).
KV_TOKENS = 65536


def measure(model: str, configs: dict[str, list[str]], max_new: int, rounds: int) -> list[Results]:
    """Per round, (config, workload) -> run()'s figures. One server per config (its extra flags), all started first
    and warmed up; each round runs every workload on every server in turn, so that a drift of the machine's speed
    falls on all configurations alike. Each workload starts from flushed caches (/flush_cache: the prefix cache and
    NGRAM's cache of earlier requests), so every round's prompts are new to the servers."""
    servers = {}
    try:
        for name, extra in configs.items():
            url = f"http://127.0.0.1:{find_free_port()}"
            servers[name] = (url, popen_launch_server(model, url, other_args=[
                *extra, "--max-total-tokens", str(KV_TOKENS)]))
            run(url, [chat("Say hello.")], 8)  # warm-up
        out = []
        for _ in range(rounds):
            results: Results = {}
            for workload, prompts in workloads().items():
                for name, (url, _proc) in servers.items():
                    requests.post(f"{url}/flush_cache", timeout=60).raise_for_status()
                    results[(name, workload)] = run(url, prompts, max_new, CONCURRENCY.get(workload, 1))
            out.append(results)
        return out
    finally:
        for _url, proc in servers.values():
            terminate_process(proc)


def report(results: Results, spec: str, label: str) -> None:
    """One line per workload: config "plain" against config `spec` (named `label`)."""
    for workload in workloads():
        plain, fast = results[("plain", workload)], results[(spec, workload)]
        same = "identical" if plain[1] == fast[1] else "DIFFERENT"
        print(f"{workload}: plain {plain[0]:.1f} tok/s, {label} {fast[0]:.1f} tok/s ({fast[0] / plain[0]:.2f}x), "
              f"decoding alone {plain[3]:.1f} vs {fast[3]:.1f} tok/s ({fast[3] / plain[3]:.2f}x), "
              f"{fast[2]:.2f} tokens per decode forward, outputs {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=None,
                        help="--speculative-num-draft-tokens (default: the server's, 8 or 4 on a CPU without VNNI)")
    parser.add_argument("--tree-breadth", type=int, default=0, help="also a server drafting trees of this breadth")
    parser.add_argument("--rounds", type=int, default=1, help="passes over the workloads, servers in turn")
    args = parser.parse_args()
    ngram = ["--speculative-algorithm", "NGRAM"]
    if args.num_draft_tokens is not None:
        ngram += ["--speculative-num-draft-tokens", str(args.num_draft_tokens)]
    configs = {"plain": [], "ngram": ngram}
    if args.tree_breadth:
        configs["tree"] = [*ngram, "--speculative-ngram-max-bfs-breadth", str(args.tree_breadth)]
    rounds = measure(args.model, configs, args.max_new_tokens, args.rounds)
    per_step = (f"up to {args.num_draft_tokens} tokens" if args.num_draft_tokens
                else "the server's default number of tokens")
    print(f"# {args.model}, batch 1, greedy, {args.max_new_tokens} new tokens, {per_step} verified per step")
    for i, results in enumerate(rounds):
        print(f"## round {i + 1}")
        report(results, "ngram", "NGRAM")
        if args.tree_breadth:
            report(results, "tree", f"NGRAM trees of breadth {args.tree_breadth}")


if __name__ == "__main__":
    main()
