"""Prefill throughput beside the page faults and kernel time it costs, for the large-buffer reuse
(layers/cpu_buffers.py) and its cap.

    PYTHONPATH=. python benchmarks/bench_prefill_faults.py --model-path M --batch-size 16 --input-len 128
    SGLANG_CPU_BUFFER_CACHE_MB=0 PYTHONPATH=. python benchmarks/bench_prefill_faults.py ...   (nothing kept)

Loads the model with the default plan, then prefills `--rounds` batches of `--batch-size` random prompts of
`--input-len` tokens and prints, for each, the tokens per second, the minor page faults and the user / kernel CPU
seconds of this process, and the buffer cache's counters (bytes kept, blocks kept, allocations served from kept
blocks, large allocations made fresh, cap). Also the load's time, faults and peak resident memory.
"""

from __future__ import annotations

import argparse
import resource
import time

from sglang.bench_one_batch import build_runner, timed_prefill
from sglang.srt.layers import cpu_ops
from sglang.srt.model_loader.model_info import load_model_info
from sglang.srt.server_args import ServerArgs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    info = load_model_info(ServerArgs(model_path=args.model_path))
    started, before = time.time(), resource.getrusage(resource.RUSAGE_SELF)
    runner, mem = build_runner(info, "cpu", args.batch_size * (args.input_len + 8) + 64, args.batch_size, None)
    after = resource.getrusage(resource.RUSAGE_SELF)
    print(f"load {time.time() - started:.1f} s, faults {after.ru_minflt - before.ru_minflt}, kernel "
          f"{after.ru_stime - before.ru_stime:.1f} s, peak resident {after.ru_maxrss / 1e6:.2f} GB")
    stats = cpu_ops.buffer_cache_stats if cpu_ops.available() else (lambda: "no CPU extension")
    tokens = args.batch_size * args.input_len
    for _ in range(args.rounds):
        before = resource.getrusage(resource.RUSAGE_SELF)
        wall = timed_prefill(runner, mem, args.batch_size, args.input_len)
        after = resource.getrusage(resource.RUSAGE_SELF)
        print(f"prefill {tokens / wall:.0f} tok/s, faults {after.ru_minflt - before.ru_minflt}, user "
              f"{after.ru_utime - before.ru_utime:.2f} s, kernel {after.ru_stime - before.ru_stime:.2f} s, "
              f"buffers {stats()}")


if __name__ == "__main__":
    main()
