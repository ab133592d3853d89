"""The KV cache element type (`--kv-cache-dtype`) and the conversion every K/V store goes through.

On CPU a long generation's decode step reads more K/V bytes than weights, so storing K/V in bf16 (half the
bytes) or fp8 (a quarter) speeds decode up; the compiled kernels (layers/csrc/kv_types.h) read the stored type
directly and accumulate in float32. "auto" is settled with the rest of the arithmetic (layers/arithmetic.py,
choose_kv_cache_dtype): bf16 on an x86 CPU with AVX2 or better under the automatic plan, the model dtype elsewhere
(benchmarks/RESULTS.md has the measurements). fp8 uses a per-tensor scale of 1.0, like upstream's default: values
are clamped to the format's finite range (float8_e4m3fn has no infinity and would turn overflow into NaN).
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
KV_CACHE_DTYPE_CHOICES = ("auto", *KV_CACHE_DTYPES)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# What the compiled CPU decode kernels read directly.
KERNEL_KV_DTYPES = (torch.float32, torch.bfloat16, *FP8_DTYPES)


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPE_CHOICES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, got {name!r}")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the K/V buffers for an explicit name; "auto" here means the model dtype."""
    check_kv_cache_dtype(name)
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name]


def to_kv_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as stored in a `dtype` KV buffer: bf16 rounds to nearest even, fp8 clamps to its range first."""
    if x.dtype == dtype:
        return x
    if dtype in FP8_DTYPES:
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)
