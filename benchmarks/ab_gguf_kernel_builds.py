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
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    builds = [load_build(p) for p in args.builds]
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


if __name__ == "__main__":
    main()
