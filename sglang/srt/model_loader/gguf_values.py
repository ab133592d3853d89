"""Whether GGUF blocks hold given float values bit for bit: the checks that pick a file tensor for a loaded weight
(model_loader/gguf_quant.py) and that blocks converted at load still hold a weight's values. Values are compared a
slice of rows at a time, so the dequantized copy stays in cache and a wrong candidate is rejected at its first
slice."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Optional

import torch

from sglang.srt.layers.quantization.gguf_blocks import ROW_GROUP, GGUFQuantWeight, RawBlocks
from sglang.srt.model_loader.gguf_block_convert import file_values

# What a candidate for one weight yields: one matrix, or several stacked along N (fused QKV, gate/up).
Parts = list[RawBlocks]

# Weights compared per slice when checking a candidate: a few MB of float32, so the dequantized copy stays in cache,
# in slices large enough that the per-op overheads of the dequantization stay small. SmolLM2-135M's check took
# 0.94-1.06 s in slices of 128 rows and 0.45-0.47 s in slices of this many values on 2 AVX2 cores
# (benchmarks/bench_gguf_load_check.py).
CHECK_SLICE_VALUES = 1 << 20


def dequantizes_to(parts: Parts, target: torch.Tensor, slice_values: Optional[int] = None) -> bool:
    """Whether the stacked matrices' stored values equal `target` bit for bit (a bf16 target: the bf16 rounding of
    those values, which still tells a wrong row order or tensor apart). Compared a slice of rows (of about
    `slice_values` values, default CHECK_SLICE_VALUES) at a time, so the float copy stays in cache and a wrong
    candidate is rejected at its first slice instead of after the whole weight."""
    if (target.dim() != 2 or target.dtype not in (torch.float32, torch.bfloat16)
            or target.shape[0] != sum(p[2] for p in parts) or any(p[3] != target.shape[1] for p in parts)):
        return False
    offset = 0
    for qtype, raw, n, k in parts:
        rows_per_slice = max(1, (slice_values or CHECK_SLICE_VALUES) // k)
        if not _slices_equal(partial(_file_rows, qtype, raw, k), n, rows_per_slice, target[offset : offset + n]):
            return False
        offset += n
    return True


def _file_rows(qtype: str, raw: torch.Tensor, k: int, start: int, count: int) -> torch.Tensor:
    return file_values(qtype, raw[start : start + count], count, k)


def holds(weight: GGUFQuantWeight, target: torch.Tensor) -> bool:
    """Whether blocks converted at load still hold `target`'s values exactly (compared as `dequantizes_to` does, a
    slice of rows at a time, read from the packed blocks)."""
    if target.shape != weight.shape or target.dtype not in (torch.float32, torch.bfloat16):
        return False
    if target.is_meta:  # never loaded (model_loader/gguf_tables.py): its values are the file's, which the blocks hold
        return True
    step = max(ROW_GROUP, CHECK_SLICE_VALUES // weight.k // ROW_GROUP * ROW_GROUP)
    return _slices_equal(weight.dequantize_rows, weight.n, step, target)


def _slices_equal(read: Callable[[int, int], torch.Tensor], n: int, rows_per_slice: int,
                  target: torch.Tensor) -> bool:
    """Whether read(start, count), float32 values of rows start .. start + count of n, equal `target`'s rows in its
    dtype, compared `rows_per_slice` rows at a time (stopping at the first slice that differs)."""
    for start in range(0, n, rows_per_slice):
        count = min(rows_per_slice, n - start)
        if not torch.equal(read(start, count).to(target.dtype), target[start : start + count]):
            return False
    return True
