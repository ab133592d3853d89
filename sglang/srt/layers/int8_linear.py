"""The int8 linear method: weights quantized per output channel, activations per token at run time.

`torch._int_mm` multiplies int8 by int8 into int32 (VNNI / AMX on CPUs that have them); the result is scaled
back by the token's and the channel's scales into float32. Selected only with `--cpu-gemm int8` (see
layers/arithmetic.py): it changes the logits by more than bf16 does (tests/test_cpu_arithmetic.py states the
tolerance).
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.layers.linear import LinearMethod


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (int8 values, float32 scale per row)."""
    scale = t.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
    return torch.round(t / scale).clamp_(-127, 127).to(torch.int8), scale.float()


class Int8LinearMethod(LinearMethod):
    def __init__(self, weight: torch.Tensor) -> None:
        q, scale = quantize_rows(weight.detach().float())
        self.weight_t = q.t().contiguous()  # [K, N], the layout _int_mm takes
        self.weight_scale = scale.view(1, -1)
        self.out_dtype = weight.dtype

    def apply(self, weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        xq, xs = quantize_rows(x2)
        if xq.shape[0] <= 16:  # _int_mm wants more than 16 rows; pad small inputs
            pad = torch.zeros(17 - xq.shape[0], xq.shape[1], dtype=torch.int8)
            acc = torch._int_mm(torch.cat([xq, pad]), self.weight_t)[: xq.shape[0]]
        else:
            acc = torch._int_mm(xq, self.weight_t)
        out = acc.float().mul_(xs).mul_(self.weight_scale).to(self.out_dtype)
        if bias is not None:
            out.add_(bias)
        return out.view(*shape[:-1], out.shape[-1])

    @property
    def nbytes(self) -> int:
        return self.weight_t.numel() + self.weight_scale.numel() * 4

    def describe(self) -> str:
        return "int8 GEMM (per-token activation scales)"
