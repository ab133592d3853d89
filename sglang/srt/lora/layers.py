"""Per-request LoRA on the linear layers: each layer adds `scale * (x @ A^T) @ B^T` to the rows of the requests
that use an adapter, segment by segment; rows without one are left as the base layer computed them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch

# One LoRA part of a layer: (A [rank, in], B [rows, rank], scaling, first output row of its slice).
LoraPart = tuple[torch.Tensor, torch.Tensor, float, int]


class LoraBatchState:
    """The adapter segments of the forward that is running: (first row, end row, adapter name), shared by every
    LoRA layer of the model. Empty outside a forward with adapter rows."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, int, str]] = []

    def set_rows(self, lora_names: list[Optional[str]], rows_per_seq: list[int]) -> None:
        segments: list[tuple[int, int, str]] = []
        start = 0
        for name, rows in zip(lora_names, rows_per_seq):
            if name is not None and rows:
                if segments and segments[-1][2] == name and segments[-1][1] == start:
                    segments[-1] = (segments[-1][0], start + rows, name)  # neighbours with one adapter: one matmul
                else:
                    segments.append((start, start + rows, name))
            start += rows
        self.segments = segments


class LoraLinear:
    """Attached to a Linear as its `lora`: the adapters' parts for that layer, by adapter name. A fused layer
    (qkv_proj, gate_up_proj) has one part per projection it holds, each writing its slice of the output."""

    def __init__(self, state: LoraBatchState) -> None:
        self.state = state
        self.parts: dict[str, list[LoraPart]] = {}

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        for start, end, name in self.state.segments:
            parts = self.parts.get(name)
            if not parts:
                continue
            xs = x[start:end]
            for a, b, scaling, row in parts:
                delta = (xs.to(a.dtype) @ a.t()) @ b.t()
                out[start:end, row : row + b.shape[0]] += (delta * scaling).to(out.dtype)
        return out


@contextmanager
def lora_rows(state: Optional[LoraBatchState], lora_names: Optional[list[Optional[str]]],
              rows_per_seq: list[int]) -> Iterator[None]:
    """The LoRA segments of one forward, set for its duration (nothing to do for a batch without adapters)."""
    if state is None or lora_names is None:
        yield
        return
    state.set_rows(lora_names, rows_per_seq)
    try:
        yield
    finally:
        state.segments = []
