"""Write a recorded expert distribution: the dump dictionary with torch.save, and a CSV with the same stem."""

from __future__ import annotations

import csv
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from sglang.srt.eplb.collectors import ExpertCollector

logger = logging.getLogger(__name__)

DUMP_DIR_ENV = "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"


def dump_dir() -> Path:
    return Path(os.environ.get(DUMP_DIR_ENV) or "/tmp")


def write_dump(collector: ExpertCollector) -> Path:
    """Save the collector's window to `expert_distribution_recorder_<time.time()>.pt` (and `.csv`) in
    $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR (default /tmp). Returns the .pt path."""
    data: dict[str, Any] = collector.dump_data()
    directory = dump_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"expert_distribution_recorder_{time.time()}.pt"
    logger.info("Write expert distribution to %s", path)
    torch.save(data, str(path))
    header, rows = collector.csv_rows(data)
    with open(path.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path
