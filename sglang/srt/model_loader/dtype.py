"""Resolve `--dtype` (auto | bfloat16 | float16 | float32 and common aliases) to a torch dtype for a device."""

from __future__ import annotations

import functools
import json
import os
import platform
from typing import Any, Optional, Union

import torch

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}

# x86: native bf16 dot products (AVX512-BF16) or AMX tiles; without them bf16 matmuls are emulated and slower
# than float32. aarch64 reports the BF16 extension as "bf16" in its Features line.
_X86_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
_ARM_BF16_FLAGS = frozenset({"bf16"})


def parse_cpu_flags(cpuinfo_text: str) -> frozenset[str]:
    """The `flags` (x86) / `Features` (arm) words of /proc/cpuinfo text."""
    flags: set[str] = set()
    for line in cpuinfo_text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return frozenset(flags)


@functools.lru_cache(maxsize=1)
def read_cpu_flags() -> frozenset[str]:
    """This machine's CPU flags; the one place that reads /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpu_flags(f.read())
    except OSError:
        return frozenset()


def cpu_model_name() -> str:
    """This machine's CPU model as /proc/cpuinfo names it (the platform's processor string where it cannot)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _supports_bf16(flags: frozenset[str], machine: str) -> bool:
    machine = machine.lower()
    if machine in ("x86_64", "amd64", "i386", "i686"):
        return bool(flags & _X86_BF16_FLAGS)
    if machine in ("aarch64", "arm64"):
        return bool(flags & _ARM_BF16_FLAGS)
    return False


def cpu_supports_bf16_from(cpuinfo_text: str, machine: str) -> bool:
    """Decide bf16 support from /proc/cpuinfo text and the machine name (split out so it can be tested)."""
    return _supports_bf16(parse_cpu_flags(cpuinfo_text), machine)


def cpu_supports_bf16() -> bool:
    return _supports_bf16(read_cpu_flags(), platform.machine())


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32: how flags, logs and reports name a dtype."""
    return str(dtype).removeprefix("torch.")


def _as_dtype(value: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).lower().removeprefix("torch.")
    return _DTYPE_NAMES.get(name)


def resolve_dtype(dtype: str, device: str, config_dtype: Union[str, torch.dtype, None] = None) -> torch.dtype:
    """`auto` picks the fastest dtype that keeps quality: the checkpoint's half type on accelerators (bf16 when
    the checkpoint is float32), bf16 on CPUs with native bf16 math, float32 on other CPUs."""
    name = dtype.strip().lower()
    if name == "auto":
        if torch.device(device).type == "cpu":
            return torch.bfloat16 if cpu_supports_bf16() else torch.float32
        from_config = _as_dtype(config_dtype)
        if from_config in (torch.bfloat16, torch.float16):
            return from_config
        return torch.bfloat16
    resolved = _DTYPE_NAMES.get(name)
    if resolved is None:
        raise ValueError(f"Unknown dtype {dtype!r}; expected one of: auto, {', '.join(sorted(_DTYPE_NAMES))}")
    return resolved


def checkpoint_dtype(config: Any) -> Optional[torch.dtype]:
    """The dtype a checkpoint's config says its weights are stored in (`dtype` / `torch_dtype`), or None. `config` is
    a transformers config or a model directory."""
    if isinstance(config, (str, os.PathLike)):
        path = os.path.join(config, "config.json")
        try:
            with open(path) as f:
                raw = json.load(f)
        except (OSError, ValueError):
            return None
        text = raw.get("text_config") or {}
        value = raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    else:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        value = (getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
                 or getattr(text, "dtype", None) or getattr(text, "torch_dtype", None))
    return _as_dtype(value)
