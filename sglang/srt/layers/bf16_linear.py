"""The bf16 GEMM linear method for float32 models.

A float32 model keeps its float32 weights (the GGUF blocks and the fused decode step need them); a
`BF16LinearMethod` holds a bf16 copy of the weight and multiplies bf16 inputs through oneDNN, accumulating in
float32 and returning float32, so the activations, the residual stream and the KV cache stay float32 on every
path. On CPUs with native bf16 dot products this is several times the float32 GEMM rate; elsewhere it is correct
but slow (sglang/srt/layers/arithmetic.py decides where it is used).

Inside an MLP the bf16 stays: `apply_native` returns the gate/up GEMM's bf16 output as is, the activation reads
it and writes bf16, and down_proj multiplies that without converting it again.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from sglang.srt.layers.linear import LinearMethod


class BF16LinearMethod(LinearMethod):
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach().to(torch.bfloat16).contiguous()
        self.out_dtype = weight.dtype

    def apply(self, weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        out = F.linear(x.to(torch.bfloat16), self.weight).to(self.out_dtype)
        return out if bias is None else out.add_(bias)

    def apply_native(self, weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if bias is not None:  # the bias is added in the model's dtype
            return self.apply(weight, x, bias)
        return F.linear(x.to(torch.bfloat16), self.weight)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def describe(self) -> str:
        return "bf16 GEMM"

