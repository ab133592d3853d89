"""Streaming reads from weights in the allocator's 4 KB pages against the same weights moved to 2 MB pages
(sglang/huge_pages.move_to_huge_pages, as the server moves a loaded model's weights).

Each variant runs in a fresh process, the two taking turns for `--rounds` rounds, and prints per round:

  read   the fastest of 15 `torch.sum` passes over a 512 MB bf16 tensor, GB/s
  gemv   the fastest of 15 batch-1 passes over 24 layers of SmolLM2-1.7B-shaped Q8_0 blocks (qkv, o, gate/up, down:
         1.7 GB, int8 activations, the kernels of the fused decode step), GB/s of blocks
  huge   the process's anonymous memory in huge pages after the passes

    python benchmarks/bench_huge_pages.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SHAPES = [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # qkv, o, gate/up, down of the 1.7B shape
LAYERS = 24


def measure(huge: bool) -> dict:
    import torch
    from bench_block_gemm import best_of  # the script beside this one

    from sglang.huge_pages import anon_huge_bytes, move_to_huge_pages
    from sglang.srt.layers.quantization.gguf_blocks import GGUFQuantWeight
    from sglang.srt.model_loader.q8_blocks import quantize_q8_0

    x = torch.ones(256 << 20, dtype=torch.bfloat16)
    if huge:
        move_to_huge_pages([x])
    read = x.numel() * 2 / best_of(x.sum, 15) / 1e9
    del x
    torch.manual_seed(0)
    protos = [quantize_q8_0(torch.randn(n, k) * 0.02) for n, k in SHAPES]
    # each layer its own copy of the blocks, in this process's pages
    weights = [GGUFQuantWeight.from_packed("Q8_0", p.packed.clone(), p.n, p.k) for _ in range(LAYERS) for p in protos]
    if huge:
        move_to_huge_pages([w.packed for w in weights])
    inputs = {k: torch.randn(1, k) for k in (2048, 8192)}

    def step() -> None:
        for w in weights:
            w.linear(inputs[w.k], int8=True)

    gemv = sum(w.nbytes for w in weights) / best_of(step, 15) / 1e9
    return {"read_gbs": round(read, 1), "gemv_gbs": round(gemv, 1), "huge_mb": anon_huge_bytes() >> 20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=["small", "huge"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child == "huge")))
        return
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "0"}  # the allocator's own pages: 4 KB under the `madvise` mode
    for round_ in range(args.rounds):
        for child, pages in (("small", "4 KB"), ("huge", "2 MB")):
            out = subprocess.run([sys.executable, __file__, "--child", child], env=env, capture_output=True,
                                 text=True, check=True)
            figures = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"round {round_ + 1} {pages} pages: read {figures['read_gbs']} GB/s, gemv {figures['gemv_gbs']} "
                  f"GB/s, {figures['huge_mb']} MB in huge pages", flush=True)


if __name__ == "__main__":
    main()
