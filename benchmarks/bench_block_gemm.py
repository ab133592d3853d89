"""The large-batch GEMM over Q8_0 blocks (layers/quantization/block_gemm.py), converted to float32 or bf16 slabs,
against dense copies of the same weights (float32 weights through MKL, a prepacked bf16 copy: layers/bf16_linear.py)
on a model's linear shapes, and this machine's ceilings: the GEMM rates and the memory read bandwidth.

For each row count M, one "layer" = the four matmuls of a decoder layer (fused qkv, o, fused gate/up, down) with
fresh weights per layer (--layers distinct copies, cycled, so that weights come from memory as in a real forward,
not from cache). Prints GFLOP/s of each method (ratios to the faster dense copy), per slab size, then:
- the memory read rate of `torch.sum` over a 1 GiB tensor (the bandwidth floors of benchmarks/RESULTS.md), and
- the batch-1 matmuls of the layers on their Q8_0 blocks: the time per layer against bytes / read rate.

  python benchmarks/bench_block_gemm.py --shape smollm2-1.7b --rows 128,512,900,2048 --slab-kb 256,1024,4096
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from sglang.srt.layers.bf16_linear import BF16LinearMethod
from sglang.srt.layers.cpu_classes import VNNI_FLAGS
from sglang.srt.layers.linear import DENSE
from sglang.srt.layers.quantization.block_gemm import BlockGEMMLinearMethod
from sglang.srt.model_loader.dtype import read_cpu_flags
from sglang.srt.model_loader.q8_blocks import quantize_q8_0

SHAPES = {  # hidden, intermediate, q heads x head dim, kv heads x head dim
    "smollm2-135m": (576, 1536, 576, 192),
    "smollm2-1.7b": (2048, 8192, 2048, 2048),
    "llama-7b": (4096, 11008, 4096, 1024),
}


def cpu_flags() -> str:
    """The flags that decide the arithmetic (avx*, amx*, fma), from the engine's own reading of /proc/cpuinfo."""
    return " ".join(sorted(f for f in read_cpu_flags() if f.startswith(("avx", "amx")) or f == "fma"))


def layer_weights(hidden: int, inter: int, q: int, kv: int, gen: torch.Generator) -> list[torch.Tensor]:
    shapes = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    return [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]


def best_of(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_rate(gib: float = 1.0) -> float:
    x = torch.ones(int(gib * (1 << 30)) // 4)
    seconds = best_of(lambda: x.sum(), 5)
    return x.numel() * 4 / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=SHAPES, default="smollm2-1.7b")
    ap.add_argument("--rows", default="128,512,900,2048")
    ap.add_argument("--slab-kb", default="256,1024,4096", help="bf16 slab sizes to try, KiB")
    ap.add_argument("--layers", type=int, default=4, help="distinct layer copies cycled through")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    hidden, inter, q, kv = SHAPES[args.shape]
    print(f"{args.shape}: torch {torch.__version__}, {torch.get_num_threads()} threads, CPU flags: {cpu_flags()}")
    gen = torch.Generator().manual_seed(0)
    blocks, packed, dense = [], [], []
    for _ in range(args.layers):
        ws = layer_weights(hidden, inter, q, kv, gen)
        qs = [quantize_q8_0(w) for w in ws]
        blocks.append(qs)
        dense.append([qw.dequantize() for qw in qs])
        packed.append([BF16LinearMethod(w) for w in dense[-1]])
    flops_per_row = 2 * sum(qw.n * qw.k for qw in blocks[0])
    slabs = [int(s) * 1024 for s in args.slab_kb.split(",")]
    methods = {(dtype, s): [[BlockGEMMLinearMethod(qw, dtype, slab_bytes=s) for qw in qs] for qs in blocks]
               for dtype in (torch.float32, torch.bfloat16) for s in slabs}
    for m in [int(r) for r in args.rows.split(",")]:
        xs = [torch.randn(m, qw.k, generator=gen) for qw in blocks[0]]

        def run(layer_methods) -> None:
            for layer in layer_methods:
                for method, x in zip(layer, xs):
                    method.apply_native(None, x, None)

        def run_dense() -> None:
            for layer in dense:
                for w, x in zip(layer, xs):
                    DENSE.apply(w, x, None)

        rates = {"float32 weights": best_of(run_dense, args.reps), "prepacked bf16 copy":
                 best_of(lambda: run(packed), args.reps)}
        for (dtype, s), layer_methods in methods.items():
            rates[f"blocks {str(dtype)[6:]} {s // 1024} KiB"] = best_of(lambda: run(layer_methods), args.reps)
        base = min(rates["float32 weights"], rates["prepacked bf16 copy"])
        line = "; ".join(f"{name} {m * flops_per_row * args.layers / t / 1e9:.0f} ({base / t:.2f}x)"
                         for name, t in rates.items())
        print(f"M={m} GFLOP/s: {line}", flush=True)
    rate = read_rate()
    q8_bytes = sum(qw.nbytes for qw in blocks[0])
    x1 = [torch.randn(1, qw.k, generator=gen) for qw in blocks[0]]
    int8 = VNNI_FLAGS <= read_cpu_flags()  # the plan's int8 activations (layers/arithmetic.py)

    def batch1() -> None:
        for layer in blocks:
            for qw, x in zip(layer, x1):
                qw.linear(x, None, int8)

    t1 = best_of(batch1, args.reps * 3) / args.layers
    floor = q8_bytes / rate
    print(f"read bandwidth (torch.sum, 1 GiB, {torch.get_num_threads()} threads): {rate / 1e9:.1f} GB/s")
    print(f"batch 1 on Q8_0 blocks{' (int8 activations)' if int8 else ''}: {t1 * 1e3:.2f} ms per layer for "
          f"{q8_bytes / 1e6:.1f} MB; floor {floor * 1e3:.2f} ms ({t1 / floor:.2f}x the floor)")
    print(f"OMP/MKL threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")


if __name__ == "__main__":
    main()
