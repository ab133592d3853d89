"""Gated activations applied to the output of a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers import cpu_ops


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = [gate | up] along the last dimension: [..., 2 * d] -> [..., d], in x's dtype.

    On CPU a float32 2-D input takes one compiled pass (cpu_ops.silu_and_mul); so does a bf16 one with
    `float32_math` (the bf16 GEMM output of a float32 model: computed in float32, rounded to bf16 once). A bf16
    model keeps the torch ops below, which round where the reference implementation does."""

    def forward(self, x: torch.Tensor, float32_math: bool = False) -> torch.Tensor:
        if (x.device.type == "cpu" and x.dim() == 2
                and (x.dtype == torch.float32 or (float32_math and x.dtype == torch.bfloat16))
                and cpu_ops.available()):
            return cpu_ops.silu_and_mul(x)
        d = x.shape[-1] // 2
        gate = F.silu(x[..., :d])
        # In place on the fresh silu output: one allocation instead of two.
        return gate.mul_(x[..., d:])


class GeluAndMul(nn.Module):
    """gelu(gate) * up for x = [gate | up] along the last dimension (GeGLU, as Gemma's MLP): [..., 2 * d] -> [..., d]
    in x's dtype. `approximate` is torch's: "tanh" for transformers' gelu_pytorch_tanh, "none" for the exact erf."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"approximate must be 'tanh' or 'none', not {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate).mul_(x[..., d:])

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
