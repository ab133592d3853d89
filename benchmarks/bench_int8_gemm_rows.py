"""The int8 GEMM of few rows: torch._int_mm against the compiled VNNI kernel (csrc/int8_gemm_vnni.h), and the outlier
columns read from Q8_0 blocks, at a model's linear shapes.

    PYTHONPATH=. python benchmarks/bench_int8_gemm_rows.py [--shapes 1.7b|135m|7b] [--rows 1 6 16 24 32 48 64 128]

Each weight is a random int8 [K, N] matrix moved into huge pages as the engine holds its weights
(sglang/huge_pages.py); torch._int_mm gets the rows int8_matmul gives it (fewer than 17 padded to 17). Prints the
median of 21 calls of each (ms and GOP/s) and checks the two products are equal. Needs AVX512-VNNI.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from sglang.huge_pages import move_to_huge_pages
from sglang.srt.layers import cpu_ops
from sglang.srt.layers.int8_linear import int8_matmul
from sglang.srt.model_loader.q8_blocks import quantize_q8_0

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_small_batch_crossover import median_ms  # noqa: E402

# (K, N) of qkv, o, gate/up and down, then the LM head
SHAPES = {
    "135m": [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)],
    "1.7b": [(2048, 6144), (2048, 2048), (2048, 16384), (8192, 2048), (2048, 49152)],
    "7b": [(4096, 6144), (4096, 4096), (4096, 22016), (11008, 4096)],
}


CALLS = 21


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="1.7b", choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 6, 16, 24, 32, 48, 64, 128])
    parser.add_argument("--columns", type=int, default=64, help="outlier columns read from the Q8_0 blocks")
    args = parser.parse_args()
    if not (cpu_ops.available() and cpu_ops.int8_gemm_vnni_takes(64, 64)):
        raise SystemExit("the compiled VNNI int8 GEMM needs the CPU extension and AVX512-VNNI")
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, shapes {args.shapes}")
    for k, n in SHAPES[args.shapes]:
        w = torch.randint(-128, 128, (k, n), dtype=torch.int8)
        move_to_huge_pages([w])
        for rows in args.rows:
            x = torch.randint(-128, 128, (rows, k), dtype=torch.int8)
            assert torch.equal(int8_matmul(x, w), cpu_ops.int8_gemm_vnni(x, w))
            ref = median_ms(lambda: int8_matmul(x, w), CALLS)
            ours = median_ms(lambda: cpu_ops.int8_gemm_vnni(x, w), CALLS)
            gop = 2 * rows * k * n / 1e6
            print(f"K={k:5d} N={n:5d} ({k * n / 2**20:5.1f} MiB) rows={rows:4d}: torch._int_mm {ref:7.3f} ms "
                  f"({gop / ref:4.0f} GOP/s)  VNNI kernel {ours:7.3f} ms ({gop / ours:4.0f} GOP/s)  {ref / ours:4.2f}x")
        blocks = quantize_q8_0(torch.randn(n, k) * 0.02)
        move_to_huge_pages([blocks.packed])
        cols = torch.randperm(k)[: args.columns].sort().values
        ms = median_ms(lambda: blocks.columns(cols), CALLS)
        print(f"  {args.columns} outlier columns of the [{n}, {k}] Q8_0 blocks: {ms:.3f} ms")


if __name__ == "__main__":
    main()
