"""How many token rows the quantized blocks (and the fused decode step) serve before the large-batch GEMM of the
arithmetic plan (layers/arithmetic.py) takes over, per CPU class: the plan's `small_batch_max_rows`."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

from sglang.srt.layers.cpu_classes import AMX, AVX2

if TYPE_CHECKING:
    from sglang.srt.layers.arithmetic import ArithmeticPlan

# How many rows the quantized blocks (and the fused decode step) serve before the large-batch GEMM takes over.
# Measured on an AVX512-BF16 / VNNI CPU (benchmarks/RESULTS.md, 2026-11-25): since the int8 activation quantizer
# runs in AVX512, the fused int8 decode step beats the layer-by-layer bf16 GEMM path at 40, 48 and 64 sequences of
# 130 tokens (1.1-1.3x) and at 48 and 64 of 400 (1.05-1.2x); at 128-256 the two tie. A CPU with AMX multiplies
# bf16 in its tile unit, several times faster than these AVX512 dot products, so there the bf16 GEMM keeps the
# batches above 32 rows (not measured on AMX: the limit it had before).
SMALL_BATCH_ROWS = 64
AMX_SMALL_BATCH_ROWS = 32
# Where large batches run float32 GEMMs on a CPU whose widest FMAs are AVX2's (no AVX512F), the blocks with float32
# activations convert each row group once for many rows (gguf_dequant_gemm.h) and beat the float32 GEMM up to about
# 2,048 rows: decode steps of 96 and 128 sequences 1.3-1.56x faster on the fused step (benchmarks/RESULTS.md,
# 2026-11-25 late evening); a prefill's 120 layer matmuls, each layer's weights read from memory as in a real
# prefill, 1.16x at 1,024 rows and 1.06-1.22x at 2,048 but 0.8-1.0x at 3,072-4,096, and whole prefills of 520-1,950
# tokens 1.08-1.18x (2026-11-26).
AVX2_SMALL_BATCH_ROWS = 2048
# Where the int8 GEMM serves large batches and the small ones read Q8_0 blocks (made at load or a GGUF file's) with
# int8 activations, a model of 1B parameters or more has layers large enough for the GEMM to win sooner. On a Zen 4
# CPU (AVX512-BF16 / VNNI, no AMX) at SmolLM2-1.7B's shape, with few rows multiplied by the compiled VNNI kernel
# (int8_linear.int8_matmul) and the outlier columns read from the blocks in one vector pass, a decode step of 24
# sequences took 288 ms layer by layer against 314 ms in the fused step (1.09x), 32: 345 against 407 ms, 48: 439
# against 612 ms, while at 16 the fused step stayed faster (198 against 241 ms) (benchmarks/RESULTS.md, "An int8 GEMM
# of few rows"; with torch._int_mm the two crossed between 48 and 64).
INT8_LARGE_MODEL_ROWS = 20
# Q4_1 blocks read half the bytes and cross later: a Q4_0 file of the 1.7B shape (served as Q4_1) decoded 24
# sequences at 0.96x on the int8 GEMM, 32 at 1.0x, 48 at 1.14x (the same section). Both apply only where the blocks
# take both activation terms: in the one-term form (below) the fused step outran the int8 GEMM at every row count up
# to 64 (1.7B: 48 sequences 387 against 491 ms, 64: 521 against 615 ms; its Q4_0 file, served as Q4_1: 24 sequences
# 191 against 339 ms, 48: 368 against 465 ms; the 7B shape: 32 sequences 774 against 1,003 ms, 64: 1,467 against
# 1,519 ms).
INT8_LARGE_MODEL_Q4_ROWS = 32
# A model of 1B parameters or more, by the float32 bytes of its linear weights (also where the CPU's prefill batches
# get smaller: model_info.default_chunked_prefill_size).
LARGE_MODEL_FLOAT_BYTES = 4 << 30


def small_batch_rows(plan: ArithmeticPlan, flags: frozenset[str] = frozenset(), activations: str = "float32",
                     linear_float_bytes: Optional[int] = None, blocks: Optional[str] = None) -> int:
    """The plan's small_batch_max_rows. `linear_float_bytes`: the float32 bytes of the model's linear weights (None
    where unknown); `blocks`: the block type small batches read ("q8_0" or "q4_1": made at load or most of a GGUF
    file's; None where unknown or the blocks of a quantized checkpoint)."""
    if plan.cpu_class == AMX and plan.large_batch_gemm == "bfloat16":
        return AMX_SMALL_BATCH_ROWS
    if (plan.cpu_class == AVX2 and "avx512f" not in flags and plan.large_batch_gemm == "float32"
            and activations == "float32"):
        return AVX2_SMALL_BATCH_ROWS
    if (plan.large_batch_gemm == "int8" and activations == "int8" and not plan.int8_one_term_rows
            and (linear_float_bytes or 0) >= LARGE_MODEL_FLOAT_BYTES):
        if blocks == "q8_0":
            return INT8_LARGE_MODEL_ROWS
        if blocks == "q4_1":
            return INT8_LARGE_MODEL_Q4_ROWS
    return SMALL_BATCH_ROWS


# From how many rows the int8 block matmuls of a model of 1B parameters or more take their input in the one-term form
# (layers/quantization/csrc/gguf_int8_input.h: one int8 term per block, each tile's 64 largest input columns in
# float32): a decode step of several rows is bound by the integer work, which the form halves. Fused decode steps at
# the 1.7B shape on a Zen 4 CPU (AVX512-VNNI), both terms against one: 4 sequences 62-69 against 64-69 ms and 6:
# 73-80 against 80-81 ms (a step of few rows is bound by reading the weights, and the columns cost their share), 8:
# 94-100 against 87 ms, 16: 179 against 138 ms, 32: 350 against 256 ms (benchmarks/RESULTS.md, "One activation
# term"). Smaller models keep both terms.
# SGLANG_GGUF_INT8_ONE_TERM_ROWS sets the row count for any model (0: never).
INT8_ONE_TERM_MIN_ROWS = 8
ONE_TERM_ENV = "SGLANG_GGUF_INT8_ONE_TERM_ROWS"


def one_term_rows(activations: str, linear_float_bytes: Optional[int] = None) -> int:
    """The plan's int8_one_term_rows: 0 (never) unless the block kernels take int8 activations."""
    if activations != "int8":
        return 0
    env = os.environ.get(ONE_TERM_ENV)
    if env is not None:
        if not env.strip().isdigit():
            raise ValueError(f"{ONE_TERM_ENV} must be a row count >= 0, got {env!r}")
        return int(env)
    return INT8_ONE_TERM_MIN_ROWS if (linear_float_bytes or 0) >= LARGE_MODEL_FLOAT_BYTES else 0


# The LM head is one matmul outside the fused step, so it takes whichever kernel is faster at its row count: its
# Q8_0 blocks with two int8 activation terms against the prepacked bf16 GEMM, measured for SmolLM2's 49152 x 576
# head on an AVX512-BF16 / VNNI CPU (benchmarks/RESULTS.md, 2026-11-25): blocks faster up to 12 rows, a tie at 16,
# the bf16 GEMM 1.3x faster at 32 and 1.4x at 64.
BF16_HEAD_SMALL_BATCH_ROWS = 16


def head_small_batch_rows(large_batch_gemm: str, rows: int) -> int:
    """The most rows the LM head runs on its quantized blocks, where other matmuls run them up to `rows`."""
    return min(rows, BF16_HEAD_SMALL_BATCH_ROWS) if large_batch_gemm == "bfloat16" else rows


def resolve_small_batch_rows(requested: Optional[int], plan: Optional[ArithmeticPlan]) -> int:
    """--gguf-kernel-max-rows as given, or (None) the plan's choice; 64 without a plan."""
    if requested is not None:
        return requested
    return plan.small_batch_max_rows if plan is not None else SMALL_BATCH_ROWS
