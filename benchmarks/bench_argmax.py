"""Greedy token choice: aten's argmax against the compiled one (cpu_ops.argmax_rows) over vocabulary rows.

    python benchmarks/bench_argmax.py [--vocab 49152] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from sglang.srt.layers import cpu_ops


def micros(fn, reps: int = 500) -> float:
    for _ in range(50):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert cpu_ops.available(), "the compiled CPU kernels are unavailable"
    print(f"# vocabulary {args.vocab}, {args.threads} threads, torch {torch.__version__}")
    for rows in (1, 16, 64):
        x = torch.randn(rows, args.vocab)
        assert torch.equal(cpu_ops.argmax_rows(x), x.argmax(-1))
        aten, compiled = micros(lambda: x.argmax(-1)), micros(lambda: cpu_ops.argmax_rows(x))
        print(f"{rows} rows: torch.argmax {aten:.0f} us, argmax_rows {compiled:.0f} us ({aten / compiled:.1f}x)")


if __name__ == "__main__":
    main()
