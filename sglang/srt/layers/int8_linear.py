"""The int8 linear method: weights quantized per output channel, activations per token at run time, with the
activation columns of largest magnitude kept out of the int8 product.

`torch._int_mm` multiplies int8 by int8 into int32 (VNNI / AMX on CPUs that have them); the result is scaled back
by the token's and the channel's scales into float32. A few channels of a decoder's activations carry values tens of
times larger than the rest (SmolLM2's do), so one scale per token rounds every other channel to a few int8 steps:
per-token int8 alone changed 60 of 510 teacher-forced greedy choices of SmolLM2 (benchmarks/int8_gemm_accuracy.py).
So each call takes the `outlier_columns(K)` input columns with the largest absolute values in the batch out of the
int8 product and multiplies them separately, in float32 (or in bf16 on a CPU with native bf16), against the same
columns of the float weight, as LLM.int8() does: with 64 such columns the changed choices fall to a few near-ties,
no more than bf16 GEMMs move (benchmarks/RESULTS.md, 2026-11-26 evening). Selected only with `--cpu-gemm int8`
(see layers/arithmetic.py); tests/test_cpu_arithmetic*.py state its tolerance.

The quantization (column maxima, choice of the columns, per-token scales) and the rescaling of the int32 product
run as compiled kernels (csrc/int8_rows.h) where the CPU extension is built, in torch otherwise, with the same
results bit for bit. On a CPU without integer dot products `torch._int_mm` runs a generic loop (2-4 GOP/s on AVX2);
there `int8_matmul` multiplies the same int8 values as float32 GEMMs over K in chunks of at most 1,024, where every
partial sum is an integer below 2^24 and so exact in float32: the same int32 product, 15-40x faster there
(benchmarks/RESULTS.md, 2026-11-26 evening). `method_for_this_cpu` makes the method with this CPU's choices.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from typing import Optional

import torch

from sglang.srt.layers import cpu_ops
from sglang.srt.layers.cpu_classes import int8_matmul_native, int8_outlier_dtype
from sglang.srt.layers.linear import LinearMethod
from sglang.srt.layers.quantization.gguf_blocks import GGUFQuantWeight
from sglang.srt.model_loader.dtype import read_cpu_flags

# How many input columns stay out of the int8 product: 64 for SmolLM2's 576 and 1536 (measured), at most 1/8 of K.
MAX_OUTLIER_COLUMNS = 64


def outlier_columns(k: int) -> int:
    return min(MAX_OUTLIER_COLUMNS, k // 8)


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (int8 values, float32 scale per row [rows, 1])."""
    scale = t.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
    return torch.round(t / scale).clamp_(-127, 127).to(torch.int8), scale.float()


