"""The float32 FMA peak of this CPU, the ceiling that GEMM rates in benchmarks/RESULTS.md are quoted against.

    python benchmarks/fma_peak.py [--threads 1 2]

Compiles benchmarks/probes/fma_peak.c with the system C compiler (`cc`, OpenMP) for 256-bit FMAs (AVX2 / FMA) and,
where /proc/cpuinfo lists avx512f, for 512-bit ones, and runs each at every --threads count. One thread against two
says whether two vCPUs are two cores (twice the rate) or SMT siblings of one core (about the same rate).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from sglang.srt.model_loader.dtype import read_cpu_flags

SOURCE = Path(__file__).resolve().parent / "probes" / "fma_peak.c"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--iters", type=int, default=20_000_000, help="loop trips per thread (10 FMAs each)")
    args = parser.parse_args()
    flags = read_cpu_flags()
    print("CPU flags:", " ".join(sorted(f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))))
    widths = [256] if {"avx2", "fma"} <= flags else []
    if "avx512f" in flags:
        widths.append(512)
    if not widths:
        raise SystemExit("this CPU has no AVX2/FMA: no vector FMA loop to run")
    with tempfile.TemporaryDirectory() as tmp:
        for width in widths:
            isa = ["-mavx2", "-mfma"] + (["-mavx512f"] if width == 512 else [])
            exe = str(Path(tmp) / f"fma_peak_{width}")
            subprocess.run(["cc", "-O2", *isa, "-fopenmp", f"-DWIDTH={width}", str(SOURCE), "-o", exe], check=True)
            for threads in args.threads:
                subprocess.run([exe, str(threads), str(args.iters)], check=True)


if __name__ == "__main__":
    main()
