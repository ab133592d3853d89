"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm decoder."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers import cpu_ops


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise x; with `residual`, first add x into it in place and return (normed, residual)."""
        if _use_cpu_kernel(x, self.weight) and (residual is None or _use_cpu_kernel(residual, self.weight)):
            if residual is None:
                return cpu_ops.rms_norm(x, self.weight, self.variance_epsilon)
            return cpu_ops.fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon), residual
        if residual is None:
            return rms_norm(x, self.weight, self.variance_epsilon)
        residual.add_(x)
        return rms_norm(residual, self.weight, self.variance_epsilon), residual

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"


def _use_cpu_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.dim() == 2
            and x.is_contiguous() and cpu_ops.available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dimension of x and scale by weight.

    Low-precision inputs are normalised in float32 and rounded back before the weight multiply, the same
    rounding points as the reference implementation, so bf16 outputs match it exactly.
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return weight * normed
