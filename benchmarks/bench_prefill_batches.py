"""Prefill throughput by batch size, with the block kernels serving up to each of several row limits.

    PYTHONPATH=. python benchmarks/bench_prefill_batches.py --max-rows 512 2048 --batch-sizes 4 8 15 31

Builds one model runner (and KV memory) per `--gguf-kernel-max-rows` value for the default model and arithmetic
plan, then prefills batches of `--batch-sizes` random prompts of `--input-len` tokens, the runners taking turns
(each round in the other order), and prints the median and best tokens per second of each (batch, limit). A
batch of more tokens than a limit runs its matmuls on the large-batch GEMM, fewer on the quantized blocks, so
this compares the two kernels inside a real prefill (attention, norms, activations included), and batch sizes
with each other, which is what --chunked-prefill-size chooses.
"""

from __future__ import annotations

import argparse
import statistics

from sglang.bench_one_batch import build_runner, timed_prefill
from sglang.srt.model_loader.model_info import load_model_info
from sglang.srt.server_args import ServerArgs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--max-rows", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 8, 15, 31])
    parser.add_argument("--input-len", type=int, default=130)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    info = load_model_info(ServerArgs(model_path=args.model_path))
    print(info.arithmetic.describe() if info.arithmetic is not None else "no arithmetic plan")
    tokens = max(args.batch_sizes) * (args.input_len + 8) + 64
    runners = [(rows, *build_runner(info, "cpu", tokens, max(args.batch_sizes), rows)) for rows in args.max_rows]
    for _, runner, mem in runners:
        for bs in args.batch_sizes:
            timed_prefill(runner, mem, bs, args.input_len)
    rates: dict[tuple[int, int], list[float]] = {(rows, bs): [] for rows in args.max_rows for bs in args.batch_sizes}
    for r in range(args.rounds):
        for bs in args.batch_sizes:
            for rows, runner, mem in runners if r % 2 == 0 else reversed(runners):
                rates[(rows, bs)].append(bs * args.input_len / timed_prefill(runner, mem, bs, args.input_len))
    for bs in args.batch_sizes:
        cells = [f"max rows {rows}: {statistics.median(rates[(rows, bs)]):.0f} tok/s (best {max(rates[(rows, bs)]):.0f})"
                 for rows in args.max_rows]
        print(f"{bs} x {args.input_len} = {bs * args.input_len} tokens | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
