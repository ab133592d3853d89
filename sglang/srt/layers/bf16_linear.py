"""Reduced-precision GEMM linear methods for float32 models: bf16 (and the row split that pairs a small-batch
method with a large-batch one).

A float32 model keeps its float32 weights (the GGUF blocks and the fused decode step need them); a
`BF16LinearMethod` holds a bf16 copy of the weight and multiplies bf16 inputs through oneDNN, accumulating in
float32 and returning float32, so the activations, the residual stream and the KV cache stay float32 on every
path. On CPUs with native bf16 dot products this is several times the float32 GEMM rate; elsewhere it is correct
but slow (sglang/srt/layers/arithmetic.py decides where it is used).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from sglang.srt.layers.linear import LinearMethod


class BF16LinearMethod(LinearMethod):
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach().to(torch.bfloat16).contiguous()

    def apply(self, weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        out = F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)
        return out if bias is None else out.add_(bias)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def describe(self) -> str:
        return "bf16 GEMM"


class RowSplitLinearMethod(LinearMethod):
    """`small` for inputs of at most `max_rows` token rows (decode batches), `large` beyond (prefill)."""

    def __init__(self, small: LinearMethod, large: LinearMethod, max_rows: int) -> None:
        self.small = small
        self.large = large
        self.max_rows = max_rows

    def apply(self, weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        method = self.small if rows <= self.max_rows else self.large
        return method.apply(weight, x, bias)

    def describe(self) -> str:
        return f"{self.small.describe()} up to {self.max_rows} rows, {self.large.describe()} beyond"
