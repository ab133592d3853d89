"""Medians of repeated bench_one_batch runs: one markdown row per (configuration, batch size).

    python benchmarks/summarize_runs.py DIR  # reads DIR/<configuration>.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def main() -> None:
    print("| configuration | batch | runs | prefill tok/s (median) | decode step ms (median) | decode tok/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for path in sorted(Path(sys.argv[1]).glob("*.jsonl")):
        rows: dict[int, list[dict]] = defaultdict(list)
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            rows[rec["batch_size"]].append(rec)
        for batch, recs in sorted(rows.items()):
            prefill = statistics.median(r["prefill_tok_s"] for r in recs)
            step = statistics.median(r["decode_step_ms"] for r in recs)
            print(f"| {path.stem} | {batch} | {len(recs)} | {prefill:.1f} | {step:.1f} | {batch * 1000 / step:.1f} |")


if __name__ == "__main__":
    main()
