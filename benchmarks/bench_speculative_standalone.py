"""Batch-1 greedy output tok/s with and without draft-model speculative decoding (--speculative-algorithm
STANDALONE), on copy-heavy and free prompts, against servers this script starts.

    python benchmarks/bench_speculative_standalone.py [--model HuggingFaceTB/SmolLM2-135M-Instruct]
        [--target-args "--dtype float32 --gguf-kernel-max-rows 0"] [--draft HuggingFaceTB/SmolLM2-135M-Instruct]
        [--num-steps 3] [--max-new-tokens 128] [--topk 4 --num-draft-tokens 8] [--rounds 1]

With --topk above 1 a third server drafts trees (--speculative-eagle-topk, --speculative-num-draft-tokens).

By default the served model is SmolLM2-135M in dense float32 (its GGUF file's values, no GGUF blocks: every decode
step reads 0.5 GB of weights) and the draft is the same GGUF file loaded as the engine loads it by default (Q4_1
blocks, the fused decode step; the served model's weight flags do not apply to the draft): same vocabulary, close
predictions. The prompts,
the warm-up and the measurement (all servers up, in turn per workload, caches flushed) are those of
bench_speculative_ngram.py; outputs of both servers are compared
token for token.
"""

from __future__ import annotations

import argparse
import shlex

from bench_speculative_ngram import measure, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--target-args", default="--dtype float32 --gguf-kernel-max-rows 0",
                        help="server flags of the served model, for both servers")
    parser.add_argument("--draft", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--num-steps", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--topk", type=int, default=1)
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1, help="passes over the workloads, servers in turn")
    args = parser.parse_args()
    served = shlex.split(args.target_args)
    configs = {"plain": served,
               "standalone": [*served, "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
                              args.draft, "--speculative-num-steps", str(args.num_steps)]}
    if args.topk > 1:
        configs["tree"] = [*configs["standalone"], "--speculative-eagle-topk", str(args.topk),
                           "--speculative-num-draft-tokens", str(args.num_draft_tokens)]
    print(f"# {args.model} ({args.target_args}) drafted by {args.draft}, batch 1, greedy, "
          f"{args.max_new_tokens} new tokens, {args.num_steps} draft tokens per step")
    for i, results in enumerate(measure(args.model, configs, args.max_new_tokens, args.rounds)):
        print(f"## round {i + 1}")
        report(results, "standalone", "STANDALONE")
        if args.topk > 1:
            report(results, "tree", f"STANDALONE top-{args.topk} trees of {args.num_draft_tokens - 1} nodes")


if __name__ == "__main__":
    main()
