"""The compiled paged decode attention kernel per stored K/V dtype: one batch-1 decode step's attention over all
layers of a long context (SmolLM2-135M shapes by default: 30 layers, 9 query heads over 3 KV heads of 64).

Each layer has its own K/V buffers, so a step reads --layers x the per-layer bytes as a real step does. Reports the
best wall time and the best thread CPU time of --repeats steps on one thread: on a shared machine the CPU time is
the steadier figure (it leaves out time spent preempted).

    python benchmarks/bench_kv_dtype_kernel.py --context 3000
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from sglang.srt.layers import cpu_ops
from sglang.srt.mem_cache.kv_dtype import KV_CACHE_DTYPES, to_kv_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=3000)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--kv-dtypes", nargs="+", default=["float32", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
    args = parser.parse_args()
    if not cpu_ops.available():
        raise SystemExit("the compiled CPU kernels are unavailable")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    L, slots = args.context, args.context + 1
    q = torch.randn(1, args.heads, args.head_dim, generator=gen)
    # Shuffled slots, as a long-running server's allocator hands them out.
    idx = (torch.randperm(L, generator=gen) + 1)[None]
    lens = torch.tensor([L])
    k = torch.randn(slots, args.kv_heads, args.head_dim, generator=gen)
    v = torch.randn(slots, args.kv_heads, args.head_dim, generator=gen)
    for name in args.kv_dtypes:
        dtype = KV_CACHE_DTYPES[name]
        ks = [to_kv_dtype(k, dtype).clone() for _ in range(args.layers)]
        vs = [to_kv_dtype(v, dtype).clone() for _ in range(args.layers)]
        wall, cpu = float("inf"), float("inf")
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), time.thread_time()
            for kl, vl in zip(ks, vs):
                cpu_ops.paged_decode_attention(q, kl, vl, idx, lens, args.head_dim**-0.5)
            wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.thread_time() - c0)
        kv_mb = 2 * args.layers * L * args.kv_heads * args.head_dim * dtype.itemsize / 1e6
        print(json.dumps({"kv_cache_dtype": name, "context": L, "kv_mb_per_step": round(kv_mb, 1),
                          "best_wall_ms": round(1000 * wall, 2), "best_cpu_ms": round(1000 * cpu, 2)}), flush=True)


if __name__ == "__main__":
    main()
