"""Batch-1 greedy output tok/s with and without n-gram speculative decoding (--speculative-algorithm NGRAM), on
copy-heavy prompts (the answer repeats the prompt) and free prompts, against servers this script starts.

    python benchmarks/bench_speculative_ngram.py [--model HuggingFaceTB/SmolLM2-135M-Instruct] [--max-new-tokens 128]
        [--num-draft-tokens 8]

After one warm-up request, each prompt runs once, one request at a time; the figure is output tokens over wall time.
Every prompt is new to the server, so drafts come from the request itself (a repeated prompt would also be drafted
from the n-gram cache of earlier requests). Outputs of both servers are compared token for token.
"""

from __future__ import annotations

import argparse
import time

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
]
FREE = ["Tell me a story about a dragon who learns to cook.", "Explain how a bicycle works.",
        "Write a poem about autumn leaves."]


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def run(url: str, prompts: list[str], max_new: int) -> tuple[float, list[list[int]], float]:
    """(output tok/s, outputs, mean tokens per decode forward) over one pass of `prompts`, one at a time."""
    params = {"temperature": 0, "max_new_tokens": max_new}
    tokens, forwards, outputs = 0, 0, []
    start = time.perf_counter()
    for p in prompts:
        out = requests.post(f"{url}/generate", json={"text": p, "sampling_params": params}, timeout=600).json()
        outputs.append(out["output_ids"])
        meta = out["meta_info"]
        tokens += meta["completion_tokens"]
        forwards += meta.get("spec_verify_ct", meta["completion_tokens"] - 1)
    elapsed = time.perf_counter() - start
    return tokens / elapsed, outputs, (tokens - len(prompts)) / max(forwards, 1)


Results = dict[tuple[str, str], tuple[float, list[list[int]], float]]


def workloads() -> dict[str, list[str]]:
    return {"copy-heavy": [chat(f"Repeat this text exactly: {t}") for t in TEXTS], "free": [chat(q) for q in FREE]}


def measure(model: str, configs: dict[str, list[str]], max_new: int) -> Results:
    """(config, workload) -> run()'s figures, one server per config (its extra flags), each warmed up first."""
    results: Results = {}
    for name, extra in configs.items():
        url = f"http://127.0.0.1:{find_free_port()}"
        proc = popen_launch_server(model, url, other_args=extra)
        try:
            run(url, [chat("Say hello.")], 8)  # warm-up
            for workload, prompts in workloads().items():
                results[(name, workload)] = run(url, prompts, max_new)
        finally:
            terminate_process(proc)
    return results


def report(results: Results, spec: str, label: str) -> None:
    """One line per workload: config "plain" against config `spec` (named `label`)."""
    for workload in workloads():
        plain, fast = results[("plain", workload)], results[(spec, workload)]
        same = "identical" if plain[1] == fast[1] else "DIFFERENT"
        print(f"{workload}: plain {plain[0]:.1f} tok/s, {label} {fast[0]:.1f} tok/s ({fast[0] / plain[0]:.2f}x), "
              f"{fast[2]:.2f} tokens per decode forward, outputs {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    args = parser.parse_args()
    configs = {"plain": [], "ngram": ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens",
                                      str(args.num_draft_tokens)]}
    results = measure(args.model, configs, args.max_new_tokens)
    print(f"# {args.model}, batch 1, greedy, {args.max_new_tokens} new tokens, "
          f"{args.num_draft_tokens} tokens verified per step")
    report(results, "ngram", "NGRAM")


if __name__ == "__main__":
    main()
