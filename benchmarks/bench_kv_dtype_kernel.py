"""The compiled paged decode attention kernel per stored K/V dtype: one batch-1 decode step's attention over all
layers of a long context (SmolLM2-135M shapes by default: 30 layers, 9 query heads over 3 KV heads of 64).

Each layer has its own K/V buffers, so a step reads --layers x the per-layer bytes as a real step does. Reports the
best wall time and the best thread CPU time of --repeats steps on --threads threads (one by default: on a shared
machine the CPU time is the steadier figure, it leaves out time spent preempted), and the K/V bytes read per second
of wall time. The standalone kernel splits work by (sequence, KV head), so two threads need --batch-size 2 to be
balanced with 3 KV heads. Where the CPU has AVX512, bf16 is measured on both of its paths (rows "bfloat16" and
"bfloat16 (avx2)"), the repeats of the two interleaved so that both see the same machine.

    python benchmarks/bench_kv_dtype_kernel.py --context 3000
    python benchmarks/bench_kv_dtype_kernel.py --context 3000 --threads 2 --batch-size 2
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
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--kv-dtypes", nargs="+", default=["float32", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
    args = parser.parse_args()
    if not cpu_ops.available():
        raise SystemExit("the compiled CPU kernels are unavailable")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    B, L = args.batch_size, args.context
    slots = B * L + 1
    q = torch.randn(B, args.heads, args.head_dim, generator=gen)
    # Shuffled slots, as a long-running server's allocator hands them out.
    idx = (torch.randperm(B * L, generator=gen) + 1).view(B, L)
    lens = torch.full((B,), L)
    k = torch.randn(slots, args.kv_heads, args.head_dim, generator=gen)
    v = torch.randn(slots, args.kv_heads, args.head_dim, generator=gen)
    for name in args.kv_dtypes:
        dtype = KV_CACHE_DTYPES[name]
        ks = [to_kv_dtype(k, dtype).clone() for _ in range(args.layers)]
        vs = [to_kv_dtype(v, dtype).clone() for _ in range(args.layers)]
        paths = {name: None}
        if dtype == torch.bfloat16 and cpu_ops.has_decode_attention_avx512():
            paths = {name: True, f"{name} (avx2)": False}
        best = {label: (float("inf"), float("inf")) for label in paths}
        for _ in range(args.repeats):
            for label, avx512 in paths.items():
                previous = None if avx512 is None else cpu_ops.set_decode_attention_avx512(avx512)
                t0, c0 = time.perf_counter(), time.thread_time()
                for kl, vl in zip(ks, vs):
                    cpu_ops.paged_decode_attention(q, kl, vl, idx, lens, args.head_dim**-0.5)
                wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
                if previous is not None:
                    cpu_ops.set_decode_attention_avx512(previous)
                best[label] = (min(best[label][0], wall), min(best[label][1], cpu))
        kv_mb = 2 * args.layers * B * L * args.kv_heads * args.head_dim * dtype.itemsize / 1e6
        for label, (wall, cpu) in best.items():
            print(json.dumps({"kv_cache_dtype": label, "context": L, "batch_size": B, "threads": args.threads,
                              "kv_mb_per_step": round(kv_mb, 1), "best_wall_ms": round(1000 * wall, 2),
                              "best_cpu_ms": round(1000 * cpu, 2), "gb_per_s": round(kv_mb / wall / 1000, 1)}),
                  flush=True)


if __name__ == "__main__":
    main()
