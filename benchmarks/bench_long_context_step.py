"""Decode step time at a long context, per --kv-cache-dtype: the model runner without a server.

Prefills `--batch-size` prompts of `--context` random tokens, then times `--steps` decode steps and reports the
fastest and the median step. Late in a long generation attention is most of a batch-1 step; the fastest step is the
steadier figure on a shared machine (it leaves out steps where a thread was preempted), the median the typical one.

    python benchmarks/bench_long_context_step.py --context 3000 --batch-size 1 4 --kv-dtypes float32 bfloat16
    python benchmarks/bench_long_context_step.py --dtype auto --kv-dtypes auto float32
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
    args = parser.parse_args()
    for kv in args.kv_dtypes:
        server_args = ServerArgs(model_path=args.model_path, dtype=args.dtype, kv_cache_dtype=kv)
        info = load_model_info(server_args)
        need = max(args.batch_size) * (args.context + args.steps + 2) + 64
        runner, mem = build_runner(info, server_args.device, need, max(args.batch_size),
                                   server_args.gguf_kernel_max_rows)
        time_steps(runner, mem, 1, 16, 4)  # warm-up: kernels built, caches touched
        for bs in args.batch_size:
            times = time_steps(runner, mem, bs, args.context, args.steps)
            print(json.dumps({"dtype": args.dtype, "kv_cache_dtype": kv, "batch_size": bs, "context": args.context,
                              "threads": torch.get_num_threads(), "steps": args.steps,
                              "best_step_ms": round(1000 * min(times), 2),
                              "median_step_ms": round(1000 * statistics.median(times), 2)}), flush=True)


if __name__ == "__main__":
    main()
