"""Compiled CPU kernels for attention and normalization (csrc/cpu_ops.cpp) and whether they can be used.

- `paged_decode_attention` reads each sequence's K/V rows straight from the paged pool by slot index, once per
  KV head for all the query heads sharing them, instead of gathering a padded copy of every sequence's cache
  in every layer.
- `extend_attention` does the same for the new tokens of a prefill or extend batch: all sequences in one call,
  causal from each sequence's cached prefix on, in tiles of K/V rows shared by a KV head's query group.
  Both take a sliding window (`window` > 0: a query sees only the last `window` positions up to its own, as
  transformers' sliding-window masks do); keys before it are never read.
- `rope_in_place` rotates the query and key heads where the projection wrote them (one pass, no copies).
- `silu_and_mul` computes an MLP's activation in one pass over the fused gate/up output, float32 or bf16 (the
  output of the bf16 GEMM goes straight to the bf16 GEMM of down_proj without a float32 round trip).
- `rms_norm` / `fused_add_rms_norm` replace the half-dozen aten ops of an RMSNorm (plus the residual add) with
  one pass; at batch 1 each aten op costs more in dispatch than in arithmetic. They read a bf16 GEMM's output
  and write the bf16 input of the next one where the model asks (no separate conversions).
- `store_kv` writes a layer's new K/V rows into the pool, converted, in one pass.
- `argmax_rows` is torch.argmax over the last dimension in one vectorized pass (aten's takes ~60 us for a
  49k-token vocabulary row, single-threaded or not; greedy decoding runs it for every sequence of every step).
- `int8_split_quantize` / `int8_rescale_add` quantize the int8 GEMM's activations per token with the largest columns
  kept apart, and scale its int32 product back, each in one pass (layers/int8_linear.py).

All take float32 CPU tensors (silu_and_mul also bf16, the norms' x also bf16). When no C++ toolchain is available (or
SGLANG_DISABLE_CPU_OPS=1) `available()` is False and callers keep their torch implementations.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from sglang.srt.layers.cpu_extension import CpuExtension

DISABLE_ENV = "SGLANG_DISABLE_CPU_OPS"
CSRC = Path(__file__).resolve().parent / "csrc"
_EXTENSION = CpuExtension("sglang_cpu_ops", CSRC / "cpu_ops.cpp", "CPU decode kernels", DISABLE_ENV,
                          headers=[CSRC / "cpu_kernels.h", CSRC / "kv_types.h", CSRC / "kv_layout.h",
                                   CSRC / "decode_attention.h", CSRC / "decode_attention_avx512.h",
                                   CSRC / "extend_attention.h", CSRC / "extend_attention_bf16.h",
                                   CSRC / "int8_rows.h", CSRC / "int8_gemm_vnni.h", CSRC / "vpdpbusd.h",
                                   CSRC / "buffer_cache.h"])


def available() -> bool:
    return _EXTENSION.available()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           kv_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           window: int = 0) -> torch.Tensor:
    """q [B, H, D], caches [slots, Hkv, D], kv_indices [B, >= max seq_len] slots, seq_lens [B] -> [B, H, D];
    window > 0: each sequence's last `window` tokens only."""
    return _EXTENSION.module().decode_attention(q, k_cache, v_cache, kv_indices, seq_lens, scale, window)


def set_decode_attention_avx512(on: bool) -> bool:
    """Turn the AVX512 path of bf16 decode attention in this module's kernels on (only where the CPU has AVX512F/BW)
    or off; returns whether it was on. SGLANG_DECODE_ATTENTION_AVX2=1 starts every process with it off."""
    return bool(_EXTENSION.module().set_decode_attention_avx512(on))


def has_decode_attention_avx512() -> bool:
    """Whether bf16 decode attention can take the AVX512 path here (this CPU, this build)."""
    return bool(_EXTENSION.module().has_decode_attention_avx512())


def set_extend_attention_bf16(on: bool) -> bool:
    """Turn AVX512-BF16 dot products in extend attention over bf16 K/V on (only where the CPU has them) or off;
    returns whether they were on. The model runner sets them from the arithmetic plan (`prefill_attention`)."""
    return bool(_EXTENSION.module().set_extend_attention_bf16(on))


