"""Linear layers and the methods that multiply with them.

A `LinearMethod` is how a layer's matmul is computed: the dense float GEMM by default, the GGUF quantized blocks
(layers/quantization/gguf_linear.py) for small batches, and later bf16 / int8 / tensor-parallel shards. The model
builds `Linear` layers; the loader picks each layer's method once, at load time, with `set_linear_method`.
The LM head takes a method the same way (layers/logits_processor.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod(ABC):
    """Computes `x @ weight.T + bias` for one layer, from the layer's float weight or its own copy of it."""

    @abstractmethod
    def apply(self, weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor: ...

    def describe(self) -> str:
        return type(self).__name__


class DenseLinearMethod(LinearMethod):
    """The framework GEMM on the float weight (MKL / oneDNN on CPU, cuBLAS on CUDA)."""

    def apply(self, weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def describe(self) -> str:
        return "dense"


DENSE = DenseLinearMethod()


class Linear(nn.Linear):
    """`nn.Linear` whose matmul is delegated to a LinearMethod (dense unless the loader chose another)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device | str] = None) -> None:
        super().__init__(in_features, out_features, bias=bias, dtype=dtype, device=device)
        self.linear_method: LinearMethod = DENSE

    def set_linear_method(self, method: LinearMethod) -> None:
        self.linear_method = method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self.weight, x, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input in one matmul; the output rows are the shards, in order."""

    def __init__(
        self,
        in_features: int,
        shards: list[tuple[str, int]],
        bias: bool,
        dtype: Optional[torch.dtype],
        device: Optional[torch.device | str],
    ) -> None:
        super().__init__(in_features, sum(size for _, size in shards), bias, dtype, device)
        # checkpoint module name (e.g. "k_proj") -> (first output row, number of rows)
        self.shard_rows: dict[str, tuple[int, int]] = {}
        offset = 0
        for shard_name, size in shards:
            self.shard_rows[shard_name] = (offset, size)
            offset += size

    def load_shard(self, param_name: str, shard_name: str, tensor: torch.Tensor, checkpoint_name: str) -> None:
        start, size = self.shard_rows[shard_name]
        target = getattr(self, param_name).data.narrow(0, start, size)
        copy_checked(target, tensor, checkpoint_name)


def copy_checked(target: torch.Tensor, tensor: torch.Tensor, checkpoint_name: str) -> None:
    """Copy a checkpoint tensor into a parameter, refusing a shape mismatch with a message naming both."""
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(
            f"Checkpoint weight {checkpoint_name} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(target.shape)}"
        )
    target.copy_(tensor)
