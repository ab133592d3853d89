"""Micro-benchmark of the paged decode attention kernel (sglang/srt/layers/csrc/cpu_kernels.h).

One layer of decode attention for `--batch` sequences of `--context` tokens each (SmolLM2-135M heads by default:
9 query heads sharing 3 KV heads of dimension 64), K/V stored as `--kv-dtype`, with the sequences' KV slots laid out
contiguously, shuffled, or interleaved (as decode steps of concurrent sequences allocate them), and with
`--shared-prefix P` also shuffled with the first P slots shared by every sequence (a prefix-cache hit). Prints the
median time per layer and the K/V bytes read per second (counting a shared slot once per sequence).

`--layers N` gives each of N layers its own K/V buffers and times the layers one after the other, so that their K/V
come from memory once N layers outgrow the last-level cache, as in a decode step (one layer's K/V stays cached
otherwise). `--pool-layouts` picks the buffers' layout: head-major (each KV head's rows together, the engine's pool
on CPU, mem_cache/kv_pool.py) and / or slot-major (a slot holds the rows of every KV head).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_decode_attention.py [--context 1024] [--batch 16]
    OMP_NUM_THREADS=1 python benchmarks/bench_decode_attention.py --batch 1 --context 3000 --kv-dtype bfloat16 \
        --layers 30 --pool-layouts head-major slot-major
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sglang.srt.layers import cpu_ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--kv-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--shared-prefix", type=int, default=0)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--pool-layouts", nargs="+", choices=["head-major", "slot-major"], default=["head-major"])
    args = parser.parse_args()
    if not cpu_ops.available():
        raise SystemExit("the CPU kernels are unavailable (no C++ toolchain?)")
    torch.manual_seed(0)
    batch, length, layers = args.batch, args.context, args.layers
    slots = batch * length + 1
    kv_dtype = getattr(torch, args.kv_dtype)
    ks = [torch.randn(slots, args.kv_heads, args.head_dim).to(kv_dtype) for _ in range(layers)]
    vs = [torch.randn(slots, args.kv_heads, args.head_dim).to(kv_dtype) for _ in range(layers)]
    pools = {"slot-major": (ks, vs)} if "slot-major" in args.pool_layouts else {}
    if "head-major" in args.pool_layouts:  # [slots, kv_heads, D] views of [kv_heads, slots, D] storage
        pools["head-major"] = tuple([t.transpose(0, 1).contiguous().transpose(0, 1) for t in ts] for ts in (ks, vs))
    q = torch.randn(batch, args.heads, args.head_dim)
    lens = torch.full((batch,), length, dtype=torch.int64)
    scale = args.head_dim**-0.5
    layouts = {
        "contiguous": torch.arange(1, slots).view(batch, length),
        "shuffled": (torch.randperm(slots - 1) + 1).view(batch, length),
        "interleaved": torch.arange(1, slots).view(length, batch).t().contiguous(),
    }
    if args.shared_prefix:
        shared = layouts["shuffled"].clone()
        shared[:, : args.shared_prefix] = shared[0, : args.shared_prefix]
        layouts[f"shared {args.shared_prefix}"] = shared
    runs = {f"{pool} {name}": (lambda idx=idx, kvs=kvs: [cpu_ops.paged_decode_attention(q, k, v, idx, lens, scale)
                                                         for k, v in zip(*kvs)])
            for name, idx in layouts.items() for pool, kvs in pools.items()}
    kv_bytes = 2 * batch * length * args.kv_heads * args.head_dim * ks[0].element_size()
    print(f"batch {batch}, context {length}, heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, "
          f"K/V {args.kv_dtype}, {layers} layer(s) of {kv_bytes / 1e6:.1f} MB, threads {torch.get_num_threads()}")
    for name, run in runs.items():
        run()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) / layers)
        ms = statistics.median(times) * 1000
        print(f"{name:24s} {ms:7.3f} ms per layer, {kv_bytes / ms / 1e6:5.1f} GB/s of K/V")

if __name__ == "__main__":
    main()
