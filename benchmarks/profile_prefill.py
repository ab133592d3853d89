"""Where a prefill's time goes: the torch profiler around one model-runner prefill.

`PYTHONPATH=. python benchmarks/profile_prefill.py --batch-size 16 --input-len 130` loads the default model with
the default arithmetic plan, times a few prefills (tok/s) and prints the aten operators of one by self CPU time.
Compiled kernels of the project's own extensions are not aten operators: they are the rest of the wall time.
`--cpu-gemm bfloat16|int8|float32` loads it with that large-batch GEMM instead of the plan's.
"""

from __future__ import annotations

import argparse

import torch

from sglang.bench_one_batch import build_runner, timed_prefill
from sglang.srt.model_loader.model_info import load_model_info
from sglang.srt.server_args import ServerArgs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=130)
    parser.add_argument("--cpu-gemm", default="auto", choices=["auto", "float32", "bfloat16", "int8"])
    args = parser.parse_args()
    info = load_model_info(ServerArgs(model_path=args.model_path, cpu_gemm=args.cpu_gemm))
    runner, mem = build_runner(info, "cpu", args.batch_size * (args.input_len + 8) + 64, args.batch_size, None)
    print(info.arithmetic.describe() if info.arithmetic is not None else "no arithmetic plan")

    def prefill() -> float:
        return timed_prefill(runner, mem, args.batch_size, args.input_len)

    prefill()
    tokens = args.batch_size * args.input_len
    print("prefill tok/s:", [round(tokens / prefill()) for _ in range(5)])
    with torch.profiler.profile() as prof:
        wall = prefill()
    print(f"profiled prefill: {wall * 1e3:.0f} ms wall")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
