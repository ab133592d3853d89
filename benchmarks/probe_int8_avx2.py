"""Would int8 activations speed up the GGUF Q4_1 kernels on a CPU with AVX2 but no VNNI?

Builds `benchmarks/probes/int8_avx2_q4_1.cpp` (a two-term int8 Q4_1 kernel on AVX2's VPMADDUBSW, not part of the
engine) with g++ against the engine's kernel headers, and runs it at SmolLM2-135M's gate_up (3072 x 576) and down
(576 x 1536) shapes for several row counts M. It prints, per shape, the float32 kernels' time (what the engine
runs on AVX2: tiles up to 9 rows, row groups converted once from 10), the two int8 layouts' times and how far
their outputs are from the engine's portable int8 loop (0: the same integer sums). One thread; the weights stay
in the caches, so this is the arithmetic alone. Then, `--stream-rounds` times, both shapes again with 60 distinct
weights each (66 and 33 MB, streamed from memory as in a decode step) on 2 OpenMP threads at 1 and 2 rows: float32
against int8 (both halves), with the bandwidth each reaches.

    python benchmarks/probe_int8_avx2.py [--rows 1 2 4 8 16 64] [--stream-rounds 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang.srt.model_loader.dtype import read_cpu_flags  # noqa: E402

SOURCE = ROOT / "benchmarks" / "probes" / "int8_avx2_q4_1.cpp"
HEADERS = ROOT / "sglang" / "srt" / "layers" / "quantization" / "csrc"
SHAPES = {"gate_up": (3072, 576), "down": (576, 1536)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    parser.add_argument("--stream-rounds", type=int, default=3)
    args = parser.parse_args()
    flags = read_cpu_flags()
    if "avx2" not in flags or "fma" not in flags or "f16c" not in flags:
        sys.exit("this probe needs AVX2, FMA and F16C")
    print("CPU flags:", " ".join(sorted(f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))))
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "probe"
        subprocess.run(["g++", "-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-std=c++17", f"-I{HEADERS}", str(SOURCE),
                        "-o", str(binary)], check=True)
        for name, (n, k) in SHAPES.items():
            for m in args.rows:
                out = subprocess.run([str(binary), str(n), str(k), str(m)], capture_output=True, text=True)
                print(f"{name}: {out.stdout.strip()}", flush=True)
                failed |= out.returncode != 0
        for _ in range(args.stream_rounds):
            for name, (n, k) in SHAPES.items():
                for m in (1, 2):
                    out = subprocess.run([str(binary), "stream", str(n), str(k), str(m), "60", "2"],
                                         capture_output=True, text=True, check=True)
                    print(f"{name}: {out.stdout.strip()}", flush=True)
    if failed:
        sys.exit("an int8 kernel's output differs from the exact integer sums")


if __name__ == "__main__":
    main()
