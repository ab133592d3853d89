"""Decode step time at a long context, per --kv-cache-dtype: the model runner without a server.

Prefills `--batch-size` prompts of `--context` random tokens, then times `--steps` decode steps and reports the
fastest and the median step. Late in a long generation attention is most of a batch-1 step; the fastest step is the
steadier figure on a shared machine (it leaves out steps where a thread was preempted), the median the typical one.

    python benchmarks/bench_long_context_step.py --context 3000 --batch-size 1 4 --kv-dtypes float32 bfloat16
    python benchmarks/bench_long_context_step.py --dtype auto --kv-dtypes auto float32
    python benchmarks/bench_long_context_step.py --dtype auto --context 160 --batch-size 16 --steps 10 --alternate 6

With `--alternate N` one runner per KV dtype is built up front and the dtypes (and the `--context` values, when
several are given) take turns, N rounds of --steps steps each (a fresh prefill per round, every other round in the
reverse order), so that a noisy machine slows every variant alike. `--kv-layouts head-major
slot-major` runs each KV dtype with both K/V pool layouts (head-major is the pool's default on CPU, mem_cache/kv_pool.py).

    python benchmarks/bench_long_context_step.py --dtype auto --kv-dtypes auto --batch-size 1 \
        --kv-layouts head-major slot-major --alternate 6 --steps 20

`--read-rate` first prints this machine's streaming read rate (a sum over 256 MB on the same threads), and every
line carries the K/V bytes a step reads at that context: their ratio bounds the step's attention from below.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sglang.bench_one_batch import build_runner, prefill_and_decode
from sglang.srt.mem_cache.kv_pool import KVPool
from sglang.srt.model_loader.model_info import load_model_info
from sglang.srt.server_args import ServerArgs


def time_steps(runner, mem, batch_size: int, context: int, steps: int) -> list[float]:
    return prefill_and_decode(runner, mem, batch_size, context, steps)[1]


def read_rate_gbs(megabytes: int = 256, repeats: int = 5) -> float:
    """This machine's streaming read rate on the current torch threads: the median of `repeats` sums over a float32
    tensor of `megabytes`, far larger than any cache (the ceiling for decode attention, which reads every K/V row
    once per step)."""
    x = torch.ones(megabytes * 2**20 // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--context", type=int, nargs="+", default=[3000])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kv-dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--dtype", default="float32", help="--dtype of the server (auto: the default arithmetic)")
    parser.add_argument("--alternate", type=int, default=0, help="rounds of --steps steps, dtypes taking turns")
    parser.add_argument("--kv-layouts", nargs="+", choices=["head-major", "slot-major"], default=["head-major"])
    parser.add_argument("--read-rate", action="store_true",
                        help="also print the machine's streaming read rate (GB/s) and each step's K/V bytes")
    args = parser.parse_args()
    if args.read_rate:
        print(json.dumps({"read_rate_gbs": round(read_rate_gbs(), 1), "threads": torch.get_num_threads()}), flush=True)
    variants = [(kv, layout) for kv in args.kv_dtypes for layout in args.kv_layouts]
    need = max(args.batch_size) * (max(args.context) + args.steps + 2) + 64

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

    def report(variant: tuple[str, str], mem, bs: int, context: int, times: list[float]) -> None:
        kv, layout = variant
        pool = mem.kv_pool
        kv_mb = bs * context * KVPool.bytes_per_token(pool.num_layers, pool.num_kv_heads, pool.head_dim,
                                                      pool.dtype) / 1e6
        print(json.dumps({"dtype": args.dtype, "kv_cache_dtype": kv, "kv_layout": layout, "batch_size": bs,
                          "context": context, "threads": torch.get_num_threads(), "steps": len(times),
                          "best_step_ms": round(1000 * min(times), 2),
                          "median_step_ms": round(1000 * statistics.median(times), 2),
                          "kv_mb_per_step": round(kv_mb, 1)}), flush=True)

    if args.alternate:
        runners = {variant: build(variant) for variant in variants}
        turns = [(variant, context) for variant in runners for context in args.context]
        for bs in args.batch_size:
            times: dict[tuple[tuple[str, str], int], list[float]] = {turn: [] for turn in turns}
            for r in range(args.alternate):
                for variant, context in turns if r % 2 == 0 else reversed(turns):
                    runner, mem = runners[variant]
                    times[variant, context] += time_steps(runner, mem, bs, context, args.steps)
            for variant, context in turns:
                report(variant, runners[variant][1], bs, context, times[variant, context])
        return
    for variant in variants:
        runner, mem = build(variant)
        for bs in args.batch_size:
            for context in args.context:
                report(variant, mem, bs, context, time_steps(runner, mem, bs, context, args.steps))


if __name__ == "__main__":
    main()
