"""How long the first start on a new machine spends compiling the CPU extensions: each extension built into an
empty cache folder, one fresh process per build, timed from the build call to the loaded module.

    python benchmarks/bench_extension_build.py [--runs 1] [--portable] [--checkout DIR ...]

`--checkout` builds another checkout's sources (its root goes first on PYTHONPATH) too, alternating with this one,
for a before / after comparison in one run. `--portable` builds without the AVX2 code (SGLANG_CPU_KERNELS_PORTABLE=1).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from sglang.srt.layers.build_extensions import EXTENSIONS, build_env, finish_build, start_build

ROOT = Path(__file__).resolve().parent.parent


def build_seconds(checkout: Path, name: str, portable: bool) -> float:
    with tempfile.TemporaryDirectory(prefix="ext-build-") as cache:
        env = build_env(portable, {**os.environ, "SGLANG_CACHE_DIR": cache, "PYTHONPATH": str(checkout)})
        result = finish_build(name, start_build(EXTENSIONS[name], env, cwd=str(checkout)))
    if not result.ok:
        raise SystemExit(f"{name} did not build in {checkout}: {result.reason}")
    return result.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--portable", action="store_true")
    parser.add_argument("--checkout", action="append", default=[], help="another checkout to build as well")
    args = parser.parse_args()
    checkouts = [ROOT, *(Path(c).resolve() for c in args.checkout)]
    totals: dict[Path, list[float]] = {c: [] for c in checkouts}
    for run in range(args.runs):
        for checkout in checkouts:
            seconds = {name: build_seconds(checkout, name, args.portable) for name in EXTENSIONS}
            totals[checkout].append(sum(seconds.values()))
            print(f"run {run + 1} {checkout}: " + ", ".join(f"{n} {s:.1f} s" for n, s in seconds.items())
                  + f"; total {sum(seconds.values()):.1f} s", flush=True)
    for checkout, runs in totals.items():
        print(f"{checkout}: total per run {', '.join(f'{t:.1f}' for t in runs)} s")


if __name__ == "__main__":
    main()
