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
