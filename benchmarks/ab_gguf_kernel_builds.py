"""Two builds of the GGUF kernels extension side by side: a full decode step of matmuls (bench_gguf_kernels.py's
table 2: 30 layers x 4 + lm_head, weights streamed) at each M, the builds interleaved in one process round by round,
so that a drifting machine slows both alike.

    python benchmarks/ab_gguf_kernel_builds.py A.so B.so [--rows 1 2 3 4 5 8] [--rounds 8] [--threads 2]

A build is the `.so` a checkout compiles into the extension cache; with the kernels' sources of that checkout in
place, print its path with
    python -c "from sglang.srt.layers.quantization import gguf_blocks as gb; print(gb.kernel_module().__file__)"
(the cache is keyed by a hash of the sources, so two versions of a header give two builds). Each round times every M
with every build (3 timed steps after one warm-up; the minimum counts); the table shows the median over rounds and
each build's ratio to the first.

`--large-shapes` instead times each matmul of one layer of the SmolLM2-1.7B shape (qkv 6144 x 2048, o 2048 x 2048,
gate_up 16384 x 2048, down 2048 x 8192; random --qtype blocks) at --rows rows (e.g. 900, a prefill), with GFLOP/s,
and says whether every build's outputs are the same bits as the first's:

    python benchmarks/ab_gguf_kernel_builds.py A.so B.so A.so --large-shapes --rows 900 --rounds 6

(listing the first build again shows how much the position in a round alone moves the figures).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_gguf_kernels as bench  # noqa: E402

from sglang.srt.layers.quantization import gguf_blocks as gb  # noqa: E402


def load_build(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def use_build(module, weights) -> None:
    """Make every weight call `module`'s kernels (they resolve their kernel once and keep it)."""
    gb.kernel_module = lambda: module
    for w in weights:
        w._kernel = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("builds", type=Path, nargs="+")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", type=Path, default=bench.default_gguf())
    parser.add_argument("--large-shapes", action="store_true", help="one layer of the 1.7B shape, per matmul")
    parser.add_argument("--qtype", choices=["Q8_0", "Q4_1"], default="Q8_0", help="with --large-shapes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    builds = [load_build(p) for p in args.builds]
    if args.large_shapes:
        large_shapes(builds, args)
        return
    layers, head, source = bench.load_model_weights(args.gguf)
    weights = [w for layer in layers for w in layer.values()] + [head]
    print(f"# {source}; {args.threads} threads, load average {os.getloadavg()[0]:.2f}; builds: "
          + ", ".join(f"{i}: {p.name}" for i, p in enumerate(args.builds)))
    gen = torch.Generator().manual_seed(0)
    times: dict[tuple[int, int], list[float]] = {(b, m): [] for b in range(len(builds)) for m in args.rows}
    for _ in range(args.rounds):
        for m in args.rows:
            x_h = torch.randn(m, bench.HIDDEN, generator=gen)
            x_i = torch.randn(m, bench.INTER, generator=gen)
            for b, module in enumerate(builds):
                use_build(module, weights)

                def step() -> None:
                    bench.quant_layers_pass(layers, x_h, x_i)
                    head.linear(x_h)

                step()
                runs = []
                for _ in range(3):
                    start = time.perf_counter()
                    step()
                    runs.append(time.perf_counter() - start)
                times[(b, m)].append(min(runs))
    print("\n| M | " + " | ".join(f"build {b} (ms)" for b in range(len(builds))) + " |")
    print("|---:|" + "---:|" * len(builds))
    for m in args.rows:
        med = [statistics.median(times[(b, m)]) * 1e3 for b in range(len(builds))]
        cells = [f"{t:.2f}" + ("" if b == 0 else f" ({t / med[0]:.2f}x)") for b, t in enumerate(med)]
        print(f"| {m} | " + " | ".join(cells) + " |")
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


LARGE_SHAPES = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}


def large_shapes(builds: list, args: argparse.Namespace) -> None:
    """Each matmul of one 1.7B-shape layer at each --rows, every build in turn within a round."""
    rng = np.random.default_rng(0)
    weights = {name: gb.GGUFQuantWeight(args.qtype, bench.random_raw(args.qtype, n, k, rng), n, k)
               for name, (n, k) in LARGE_SHAPES.items()}
    print(f"# one layer of the 1.7B shape, random {args.qtype} blocks; {args.threads} threads, load average "
          f"{os.getloadavg()[0]:.2f}; builds: " + ", ".join(f"{i}: {p.name}" for i, p in enumerate(args.builds)))
    for m in args.rows:
        xs = {name: torch.randn(m, k, generator=torch.Generator().manual_seed(m)) for name, (_, k) in LARGE_SHAPES.items()}
        times: dict[tuple[int, str], list[float]] = {(b, name): [] for b in range(len(builds)) for name in weights}
        outputs: dict[tuple[int, str], torch.Tensor] = {}
        for _ in range(args.rounds):
            for b, module in enumerate(builds):
                use_build(module, weights.values())
                for name, w in weights.items():
                    outputs[(b, name)] = w.linear(xs[name])  # the warm-up call, kept for the bit check
                    start = time.perf_counter()
                    w.linear(xs[name])
                    times[(b, name)].append(time.perf_counter() - start)
        print(f"\n{m} rows: median ms (GFLOP/s), ratio to build 0\n")
        print("| matmul | " + " | ".join(f"build {b}" for b in range(len(builds))) + " | same bits |")
        print("|---|" + "---:|" * len(builds) + "---|")
        totals = [0.0] * len(builds)
        for name, (n, k) in LARGE_SHAPES.items():
            med = [statistics.median(times[(b, name)]) for b in range(len(builds))]
            totals = [t + x for t, x in zip(totals, med)]
            flops = 2 * m * n * k
            cells = [f"{t * 1e3:.1f} ({flops / t / 1e9:.0f})" + ("" if b == 0 else f" {t / med[0]:.2f}x")
                     for b, t in enumerate(med)]
            same = all(torch.equal(outputs[(0, name)], outputs[(b, name)]) for b in range(len(builds)))
            print(f"| {name} {n}x{k} | " + " | ".join(cells) + f" | {same} |")
        print("| total | " + " | ".join(f"{t * 1e3:.0f}" + ("" if b == 0 else f" {t / totals[0]:.2f}x")
                                     for b, t in enumerate(totals)) + " | |")
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