def split_quantize(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (xq [M, K] int8 with the outlier columns zero, scale [M, 1] float32, the outlier columns
    [k] int64 in ascending order, x's values there [M, k] float32). The columns are the k with the largest absolute
    value anywhere in x (the lower index first among equal values)."""
    if k and cpu_ops.available():
        xq, scale, cols, xo = cpu_ops.int8_split_quantize(x, k)
        return xq, scale.view(-1, 1), cols, xo
    return split_quantize_reference(x, k)


def split_quantize_reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor]:
    """`split_quantize` in torch."""
    colmax = x.abs().amax(dim=0)
    # the k largest, the lower index first among equal values (a stable sort of the negated maxima)
    cols = torch.sort(-colmax, stable=True).indices[:k].sort().values
    xo = x.index_select(1, cols)
    xq, scale = quantize_rows(x.index_fill(1, cols, 0.0))
    return xq, scale, cols, xo


# Rows of a weight quantized at a time when its int8 copy is made: the float32 temporaries of a slice stay in the
# allocator's reused pages, where whole-matrix ones (180 MB each for a 7B model's MLP) were faulted in afresh.
QUANTIZE_SLICE_ROWS = 1024


def quantized_transposed(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (its per-row int8 values transposed [K, N], the float32 scale of each row [N, 1]): the values
    of quantize_rows, made a slice of rows at a time."""
    n, k = weight.shape
    q_t = torch.empty(k, n, dtype=torch.int8)
    scale = torch.empty(n, 1, dtype=torch.float32)
    for start in range(0, n, QUANTIZE_SLICE_ROWS):
        end = min(n, start + QUANTIZE_SLICE_ROWS)
        q, scale[start:end] = quantize_rows(weight[start:end].float())
        q_t[:, start:end] = q.t()
    return q_t, scale


# Rows up to which the compiled VNNI kernel (csrc/int8_gemm_vnni.h) multiplies instead of torch._int_mm, whose s8 x s8
# path reorders the weight on every call. On a 2-core Zen 4: up to 16 rows it is 1.1-4.9x faster at every shape
# measured (SmolLM2-135M's and 1.7B's); from 24 rows it wins only where the weight is larger than the caches hold for
# the reorder (12-96 MB at the 1.7B shapes: 1.02-1.17x at 64 rows) and loses (0.45-0.97x) on weights of a few MB
# (benchmarks/RESULTS.md, "An int8 GEMM of few rows").
VNNI_MAX_ROWS = 16
VNNI_LARGE_WEIGHT_MAX_ROWS = 64
VNNI_LARGE_WEIGHT_BYTES = 8 << 20

# 127 * 127 * 1024 < 2**24: any partial sum over a chunk of this many products of int8 values is exact in float32.
EXACT_FLOAT_CHUNK = 1024


def int8_matmul(xq: torch.Tensor, wq_t: torch.Tensor, native: bool = True, vnni_rows: int = 0) -> torch.Tensor:
    """xq [M, K] int8 @ wq_t [K, N] int8 -> int32 [M, N]: torch._int_mm (`native`; the compiled VNNI kernel for up to
    `vnni_rows` rows: vnni_max_rows), or the same product from exact float32 GEMMs."""
    if native and xq.shape[0] <= vnni_rows:
        return cpu_ops.int8_gemm_vnni(xq, wq_t)
    if native:
        if xq.shape[0] <= 16:  # _int_mm wants more than 16 rows; pad small inputs
            pad = torch.zeros(17 - xq.shape[0], xq.shape[1], dtype=torch.int8)
            return torch._int_mm(torch.cat([xq, pad]), wq_t)[: xq.shape[0]]
        return torch._int_mm(xq, wq_t)
    x, w = xq.float(), wq_t.float()
    acc = torch.zeros(xq.shape[0], wq_t.shape[1], dtype=torch.int32)
    for start in range(0, x.shape[1], EXACT_FLOAT_CHUNK):
        end = start + EXACT_FLOAT_CHUNK
        acc.add_(torch.mm(x[:, start:end], w[start:end]).to(torch.int32))
    return acc


def vnni_max_rows(wq_t: torch.Tensor) -> int:
    """Up to how many rows the compiled VNNI kernel multiplies by wq_t [K, N] int8 on this CPU (int8_matmul); 0
    where it cannot."""
    if not (cpu_ops.available() and cpu_ops.int8_gemm_vnni_takes(*wq_t.shape)):
        return 0
    return VNNI_LARGE_WEIGHT_MAX_ROWS if wq_t.numel() >= VNNI_LARGE_WEIGHT_BYTES else VNNI_MAX_ROWS


def rescale_add(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                outliers: Optional[torch.Tensor]) -> torch.Tensor:
    """int32 acc [M, N] * x_scale [M, 1] * w_scale [1, N] (+ outliers [M, N], float32 or bf16) -> float32."""
    if cpu_ops.available():
        return cpu_ops.int8_rescale_add(acc, x_scale.view(-1), w_scale.view(-1), outliers)
    out = acc.float().mul_(x_scale).mul_(w_scale)
    return out if outliers is None else out.add_(outliers.float())


class Int8LinearMethod(LinearMethod):
    """`columns`: where the outlier columns' weights come from when the layer keeps no float weight of its own (its
    GGUF blocks: model_loader/q8_blocks.py); the layer's weight otherwise."""

    def __init__(self, weight: torch.Tensor, outlier_dtype: torch.dtype = torch.float32, native: bool = True,
                 columns: Optional[GGUFQuantWeight] = None, out_dtype: Optional[torch.dtype] = None) -> None:
        self.weight_t, scale = quantized_transposed(weight.detach())  # [K, N], the layout _int_mm takes
        self.weight_scale = scale.view(1, -1)
        self.out_dtype = out_dtype or weight.dtype
        self.columns = columns
        self.outlier_dtype = outlier_dtype
        self.outliers = outlier_columns(weight.shape[1])
        self.native = native  # torch._int_mm, or its exact float32 form (int8_matmul)
        self.vnni_rows = vnni_max_rows(self.weight_t) if native else 0  # few rows: the compiled VNNI kernel

    def apply(self, weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float().contiguous()
        xq, xs, cols, xo = split_quantize(x2, self.outliers)
        exact_float = not self.native and torch.get_float32_matmul_precision() == "highest"
        acc = int8_matmul(xq, self.weight_t, native=not exact_float, vnni_rows=self.vnni_rows)
        outliers = None
        if self.outliers:
            source = weight.index_select(1, cols) if self.columns is None else self.columns.columns(cols)
            w_cols = source.to(self.outlier_dtype)
            outliers = torch.mm(xo.to(self.outlier_dtype), w_cols.t())
        out = rescale_add(acc, xs, self.weight_scale, outliers).to(self.out_dtype)
        if bias is not None:
            out.add_(bias)
        return out.view(*shape[:-1], out.shape[-1])

    @property
    def nbytes(self) -> int:
        return self.weight_t.numel() + self.weight_scale.numel() * 4

    @property
    def weight_format(self) -> str:
        return "int8 GEMM copies"

    def describe(self) -> str:
        how = "" if self.native else ", multiplied as exact float32 GEMMs"
        return (f"int8 GEMM (per-token activation scales, the {self.outliers} largest input columns in "
                f"{'bf16' if self.outlier_dtype == torch.bfloat16 else 'float32'}{how})")


def method_for_this_cpu() -> Callable[..., Int8LinearMethod]:
    """Makes Int8LinearMethods with this CPU's choices: the outlier columns in bf16 where it has native bf16, and
    torch._int_mm where it has integer dot products (its exact float32 form elsewhere); layers/arithmetic.py. The
    maker takes the weight and, optionally, Int8LinearMethod's `columns` and `out_dtype`."""
    flags, machine = read_cpu_flags(), platform.machine()
    outlier_dtype, native = int8_outlier_dtype(flags, machine), int8_matmul_native(flags, machine)
    return lambda weight, **kw: Int8LinearMethod(weight, outlier_dtype, native, **kw)
