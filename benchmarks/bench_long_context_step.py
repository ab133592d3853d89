"""Decode step time at a long context, per --kv-cache-dtype: the model runner without a server.

Prefills `--batch-size` prompts of `--context` random tokens, then times `--steps` decode steps and reports the
fastest and the median step. Late in a long generation attention is most of a batch-1 step; the fastest step is the
steadier figure on a shared machine (it leaves out steps where a thread was preempted), the median the typical one.

    python benchmarks/bench_long_context_step.py --context 3000 --batch-size 1 4 --kv-dtypes float32 bfloat16
    python benchmarks/bench_long_context_step.py --dtype auto --kv-dtypes auto float32
    python benchmarks/bench_long_context_step.py --dtype auto --context 160 --batch-size 16 --steps 10 --alternate 6

With `--alternate N` one runner per KV dtype is built up front and the dtypes take turns, N rounds of --steps
steps each (a fresh prefill per round), so that a noisy machine slows every dtype alike. `--kv-layouts head-major
slot-major` runs each KV dtype with both K/V pool layouts (head-major is the pool's default on CPU, mem_cache/kv_pool.py).

    python benchmarks/bench_long_context_step.py --dtype auto --kv-dtypes auto --batch-size 1 \
        --kv-layouts head-major slot-major --alternate 6 --steps 20
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from sglang.bench_one_batch import build_runner, prefill_and_decode
from sglang.srt.mem_cache.kv_pool import KVPool
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
    parser.add_argument("--kv-layouts", nargs="+", choices=["head-major", "slot-major"], default=["head-major"])
    args = parser.parse_args()
    variants = [(kv, layout) for kv in args.kv_dtypes for layout in args.kv_layouts]
    need = max(args.batch_size) * (args.context + args.steps + 2) + 64

    def build(variant: tuple[str, str]):
        kv, layout = variant
        server_args = ServerArgs(model_path=args.model_path, dtype=args.dtype, kv_cache_dtype=kv)
        runner, mem = build_runner(load_model_info(server_args), server_args.device, need, max(args.batch_size),
                                   server_args.gguf_kernel_max_rows)
        pool = mem.kv_pool
        if pool.head_major != (layout == "head-major"):
            mem.kv_pool = KVPool(pool.size, pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype, pool.device,
                                 head_major=layout == "head-major")
            runner.bind_kv_pool(mem.kv_pool)
        time_steps(runner, mem, 1, 16, 4)  # warm-up: kernels built, caches touched
        return runner, mem

    def report(variant: tuple[str, str], bs: int, times: list[float]) -> None:
        kv, layout = variant
        print(json.dumps({"dtype": args.dtype, "kv_cache_dtype": kv, "kv_layout": layout, "batch_size": bs,
                          "context": args.context, "threads": torch.get_num_threads(), "steps": len(times),
                          "best_step_ms": round(1000 * min(times), 2),
                          "median_step_ms": round(1000 * statistics.median(times), 2)}), flush=True)

    if args.alternate:
        runners = {variant: build(variant) for variant in variants}
        for bs in args.batch_size:
            times: dict[tuple[str, str], list[float]] = {variant: [] for variant in runners}
            for _ in range(args.alternate):
                for variant, (runner, mem) in runners.items():
                    times[variant] += time_steps(runner, mem, bs, args.context, args.steps)
            for variant in runners:
                report(variant, bs, times[variant])
        return
    for variant in variants:
        runner, mem = build(variant)
        for bs in args.batch_size:
            report(variant, bs, time_steps(runner, mem, bs, args.context, args.steps))


if __name__ == "__main__":
    main()
