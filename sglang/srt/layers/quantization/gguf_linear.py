"""The GGUF-blocks linear method: small batches multiply straight from a GGUF file's Q4_1 / Q8_0 blocks.

The layer keeps its float weight (dequantized exactly, for prefill and large batches, where the dense GEMM is
compute-bound); a projection of at most `max_rows` token rows runs the quantized kernel instead, reading ~4.5
bits per weight instead of 32, which is what bounds a small decode step. The loader attaches the blocks only
where their dequantized values equal the float weight bit for bit, so both paths compute with the same weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn

from sglang.srt.layers.linear import DENSE, LinearMethod, linear_methods
from sglang.srt.layers.quantization.gguf_blocks import GGUFQuantWeight

# Whether the running forward computes every row as it would be computed alone (rows_alone).
_rows_alone = False


@contextmanager
def rows_alone(on: bool = True) -> Iterator[None]:
    """Within: the int8 block matmuls keep both activation terms whatever their row count, so each row's output is
    the one it would have alone (the one-term form's columns are shared by a tile's rows). A speculative verify
    step runs so: each verified position must be computed as plain decoding computes it."""
    global _rows_alone
    before, _rows_alone = _rows_alone, _rows_alone or on
    try:
        yield
    finally:
        _rows_alone = before


class GGUFLinearMethod(LinearMethod):
    def __init__(self, quant_weight: GGUFQuantWeight, max_rows: int, large: LinearMethod = DENSE,
                 int8_activations: bool = False) -> None:
        self.quant_weight = quant_weight
        self.max_rows = max_rows
        # The method for more than `max_rows` rows (dense float, or a bf16 copy: layers/arithmetic.py).
        self.large = large
        # Quantize x to int8 per 32-value block for the kernel (the plan's gguf_activations) ...
        self.int8_activations = int8_activations
        # ... in the one-term form from this many rows (0: never; the plan's int8_one_term_rows)
        self.one_term_rows = 0

    def apply(self, weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.max_rows:
            one_term = self.int8_activations and 0 < self.one_term_rows <= x.shape[0] and not _rows_alone
            return self.quant_weight.linear(x.to(weight.dtype), bias, self.int8_activations, one_term)
        return self.large.apply(weight, x, bias)

    def apply_native(self, weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.max_rows:
            return self.apply(weight, x, bias)
        return self.large.apply_native(weight, x, bias)

    def input_dtype(self, rows: int) -> Optional[torch.dtype]:
        return None if rows <= self.max_rows else self.large.input_dtype(rows)

    def describe(self) -> str:
        act = ", int8 activations" if self.int8_activations else ""
        if self.int8_activations and self.one_term_rows:
            act += f" (one term from {self.one_term_rows} rows, except in speculative verify steps)"
        return (f"GGUF {self.quant_weight.qtype} blocks{act} up to {self.max_rows} rows, "
                f"{self.large.describe()} beyond")


def set_gguf_activations(model: nn.Module, activations: str, one_term_rows: int = 0) -> int:
    """Give every GGUF-blocks method of `model` (linear layers and the LM head) `activations` (float32 | int8), int8
    ones in the one-term form from `one_term_rows` rows (0: never); returns how many methods it set."""
    count = 0
    for method in linear_methods(model):
        if isinstance(method, GGUFLinearMethod):
            method.int8_activations = activations == "int8"
            method.one_term_rows = one_term_rows if method.int8_activations else 0
            count += 1
    return count
