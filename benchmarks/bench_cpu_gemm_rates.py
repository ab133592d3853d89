"""GEMM throughput of float32, bf16 and int8 (`torch._int_mm`) at the decoder's shapes on this CPU.

`python benchmarks/bench_cpu_gemm_rates.py` prints GFLOP/s (GOP/s for int8) for SmolLM2-135M's projections
(q/k/v 576x832, o 576x576, gate/up 576x3072, down 1536x576) at several row counts, with the torch thread count
as set (2 on the development machine; `--threads N` sets it, e.g. 1 and 2 to see how the cores scale). "bf16+casts"
converts a float32 input and the output as the bf16 linear method does. The last two columns are the engine's two
reduced-precision large-batch methods from a float32 input to a float32 output: "bf16 method" (layers/bf16_linear.py,
`--cpu-gemm bfloat16`, the default on CPUs with native bf16) and "int8 method" (layers/int8_linear.py, `--cpu-gemm
int8`: per-token quantization with the 64 largest input columns multiplied apart, `_int_mm` or, on CPUs without
integer dot products, its exact float32 form, rescaling), each at the rate of the same GEMM's FLOPs.

`--startup N` instead repeats the server's startup measurement (model_loader/gemm_measurement.py: each method on
SmolLM2's MLP shapes at 128 and 512 rows) N times for all three GEMMs, with the time each took, and says which GEMMs
this CPU's flags leave open and what the plan picks from each round: how stable the choice is on this machine.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from sglang.srt.layers.arithmetic import choose_arithmetic, gemms_to_measure
from sglang.srt.layers.bf16_linear import BF16LinearMethod
from sglang.srt.layers.int8_linear import method_for_this_cpu
from sglang.srt.model_loader.dtype import read_cpu_flags
from sglang.srt.model_loader.gemm_measurement import measure_large_batch_gemms

SHAPES = [(576, 832), (576, 576), (576, 3072), (1536, 576)]


def rate(fn, flops: float, reps: int = 20) -> float:
    fn()
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return flops * reps / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: as set)")
    parser.add_argument("--startup", type=int, default=0, metavar="N",
                        help="repeat the startup measurement N times instead")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.startup:
        startup_rounds(args.startup)
        return
    torch.manual_seed(0)
    make_int8 = method_for_this_cpu()
    print(f"threads {torch.get_num_threads()}; int8 method: {make_int8(torch.zeros(8, 576)).describe()}")
    for rows in (64, 256, 512, 1024):
        for k, n in SHAPES:
            x, w = torch.randn(rows, k), torch.randn(n, k)
            xb, wb = x.bfloat16(), w.bfloat16()
            xq = torch.randint(-127, 127, (rows, k), dtype=torch.int8)
            wq = torch.randint(-127, 127, (k, n), dtype=torch.int8)
            flops = 2 * rows * k * n
            bf16_method, int8_method = BF16LinearMethod(w), make_int8(w)
            print(f"M={rows} K={k} N={n}: float32 {rate(lambda: F.linear(x, w), flops):.0f}  "
                  f"bf16 {rate(lambda: F.linear(xb, wb), flops):.0f}  "
                  f"bf16+casts {rate(lambda: F.linear(x.bfloat16(), wb).float(), flops):.0f}  "
                  f"int8 {rate(lambda: torch._int_mm(xq, wq), flops):.0f}  "
                  f"bf16 method {rate(lambda: bf16_method.apply(w, x, None), flops):.0f}  "
                  f"int8 method {rate(lambda: int8_method.apply(w, x, None), flops):.0f}")


def startup_rounds(n: int) -> None:
    flags = read_cpu_flags()
    open_gemms = gemms_to_measure("cpu", "auto", "auto", flags)
    print(f"threads {torch.get_num_threads()}; GEMMs the flags leave open: {', '.join(open_gemms) or 'none'}")
    for i in range(n):
        start = time.perf_counter()
        rates = measure_large_batch_gemms(["float32", "bfloat16", "int8"])
        took = time.perf_counter() - start
        plan = choose_arithmetic("cpu", "auto", "auto", flags, measurements=rates)
        print(f"round {i}: " + "  ".join(f"{g} {r:.0f}" for g, r in rates.items()) +
              f"  int8/float32 {rates['int8'] / rates['float32']:.2f}  int8/bf16 {rates['int8'] / rates['bfloat16']:.2f}"
              f"  ({took * 1e3:.0f} ms for three GEMMs) -> {plan.large_batch_gemm}", flush=True)


if __name__ == "__main__":
    main()
