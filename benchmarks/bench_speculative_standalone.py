"""Batch-1 greedy output tok/s with and without draft-model speculative decoding (--speculative-algorithm
STANDALONE), on copy-heavy and free prompts, against servers this script starts.

    python benchmarks/bench_speculative_standalone.py [--model HuggingFaceTB/SmolLM2-135M-Instruct]
        [--target-args "--dtype float32 --gguf-kernel-max-rows 0"] [--draft HuggingFaceTB/SmolLM2-135M-Instruct]
        [--num-steps 3] [--max-new-tokens 128]

By default the served model is SmolLM2-135M in dense float32 (its GGUF file's values, no GGUF blocks: every decode
step reads 0.5 GB of weights) and the draft is the same GGUF file loaded as the engine loads it by default (Q4_1
blocks, the fused decode step; the served model's weight flags do not apply to the draft): same vocabulary, close
predictions. The prompts,
the warm-up and the measurement are those of bench_speculative_ngram.py; outputs of both servers are compared
token for token.
"""

from __future__ import annotations

import argparse
import shlex

from bench_speculative_ngram import FREE, TEXTS, chat, run

from sglang.test.test_utils import find_free_port, popen_launch_server
from sglang.utils import terminate_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--target-args", default="--dtype float32 --gguf-kernel-max-rows 0",
                        help="server flags of the served model, for both servers")
    parser.add_argument("--draft", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--num-steps", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    workloads = {"copy-heavy": [chat(f"Repeat this text exactly: {t}") for t in TEXTS], "free": [chat(q) for q in FREE]}
    served = shlex.split(args.target_args)
    configs = {"plain": served,
               "standalone": [*served, "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
                              args.draft, "--speculative-num-steps", str(args.num_steps)]}
    results: dict[tuple[str, str], tuple[float, list[list[int]], float]] = {}
    for name, extra in configs.items():
        url = f"http://127.0.0.1:{find_free_port()}"
        proc = popen_launch_server(args.model, url, other_args=extra)
        try:
            run(url, [chat("Say hello.")], 8)  # warm-up
            for workload, prompts in workloads.items():
                results[(name, workload)] = run(url, prompts, args.max_new_tokens)
        finally:
            terminate_process(proc)
    print(f"# {args.model} ({args.target_args}) drafted by {args.draft}, batch 1, greedy, "
          f"{args.max_new_tokens} new tokens, {args.num_steps} draft tokens per step")
    for workload in workloads:
        plain, spec = results[("plain", workload)], results[("standalone", workload)]
        same = "identical" if plain[1] == spec[1] else "DIFFERENT"
        print(f"{workload}: plain {plain[0]:.1f} tok/s, STANDALONE {spec[0]:.1f} tok/s "
              f"({spec[0] / plain[0]:.2f}x), {spec[2]:.2f} tokens per decode forward, outputs {same}")


if __name__ == "__main__":
    main()
