"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm decoder."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed.parallel_state import TPGroup, get_tp_group
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
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise x; with `residual`, first add x into it in place and return (normed, residual).

        `out_dtype` (None: the computed dtype) is the dtype the caller's next projection multiplies in: a float32
        model's norm writes the bf16 input of a bf16 GEMM directly. With a float32 residual, x may be bf16 (that
        GEMM's output); it is added exactly, as its float32 conversion would be."""
        if _use_cpu_kernel(x, self.weight, residual, out_dtype):
            if residual is None:
                return cpu_ops.rms_norm(x, self.weight, self.variance_epsilon, out_dtype or torch.float32)
            normed = cpu_ops.fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon,
                                                out_dtype or torch.float32)
            return normed, residual
        if residual is None:
            normed = rms_norm(x, self.weight, self.variance_epsilon)
        else:
            residual.add_(x)
            normed = rms_norm(residual, self.weight, self.variance_epsilon)
        normed = normed if out_dtype is None else normed.to(out_dtype)
        return normed if residual is None else (normed, residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"


def _use_cpu_kernel(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor],
                    out_dtype: Optional[torch.dtype]) -> bool:
    """Whether the compiled kernels compute this norm: float32 weight and rows (x may be bf16 when a float32
    residual is added to), 2-D contiguous CPU tensors, a float32 or bf16 output."""
    rows = x if residual is None else residual
    if not (_cpu_rows(rows) and rows.dtype == torch.float32 and weight.dtype == torch.float32 and _cpu_rows(x)):
        return False
    x_ok = x.dtype == torch.float32 or (residual is not None and x.dtype == torch.bfloat16)
    return x_ok and out_dtype in (None, torch.float32, torch.bfloat16) and cpu_ops.available()


def _cpu_rows(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dim() == 2 and t.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dimension of x and scale by weight.

    Low-precision inputs are normalised in float32 and rounded back before the weight multiply, the same
    rounding points as the reference implementation, so bf16 outputs match it exactly.
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return weight * normed


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a vector whose channels are split over tensor-parallel ranks (OLMo 2's q/k norms over all heads):
    this rank holds channels [start, start + size) of `full_size` and their weights; the sum of squares is added up
    over the ranks before each rank normalises its own channels."""

    def __init__(self, full_size: int, start: int, size: int, eps: float, tp: TPGroup,
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device | str] = None) -> None:
        super().__init__()
        self.full_size, self.start, self.size = full_size, start, size
        self.variance_epsilon = eps
        self.tp = tp
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def checkpoint_slicers(self) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        def weight(t: torch.Tensor) -> torch.Tensor:
            return t.narrow(0, self.start, self.size) if t.dim() == 1 and t.shape[0] == self.full_size else t

        return {"weight": weight}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = self.tp.all_reduce(xf.square().sum(dim=-1, keepdim=True))
        normed = (xf * torch.rsqrt(squares / self.full_size + self.variance_epsilon)).to(x.dtype)
        return self.weight * normed

    def extra_repr(self) -> str:
        return f"{self.size} of {self.full_size} from {self.start}, eps={self.variance_epsilon}"


def rms_norm_over_heads(full_size: int, start: int, size: int, eps: float, dtype: Optional[torch.dtype],
                        device: Optional[torch.device | str]) -> nn.Module:
    """An RMSNorm over `full_size` channels of which this tensor-parallel rank holds [start, start + size): a plain
    RMSNorm without tensor parallelism."""
    tp = get_tp_group()
    if tp.size == 1:
        return RMSNorm(full_size, eps, dtype=dtype, device=device)
    return ShardedRMSNorm(full_size, start, size, eps, tp, dtype, device)
