"""The CPU classes the arithmetic plan distinguishes (layers/arithmetic.py), from /proc/cpuinfo flags.

Pure functions of the flags and the machine name, so that every class can be tested on any machine;
`read_cpu_flags` (model_loader/dtype.py) reads this machine's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# What the int8-activation kernels need (names as in /proc/cpuinfo).
VNNI_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
# What the bf16 dot products of prefill attention need.
BF16_DOT_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})

# CPU classes, from the flags that decide which GEMM is fastest.
AMX = "amx"
AVX512_BF16 = "avx512-bf16"
AVX2 = "avx2"
ARM_BF16 = "arm-bf16"
OTHER = "other"

NATIVE_BF16_CLASSES = (AMX, AVX512_BF16, ARM_BF16)


def is_x86(machine: str) -> bool:
    return machine.lower() in ("x86_64", "amd64")


def cpu_class(flags: Iterable[str], machine: str = "x86_64") -> str:
    flags = frozenset(flags)
    if machine.lower() in ("aarch64", "arm64"):
        return ARM_BF16 if "bf16" in flags else OTHER
    if "amx_bf16" in flags:
        return AMX
    if "avx512_bf16" in flags:
        return AVX512_BF16
    if "avx2" in flags:
        return AVX2
    return OTHER


def int8_outlier_dtype(flags: Iterable[str], machine: str = "x86_64") -> torch.dtype:
    """What the int8 GEMM multiplies its largest input columns in (layers/int8_linear.py): bf16 where the CPU has
    native bf16 dot products, float32 elsewhere."""
    return torch.bfloat16 if cpu_class(flags, machine) in NATIVE_BF16_CLASSES else torch.float32


# Flags under which torch._int_mm multiplies in integer dot-product instructions (AVX512-VNNI, AVX-VNNI, AMX).
# Elsewhere on x86 it runs a generic loop at 2-4 GOP/s (benchmarks/RESULTS.md, 2026-11-26 evening), and the int8
# GEMM multiplies the same int8 values as float32 instead, exactly (layers/int8_linear.int8_matmul).
INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def int8_matmul_native(flags: Iterable[str], machine: str = "x86_64") -> bool:
    """Whether the int8 GEMM calls torch._int_mm (True) or its exact float32 form (False)."""
    if not is_x86(machine):
        return True
    return bool(INT8_DOT_FLAGS & frozenset(flags))
