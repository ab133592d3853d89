"""Where the large-batch GEMM overtakes the block kernels, on a model's linear shapes.

For each row count M, one "layer" = the four matmuls of a decoder layer (fused qkv, o, fused gate/up, down), with
`--layers` distinct weight copies cycled so that weights come from memory as in a decode step. Times, per layer:
the Q4_1 / Q8_0 block kernels with int8 activations (the fused decode step's matmuls, `GGUFQuantWeight.linear`)
and with float32 activations, and the int8 GEMM (`torch._int_mm` with per-token scales and the outlier columns
read from the blocks: the large-batch method of a model served from blocks). The row count where the int8 GEMM
becomes faster is where `small_batch_max_rows` (layers/small_batch_rows.py) should sit for these shapes.

  PYTHONPATH=. python benchmarks/bench_small_batch_crossover.py --shape smollm2-1.7b --rows 1,8,16,32,48,64,96
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sglang.srt.model_loader.gemm_methods import blocks_large_method
from sglang.srt.model_loader.q8_blocks import quantize_blocks

SHAPES = {  # hidden, intermediate, q heads, kv heads, head dim
    "smollm2-135m": (576, 1536, 9, 3, 64),
    "smollm2-360m": (960, 2560, 15, 5, 64),
    "smollm2-1.7b": (2048, 8192, 32, 32, 64),
    "llama-7b": (4096, 11008, 32, 8, 128),
}


def layer_shapes(shape: str) -> list[tuple[int, int]]:
    hidden, inter, heads, kv_heads, head_dim = SHAPES[shape]
    qkv = (heads + 2 * kv_heads) * head_dim
    return [(qkv, hidden), (hidden, heads * head_dim), (2 * inter, hidden), (hidden, inter)]


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=SHAPES, default="smollm2-1.7b")
    ap.add_argument("--rows", default="1,8,16,32,48,64,96")
    ap.add_argument("--qtypes", default="Q8_0,Q4_1")
    ap.add_argument("--layers", type=int, default=3, help="distinct layer copies cycled through")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    make_int8 = blocks_large_method("int8", "float32")
    for qtype in args.qtypes.split(","):
        layers = []
        for _ in range(args.layers):
            mats = []
            for n, k in layer_shapes(args.shape):
                w = torch.randn(n, k) * 0.02
                blocks = quantize_blocks(w, qtype)
                mats.append((blocks, make_int8(blocks, blocks.dequantize), torch.empty(n, k, device="meta")))
            layers.append(mats)
        print(f"{args.shape} {qtype}: ms per decoder layer (4 matmuls), median of {args.reps} passes over "
              f"{args.layers} layers")
        print(f"{'rows':>5} {'blocks int8 act':>16} {'blocks f32 act':>15} {'int8 GEMM':>10}  faster")
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, max(k for _, k in layer_shapes(args.shape)))

            def run(kind: str) -> None:
                for mats in layers:
                    for blocks, int8_method, meta in mats:
                        xi = x[:, : blocks.k].contiguous()
                        if kind == "int8 GEMM":
                            int8_method.apply(meta, xi, None)
                        else:
                            blocks.linear(xi, None, kind == "int8 act")

            t = {kind: median_ms(lambda kind=kind: run(kind), args.reps) / args.layers
                 for kind in ("int8 act", "f32 act", "int8 GEMM")}
            best = min(t, key=t.__getitem__)
            print(f"{rows:>5} {t['int8 act']:>16.2f} {t['f32 act']:>15.2f} {t['int8 GEMM']:>10.2f}  {best}")


if __name__ == "__main__":
    main()
