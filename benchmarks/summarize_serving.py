"""Medians of repeated serving_compare.sh runs: one markdown row per workload, before and after.

    python benchmarks/summarize_serving.py DIR [DIR ...]  # each DIR holds before.jsonl and after.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def workload(rec: dict) -> str:
    if rec["dataset_name"] == "generated-shared-prefix":
        return f"shared prefix, {rec['max_concurrency']} concurrent"
    return "1 at a time" if rec["max_concurrency"] == 1 else f"{rec['max_concurrency']} concurrent"


def main() -> None:
    runs: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for directory in sys.argv[1:]:
        for label in ("before", "after"):
            path = Path(directory) / f"{label}.jsonl"
            for line in path.read_text().splitlines() if path.exists() else []:
                rec = json.loads(line)
                runs[(workload(rec), label)].append(rec)
    print("| workload | runs (before/after) | before: out tok/s | before: TTFT / TPOT ms | after: out tok/s | after: TTFT / TPOT ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in dict.fromkeys(w for w, _ in runs):
        cells = []
        for label in ("before", "after"):
            recs = runs.get((name, label), [])
            if not recs:
                cells += ["", ""]
                continue
            tput = statistics.median(r["output_throughput"] for r in recs)
            ttft = statistics.median(r["median_ttft_ms"] for r in recs)
            tpot = statistics.median(r["median_tpot_ms"] for r in recs)
            cells += [f"{tput:.1f}", f"{ttft:.0f} / {tpot:.1f}"]
        counts = "/".join(str(len(runs.get((name, label), []))) for label in ("before", "after"))
        print(f"| {name} | {counts} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
