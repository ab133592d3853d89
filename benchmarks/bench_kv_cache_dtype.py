"""Decode speed of a long generation per --kv-cache-dtype: TPOT of the first and the last 100 output tokens.

A batch-1 decode step late in a long generation reads more K/V than weights (3,000 tokens of SmolLM2-135M in
float32: ~138 MB per step), so a bf16 (fp8) cache should cut the late TPOT most. One Engine per KV dtype, one
streamed greedy generation each (ignore_eos), `--dtype float32` unless --dtype says otherwise (`--dtype auto
--kv-dtypes auto`: the default flags); each configuration runs `--runs` times and the
best run is reported (the machine may be shared).

    python benchmarks/bench_kv_cache_dtype.py --tokens 3000 --runs 3 --kv-dtypes float32 bfloat16 fp8_e4m3
"""

from __future__ import annotations

import argparse
import json
import time

from sglang import Engine

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle. Chapter 1:"


def one_generation(engine: Engine, tokens: int) -> list[float]:
    """Arrival time of each output token (a streamed chunk may carry several tokens: they share its time)."""
    params = {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}
    times: list[float] = []
    for chunk in engine.generate(prompt=PROMPT, sampling_params=params, stream=True):
        now = time.perf_counter()
        times.extend([now] * (chunk["meta_info"]["completion_tokens"] - len(times)))
    return times


def tpot_ms(times: list[float], first: int, last: int) -> float:
    """Mean time per output token between token `first` and token `last` (0-based), in ms."""
    return 1000 * (times[last] - times[first]) / (last - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kv-dtypes", nargs="+", default=["float32", "bfloat16", "fp8_e4m3"])
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    w = args.window
    for kv in args.kv_dtypes:
        engine = Engine(model_path=args.model_path, dtype=args.dtype, kv_cache_dtype=kv,
                        context_length=args.tokens + 256, max_total_tokens=args.tokens + 1024)
        try:
            one_generation(engine, 2 * w + 2)  # warm-up: kernels built, caches touched
            runs = []
            for _ in range(args.runs):
                times = one_generation(engine, args.tokens)
                runs.append((tpot_ms(times, 1, 1 + w), tpot_ms(times, len(times) - 1 - w, len(times) - 1)))
        finally:
            engine.shutdown()
        result = {"dtype": args.dtype, "kv_cache_dtype": kv, "tokens": args.tokens, "window": w,
                  "first_tpot_ms_best": round(min(r[0] for r in runs), 3),
                  "last_tpot_ms_best": round(min(r[1] for r in runs), 3),
                  "runs": [[round(a, 3), round(b, 3)] for a, b in runs]}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
