"""Decode step time at a long context, per --kv-cache-dtype: the model runner without a server.

Prefills `--batch-size` prompts of `--context` random tokens, then times `--steps` decode steps and reports the
fastest and the median step. Late in a long generation attention is most of a batch-1 step; the fastest step is the
steadier figure on a shared machine (it leaves out steps where a thread was preempted), the median the typical one.

    python benchmarks/bench_long_context_step.py --context 3000 --batch-size 1 4 --kv-dtypes float32 bfloat16
    python benchmarks/bench_long_context_step.py --dtype auto --kv-dtypes auto float32
    python benchmarks/bench_long_context_step.py --dtype auto --context 160 --batch-size 16 --steps 10 --alternate 6

With `--alternate N` one runner per KV dtype is built up front and the dtypes take turns, N rounds of --steps
steps each (a fresh prefill per round), so that a noisy machine slows every dtype alike.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from sglang.bench_one_batch import build_runner, prefill_and_decode
from sglang.srt.model_loader.model_info import load_model_info
from sglang.srt.server_args import ServerArgs


def time_steps(runner, mem, batch_size: int, context: int, steps: int) -> list[float]:
    return prefill_and_decode(runner, mem, batch_size, context, steps)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--context", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kv-dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--dtype", default="float32", help="--dtype of the server (auto: the default arithmetic)")
    parser.add_argument("--alternate", type=int, default=0, help="rounds of --steps steps, dtypes taking turns")
    args = parser.parse_args()
    need = max(args.batch_size) * (args.context + args.steps + 2) + 64

    def build(kv: str):
        server_args = ServerArgs(model_path=args.model_path, dtype=args.dtype, kv_cache_dtype=kv)
        runner, mem = build_runner(load_model_info(server_args), server_args.device, need, max(args.batch_size),
                                   server_args.gguf_kernel_max_rows)
        time_steps(runner, mem, 1, 16, 4)  # warm-up: kernels built, caches touched
        return runner, mem

    def report(kv: str, bs: int, times: list[float]) -> None:
        print(json.dumps({"dtype": args.dtype, "kv_cache_dtype": kv, "batch_size": bs, "context": args.context,
                          "threads": torch.get_num_threads(), "steps": len(times),
                          "best_step_ms": round(1000 * min(times), 2),
                          "median_step_ms": round(1000 * statistics.median(times), 2)}), flush=True)

    if args.alternate:
        runners = {kv: build(kv) for kv in args.kv_dtypes}
        for bs in args.batch_size:
            times: dict[str, list[float]] = {kv: [] for kv in runners}
            for _ in range(args.alternate):
                for kv, (runner, mem) in runners.items():
                    times[kv] += time_steps(runner, mem, bs, args.context, args.steps)
            for kv in runners:
                report(kv, bs, times[kv])
        return
    for kv in args.kv_dtypes:
        runner, mem = build(kv)
        for bs in args.batch_size:
            report(kv, bs, time_steps(runner, mem, bs, args.context, args.steps))


if __name__ == "__main__":
    main()
