"""The bf16 GEMM linear method for float32 models.

A float32 model keeps its float32 weights (the GGUF blocks and the fused decode step need them); a
`BF16LinearMethod` holds a bf16 copy of the weight and multiplies bf16 inputs through oneDNN, accumulating in
float32 and returning float32, so the activations, the residual stream and the KV cache stay float32 on every
path. On CPUs with native bf16 dot products this is several times the float32 GEMM rate; elsewhere it is correct
but slow (sglang/srt/layers/arithmetic.py decides where it is used).

Inside an MLP the bf16 stays: `apply_native` returns the gate/up GEMM's bf16 output as is, the activation reads
it and writes bf16, and down_proj multiplies that without converting it again. Where torch has oneDNN the bf16
weight is reordered once into oneDNN's blocked layout (`_pack`) instead of on every call.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from sglang.srt.layers.linear import LinearMethod

# Rows the prepacked layout is tuned for (prefill batches); any row count is multiplied correctly.
PACK_ROWS_HINT = 1024


@functools.lru_cache(maxsize=1)
def _packing_works() -> bool:
    """Whether this torch's oneDNN packs and multiplies bf16 weights here, and agrees with F.linear: probed once
    on a small matrix (a build or CPU without it keeps the plain weight)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(16, 32, generator=gen).to(torch.bfloat16)
        x = torch.randn(3, 32, generator=gen).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.equal(out, F.linear(x, w)))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _pack(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """The bf16 weight reordered once into oneDNN's blocked layout, or None where that is unavailable. Measured on
    an AVX512-BF16 CPU: 5-10% faster than `F.linear`, which reorders the plain weight on every call, and
    bit-identical (benchmarks/RESULTS.md)."""
    if weight.device.type != "cpu" or not _packing_works():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)


class BF16LinearMethod(LinearMethod):
    def __init__(self, weight: torch.Tensor) -> None:
        plain = weight.detach().to(torch.bfloat16).contiguous()
        self.packed = _pack(plain)
        # the plain copy is kept only where there is no packed one
        self.weight: Optional[torch.Tensor] = plain if self.packed is None else None
        self.shape = tuple(plain.shape)
        self.out_dtype = weight.dtype

    def dense_weight(self) -> torch.Tensor:
        """The bf16 weight as a plain tensor."""
        if self.weight is not None:
            return self.weight
        assert self.packed is not None
        return self.packed.to_dense()

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight)

    def apply(self, weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        out = self._matmul(x).to(self.out_dtype)
        return out if bias is None else out.add_(bias)

    def apply_native(self, weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if bias is not None:  # the bias is added in the model's dtype
            return self.apply(weight, x, bias)
        return self._matmul(x)

    def input_dtype(self, rows: int) -> Optional[torch.dtype]:
        return torch.bfloat16

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * 2

    def describe(self) -> str:
        return "bf16 GEMM" + (" (prepacked)" if self.packed is not None else "")

    @property
    def weight_format(self) -> str:
        return "bfloat16 GEMM copies"
