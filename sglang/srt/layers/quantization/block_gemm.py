"""Large batches multiplied from the same GGUF blocks that small batches read: one copy of the weights.

A layer whose only weights are its Q4_1 / Q8_0 blocks (model_loader/q8_blocks.py with `--large-batch-weights
blocks`) multiplies a batch of more rows than the block kernels serve by converting its blocks, a slab of output
rows at a time, into a scratch matrix (csrc/gguf_dequant_rows.h) and running the CPU's GEMM on each slab: the float32
GEMM (MKL) or the bf16 one (oneDNN: AVX512-BF16 or AMX), whichever the plan measured faster (layers/arithmetic.py).
Memory carries ~1.06 bytes per weight (Q8_0) from DRAM per forward plus the slab, which the GEMM reads back while it
is still in the caches, and the process holds no second copy of the weights: the point of this method.

The values multiplied are the blocks' own (d * q, + m for Q4_1): exactly in float32, rounded to bf16 for the bf16
GEMM, whose activations are rounded to bf16 too (products accumulate in float32, as in layers/bf16_linear.py).
"""

from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.nn.functional as F

from sglang.srt.layers.linear import LinearMethod
from sglang.srt.layers.quantization.gguf_blocks import GGUFQuantWeight, kernel_module
from sglang.srt.model_loader.dtype import dtype_name

# Bytes of one slab of converted weight rows. Larger slabs let the GEMM block its work better: at 1.7B shapes and
# 128-2,048 rows, float32 slabs of 16 MiB ran 0.96-1.04x a float32 copy of the weights, 4 MiB 0.89-0.93x, 1 MiB
# 0.79-0.85x (benchmarks/bench_block_gemm.py; benchmarks/RESULTS.md, 2026-11-27). One scratch buffer serves all layers.
SLAB_BYTES = 16 << 20


class _Scratch(threading.local):
    """One scratch buffer per thread and dtype, grown to the largest slab asked for and shared by every layer."""

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def take(self, rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = self.buffers.get(dtype)
        if buffer is None or buffer.numel() < rows * k:
            buffer = self.buffers[dtype] = torch.empty(rows * k, dtype=dtype)
        return buffer[: rows * k].view(rows, k)


_SCRATCH = _Scratch()


def slab_rows(k: int, dtype: torch.dtype = torch.bfloat16, slab_bytes: int = SLAB_BYTES) -> int:
    """Output rows per slab for an input width of k: a multiple of 16 (the row group of the packed blocks)."""
    return max(16, slab_bytes // (dtype.itemsize * k) // 16 * 16)


class BlockGEMMLinearMethod(LinearMethod):
    """The float32 or bf16 GEMM over a layer's GGUF blocks, converted one slab of output rows at a time."""

    def __init__(self, quant_weight: GGUFQuantWeight, compute_dtype: torch.dtype = torch.bfloat16,
                 out_dtype: torch.dtype = torch.float32, slab_bytes: int = SLAB_BYTES) -> None:
        if compute_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the block GEMM computes in float32 or bfloat16, not {compute_dtype}")
        self.quant_weight = quant_weight
        self.compute_dtype = compute_dtype
        self.out_dtype = out_dtype
        self.rows_per_slab = slab_rows(quant_weight.k, compute_dtype, slab_bytes)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, n] = x @ W.T in the compute dtype, x converted to it."""
        qw = self.quant_weight
        x = x.to(self.compute_dtype).reshape(-1, qw.k)
        ext = kernel_module()
        if ext is None:  # without the kernels: the same values, dequantized whole
            return F.linear(x, qw.dequantize().to(self.compute_dtype))
        q4 = qw.qtype == "Q4_1"
        if qw.n <= self.rows_per_slab:
            w = _SCRATCH.take(qw.n, qw.k, self.compute_dtype)
            ext.dequant_rows(qw.packed, q4, qw.n, qw.k, 0, w)
            return F.linear(x, w)
        out = torch.empty(x.shape[0], qw.n, dtype=self.compute_dtype)
        for n0 in range(0, qw.n, self.rows_per_slab):
            rows = min(self.rows_per_slab, qw.n - n0)
            w = _SCRATCH.take(rows, qw.k, self.compute_dtype)
            ext.dequant_rows(qw.packed, q4, qw.n, qw.k, n0, w)
            out[:, n0 : n0 + rows] = F.linear(x, w)
        return out

    def apply(self, weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        out = self._matmul(x).to(self.out_dtype).reshape(*x.shape[:-1], self.quant_weight.n)
        return out if bias is None else out.add_(bias)

    def apply_native(self, weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if bias is not None:  # the bias is added in the model's dtype
            return self.apply(weight, x, bias)
        return self._matmul(x).reshape(*x.shape[:-1], self.quant_weight.n)

    def input_dtype(self, rows: int) -> Optional[torch.dtype]:
        return self.compute_dtype

    @property
    def nbytes(self) -> int:
        return 0  # the blocks belong to the layer's GGUF method; nothing of its own

    def describe(self) -> str:
        return (f"{dtype_name(self.compute_dtype)} GEMM over the {self.quant_weight.qtype} blocks "
                f"(slabs of {self.rows_per_slab} rows)")
