"""The GGUF-blocks linear method: small batches multiply straight from a GGUF file's Q4_1 / Q8_0 blocks.

The layer keeps its float weight (dequantized exactly, for prefill and large batches, where the dense GEMM is
compute-bound); a projection of at most `max_rows` token rows runs the quantized kernel instead, reading ~4.5
bits per weight instead of 32, which is what bounds a small decode step. The loader attaches the blocks only
where their dequantized values equal the float weight bit for bit, so both paths compute with the same weights.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.layers.linear import DENSE, LinearMethod
from sglang.srt.layers.quantization.gguf_blocks import GGUFQuantWeight


class GGUFLinearMethod(LinearMethod):
    def __init__(self, quant_weight: GGUFQuantWeight, max_rows: int, large: LinearMethod = DENSE) -> None:
        self.quant_weight = quant_weight
        self.max_rows = max_rows
        # The method for more than `max_rows` rows (dense float, or a bf16 copy: layers/arithmetic.py).
        self.large = large

    def apply(self, weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.max_rows:
            return self.quant_weight.linear(x, bias)
        return self.large.apply(weight, x, bias)

    def describe(self) -> str:
        return f"GGUF {self.quant_weight.qtype} blocks up to {self.max_rows} rows, {self.large.describe()} beyond"
