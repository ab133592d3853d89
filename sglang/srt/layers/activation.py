"""Gated activations applied to the output of a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = [gate | up] along the last dimension: [..., 2 * d] -> [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        gate = F.silu(x[..., :d])
        # In place on the fresh silu output: one allocation instead of two.
        return gate.mul_(x[..., d:])