def has_extend_attention_bf16() -> bool:
    """Whether extend attention over bf16 K/V can use AVX512-BF16 dot products here (this CPU, this build)."""
    return bool(_EXTENSION.module().has_extend_attention_bf16())


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indices: torch.Tensor,
                     token_starts: torch.Tensor, extend_lens: torch.Tensor, prefix_lens: torch.Tensor,
                     scale: float, window: int = 0) -> torch.Tensor:
    """Causal attention of the new tokens of each sequence: q [T, H, D] float32, caches [slots, Hkv, D],
    kv_indices [N, >= prefix + extend] slots of each sequence (its cached prefix, then its new tokens);
    token_starts, extend_lens, prefix_lens [N] int64 -> [T, H, D]. window > 0: the query at position p sees
    positions p - window + 1 .. p only."""
    return _EXTENSION.module().extend_attention(q, k_cache, v_cache, kv_indices, token_starts, extend_lens,
                                                prefix_lens, scale, window)


def rope_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate the first rotary_dim channels of x [T, heads, D] float32 (channels contiguous) in place; cos and sin
    are RotaryEmbedding.lookup rows [T, 1, rotary_dim]."""
    _EXTENSION.module().rope_in_place(x, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2d] float32 or bf16 (gate | up) -> silu(gate) * up [T, d] in x's dtype."""
    return _EXTENSION.module().silu_and_mul(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype = torch.float32
             ) -> torch.Tensor:
    """x [T, n] float32 -> RMSNorm(x) * weight as float32 or bf16 (`out_dtype`)."""
    return _EXTENSION.module().rms_norm(x, weight, eps, _bf16_out(out_dtype))


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """residual (float32) += x (float32 or bf16) in place; returns the RMSNorm of the new residual as float32 or
    bf16 (`out_dtype`)."""
    return _EXTENSION.module().fused_add_rms_norm(x, residual, weight, eps, _bf16_out(out_dtype))


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store k, v [T, Hkv, D] float32 at KV slots `loc` [T] int64 of the caches, converted to their dtype (float32,
    bf16 or fp8) exactly as KVPool.set_kv_buffer converts."""
    _EXTENSION.module().store_kv(k_cache, v_cache, loc, k, v)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, V] float32 -> int64 [M], the index of each row's largest value, exactly as torch.argmax(x, -1) (the
    first of equal maxima; the first NaN where a row has one)."""
    return _EXTENSION.module().argmax_rows(x)


def int8_split_quantize(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (int8 [M, K] with the k largest columns zero, scale [M], those columns [k] int64
    ascending, x's values there [M, k]): layers/int8_linear.split_quantize."""
    return _EXTENSION.module().int8_split_quantize(x, k)


def int8_rescale_add(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                     add: Optional[torch.Tensor]) -> torch.Tensor:
    """int32 acc [M, N] * x_scale [M] * w_scale [N] (+ add [M, N], float32 or bf16) -> float32 [M, N]."""
    return _EXTENSION.module().int8_rescale_add(acc, x_scale, w_scale, add)


def int8_gemm_vnni_takes(k: int, n: int) -> bool:
    """Whether `int8_gemm_vnni` runs on this CPU and build for a weight of K inputs and N outputs."""
    return bool(_EXTENSION.module().int8_gemm_vnni_takes(k, n))


def int8_gemm_vnni(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] int8 @ b [K, N] int8 -> int32 [M, N], torch._int_mm's values, with AVX512-VNNI in panels of b
    (faster than torch._int_mm for few rows). Only where int8_gemm_vnni_takes."""
    return _EXTENSION.module().int8_gemm_vnni(a, b)


def _bf16_out(out_dtype: torch.dtype) -> bool:
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the norm kernels write float32 or bfloat16, not {out_dtype}")
    return out_dtype == torch.bfloat16


def configure_buffer_cache(cap_bytes: int, min_bytes: int) -> None:
    """Install (once per process) the CPU allocator that keeps freed blocks of at least `min_bytes`, up to
    `cap_bytes` of them, for reuse (layers/cpu_buffers.py); cap 0 keeps none."""
    _EXTENSION.module().configure_buffer_cache(cap_bytes, min_bytes)


def buffer_cache_stats() -> tuple[int, int, int, int, int]:
    """(bytes kept, blocks kept, allocations served from kept blocks, large allocations made fresh, cap)."""
    return tuple(_EXTENSION.module().buffer_cache_stats())
