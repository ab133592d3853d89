"""Compiled CPU kernels for the decode step (csrc/cpu_ops.cpp) and whether they can be used.

- `paged_decode_attention` reads each sequence's K/V rows straight from the paged pool by slot index, once per
  KV head for all the query heads sharing them, instead of gathering a padded copy of every sequence's cache
  in every layer.
- `rms_norm` / `fused_add_rms_norm` replace the half-dozen aten ops of an RMSNorm (plus the residual add) with
  one pass; at batch 1 each aten op costs more in dispatch than in arithmetic.

All take float32 CPU tensors. When no C++ toolchain is available (or SGLANG_DISABLE_CPU_OPS=1) `available()`
is False and callers keep their torch implementations.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sglang.srt.layers.cpu_extension import CpuExtension

DISABLE_ENV = "SGLANG_DISABLE_CPU_OPS"
CSRC = Path(__file__).resolve().parent / "csrc"
_EXTENSION = CpuExtension("sglang_cpu_ops", CSRC / "cpu_ops.cpp", "CPU decode kernels", DISABLE_ENV,
                          headers=[CSRC / "cpu_kernels.h", CSRC / "kv_types.h"])


def available() -> bool:
    return _EXTENSION.available()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           kv_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D], caches [slots, Hkv, D], kv_indices [B, >= max seq_len] slots, seq_lens [B] -> [B, H, D]."""
    return _EXTENSION.module().decode_attention(q, k_cache, v_cache, kv_indices, seq_lens, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _EXTENSION.module().rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x in place; returns the RMSNorm of the new residual."""
    return _EXTENSION.module().fused_add_rms_norm(x, residual, weight, eps)
