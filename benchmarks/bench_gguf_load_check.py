"""Time of the load-time check that a GGUF file's blocks dequantize to the loaded weights
(sglang/srt/model_loader/gguf_values.py), by the size of the slices it compares.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_gguf_load_check.py [--gguf FILE] [--rounds 4]

Checks every Q4_1 / Q8_0 matrix of the file against its own dequantized copy (every candidate matches, so each
check reads the whole matrix), once per slice size per round, the sizes taking turns; prints the median per size.
"""

from __future__ import annotations

import argparse
import statistics
import time

from sglang.srt.layers.quantization.gguf_blocks import as_raw_tensor, dequantize_raw, normalize_qtype
from sglang.srt.model_loader import gguf_values
from sglang.srt.model_loader.gguf_reader import read_gguf_quant_tensors
from sglang.srt.model_loader.resolve import gguf_source_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="default: the packaged SmolLM2-135M-Instruct Q4_1 file")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    path = args.gguf or gguf_source_for("HuggingFaceTB/SmolLM2-135M-Instruct")
    mats = [(normalize_qtype(q), as_raw_tensor(raw, q, n, k), n, k)
            for q, raw, n, k in read_gguf_quant_tensors(path).values() if normalize_qtype(q) in ("Q4_1", "Q8_0")]
    targets = [dequantize_raw(*m) for m in mats]
    sizes = {"128 rows": lambda k: 128 * k, **{f"2^{e} values": (lambda k, e=e: 1 << e) for e in (18, 19, 20)}}
    times: dict[str, list[float]] = {name: [] for name in sizes}
    for _ in range(args.rounds):
        for name, values in sizes.items():
            start = time.perf_counter()
            for m, target in zip(mats, targets):
                assert gguf_values.dequantizes_to([m], target, values(m[3]))
            times[name].append(time.perf_counter() - start)
    print(f"{path}: {len(mats)} matrices, default slice {gguf_values.CHECK_SLICE_VALUES} values")
    for name, ts in times.items():
        print(f"{name:12s} median {statistics.median(ts):.3f} s  ({', '.join(f'{t:.2f}' for t in ts)})")


if __name__ == "__main__":
    main()
