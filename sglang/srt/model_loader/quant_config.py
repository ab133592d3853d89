"""Which quantized format a checkpoint is stored in: its `quantization_config` read and checked, and `--quantization`.

A checkpoint says how its linear weights are stored in `config.json`'s `quantization_config` (older GPTQ and AWQ
exports keep it in `quantize_config.json` / `quant_config.json` beside it). The engine reads GPTQ, AWQ, FP8 and
compressed-tensors checkpoints by dequantizing each quantized weight to the checkpoint's float dtype as it is read
(model_loader/quantized_weights.py); where the plan makes blocks for small batches, 4- and 8-bit integer weights are
then served from Q4_1 / Q8_0 blocks made exactly from their integers (model_loader/checkpoint_blocks.py), else the
model serves the dequantized weights through its usual paths. `--quantization`
takes SGLang's method names: a supported one must agree with what the checkpoint holds, except SGLang's on-the-fly
modes `w8a8_int8` and `fp8` on a float checkpoint, whose decoder linear weights are quantized as they are read
(`OnlineScheme`, model_loader/online_quant.py) and then served as the checkpoint kind they become.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from sglang.srt.model_loader.dtype import checkpoint_dtype, dtype_name

# `--quantization` names this engine reads -> the checkpoint format they mean (SGLang's Marlin variants name a
# kernel, not a format: the checkpoints are plain GPTQ / AWQ).
FLAG_METHODS = {
    "gptq": "gptq", "gptq_marlin": "gptq", "awq": "awq", "awq_marlin": "awq", "fp8": "fp8",
    "compressed-tensors": "compressed-tensors", "gguf": "gguf", "mxfp4": "mxfp4", "w8a8_int8": "w8a8_int8",
}
# Methods that quantize a float checkpoint at load (fp8 also names an FP8 checkpoint, read as it is stored).
ONLINE_METHODS = ("w8a8_int8", "fp8")
# The key of the quantization_config the served model's config carries for an on-the-fly mode (OnlineScheme).
ONLINE_KEY = "quantized_at_load"
# Methods whose tensors the model's own weight loader reads (GPT-OSS's MXFP4 experts: model_loader/mxfp4.py): the
# checkpoint loads as a float one, and those tensors reach the model as published.
MODEL_READ_METHODS = ("mxfp4",)
# SGLang's other quantization methods: accepted names, refused with a clear message.
UNSUPPORTED_METHODS = (
    "aqlm", "bitsandbytes", "blockwise_int8", "deepspeedfp", "experts_int8", "fbgemm_fp8", "gptq_marlin_24", "marlin",
    "mixed_precision", "modelopt", "modelopt_fp4", "moe_wna16", "petit_nvfp4", "qoq", "qqq", "torchao",
    "tpu_int8", "w4afp8", "w8a8_fp8",
)
READ_METHODS = ("gptq", "awq", "fp8", "compressed-tensors")
# Where older exports keep the quantization settings when config.json has none.
SIDE_CONFIG_FILES = ("quantize_config.json", "quant_config.json")
# Tensors of activation / KV-cache quantization: read past (activations are quantized per token at run time where
# the engine quantizes them, and the KV cache has its own --kv-cache-dtype).
ACTIVATION_SCALE_SUFFIXES = ("input_scale", "input_zero_point", "output_scale", "output_zero_point", "k_scale",
                             "v_scale", "kv_scale", "q_scale")


class QuantizedCheckpointError(ValueError):
    """A quantized checkpoint that cannot be read: an unsupported method or setting, or a malformed tensor."""


def check_quantization_flag(name: Optional[str]) -> None:
    """`--quantization` must name a method this engine reads; others are refused naming what it reads."""
    if name is None or name in FLAG_METHODS:
        return
    readable = ", ".join(sorted(FLAG_METHODS))
    if name in UNSUPPORTED_METHODS:
        raise ValueError(f"--quantization {name} is not supported by this engine; it reads checkpoints quantized "
                         f"with: {readable}")
    raise ValueError(f"--quantization {name!r} is not a known quantization method; expected one of: {readable}")


@dataclass(frozen=True)
class GPTQScheme:
    bits: int
    group_size: int  # -1: one group over the whole input
    desc_act: bool
    sym: bool
    zero_offset: int  # 1 for v1 checkpoints (`checkpoint_format` gptq): they store every zero point minus one
    method: str = "gptq"

    def describe(self) -> str:
        group = f"group {self.group_size}" if self.group_size > 0 else "one group per column"
        extra = ", desc_act" if self.desc_act else ""
        return f"GPTQ {self.bits}-bit, {group}{extra}, {'symmetric' if self.sym else 'asymmetric'}"


@dataclass(frozen=True)
class AWQScheme:
    bits: int
    group_size: int
    method: str = "awq"

    def describe(self) -> str:
        group = f"group {self.group_size}" if self.group_size > 0 else "one group per column"
        return f"AWQ {self.bits}-bit, {group}, GEMM layout"


@dataclass(frozen=True)
class FP8Scheme:
    block: Optional[tuple[int, int]]  # weight_block_size: [out, in] of each `weight_scale_inv` block
    static_activations: bool
    method: str = "fp8"

    def describe(self) -> str:
        scales = f"{self.block[0]}x{self.block[1]} blocks" if self.block else "per-tensor / per-channel scales"
        return f"FP8 e4m3, {scales}"


@dataclass(frozen=True)
class CTWeights:
    """The weight settings of one compressed-tensors config group."""

    targets: tuple[str, ...]
    format: str  # pack-quantized | int-quantized | naive-quantized | float-quantized
    num_bits: int
    type: str  # int | float
    symmetric: bool
    strategy: str  # tensor | channel | group | block
    group_size: Optional[int]
    block: Optional[tuple[int, int]]

    def describe(self) -> str:
        how = {"group": f"group {self.group_size}", "block": f"{self.block} blocks"}.get(self.strategy, self.strategy)
        return f"{self.format} {self.type}{self.num_bits}, {how}"


@dataclass(frozen=True)
class CTScheme:
    groups: tuple[CTWeights, ...]
    activation_scales: bool
    method: str = "compressed-tensors"

    def describe(self) -> str:
        return "compressed-tensors " + "; ".join(dict.fromkeys(g.describe() for g in self.groups))

    def weights_for(self, module: str) -> Optional[CTWeights]:
        """The config group that quantizes `module`: a name or `re:` pattern target first, then a class target
        (`Linear`), as compressed-tensors matches them."""
        by_class = None
        for group in self.groups:
            for target in group.targets:
                if target.startswith("re:"):
                    if re.match(target[3:], module):
                        return group
                elif module == target or module.endswith("." + target):
                    return group
                elif target.endswith("Linear") and by_class is None:
                    by_class = group
        return by_class


@dataclass(frozen=True)
class OnlineScheme:
    """`--quantization w8a8_int8 / fp8` on a float checkpoint: its decoder linear weights quantized at load into a
    compressed-tensors int8 channel weight / an FP8 per-tensor weight (model_loader/online_quant.py), served as a
    checkpoint of that kind is (`served_as`)."""

    method: str  # w8a8_int8 | fp8

    @property
    def served_as(self) -> Union[CTScheme, FP8Scheme]:
        if self.method == "fp8":
            return FP8Scheme(block=None, static_activations=False)
        return CTScheme((CTWeights(("Linear",), "int-quantized", 8, "int", True, "channel", None, None),), False)

    @property
    def weights(self) -> str:
        return ("float8 e4m3 weights, one scale per tensor" if self.method == "fp8"
                else "int8 weights per output channel (fp16 scales)")

    def describe(self) -> str:
        return f"{self.method} ({self.weights}, quantized at load)"

    def settings(self) -> dict[str, Any]:
        """The quantization_config the served model's config carries: every process that loads the model (and a
        weight update) then quantizes it at load (`online_scheme_of`)."""
        return {"quant_method": self.method, ONLINE_KEY: True}


Scheme = Union[GPTQScheme, AWQScheme, FP8Scheme, CTScheme, OnlineScheme]


def read_quantization_config(model_dir: str) -> Optional[tuple[dict[str, Any], str]]:
    """(settings, file they came from): config.json's `quantization_config`, else a side file of older exports."""
    config_path = os.path.join(model_dir, "config.json")
    try:
        with open(config_path) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    settings = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if settings:
        return dict(settings), config_path
    for name in SIDE_CONFIG_FILES:
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                return dict(json.load(f)), path
    return None


def method_of(settings: dict[str, Any]) -> str:
    """The method named by `quant_method` (compressed_tensors spelled as SGLang spells it); older side files name
    none: AutoAWQ's have `w_bit` / `version`, AutoGPTQ's `bits`."""
    method = str(settings.get("quant_method") or "").lower().replace("compressed_tensors", "compressed-tensors")
    if method:
        return method
    if "w_bit" in settings or "version" in settings:
        return "awq"
    return "gptq" if "bits" in settings else ""


def resolve_quantization(model_dir: str, requested: Optional[str], from_gguf: bool = False) -> Optional[Scheme]:
    """The checkpoint's scheme (None for a float or GGUF checkpoint; an OnlineScheme for a float checkpoint with an
    on-the-fly `--quantization`), checked against `--quantization`. Raises QuantizedCheckpointError for a mismatch,
    an unsupported method or setting."""
    check_quantization_flag(requested)
    wanted = FLAG_METHODS.get(requested) if requested else None
    found = None if from_gguf else read_quantization_config(model_dir)
    method = "gguf" if from_gguf else (method_of(found[0]) if found else None)
    if requested in ONLINE_METHODS and method is None:
        return OnlineScheme(requested)
    if wanted is not None and method != wanted:
        where = f"its quantization_config ({found[1]}) says {method!r}" if found else (
            "it is a GGUF file" if from_gguf else f"it has no quantization_config ({model_dir}), and float "
            "checkpoints are quantized at load only by --quantization " + " or ".join(ONLINE_METHODS))
        online = (f" (--quantization {requested} quantizes a float checkpoint at load)"
                  if requested in ONLINE_METHODS else "")
        raise QuantizedCheckpointError(
            f"--quantization {requested} does not match the checkpoint: {where}{online}; drop --quantization or pass "
            "the checkpoint's method")
    if found is None or method in MODEL_READ_METHODS:
        return None
    return parse_scheme(found[0], found[1])


def _config_settings(config: Any) -> Any:
    """The quantization_config of a transformers config (or of its text config), as it is held."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "quantization_config", None) or getattr(text, "quantization_config", None)


def online_scheme_of(config: Any) -> Optional[OnlineScheme]:
    """The on-the-fly mode a served model's config carries (`OnlineScheme.settings`), or None."""
    settings = _config_settings(config)
    if isinstance(settings, dict) and settings.get(ONLINE_KEY) and method_of(settings) in ONLINE_METHODS:
        return OnlineScheme(method_of(settings))
    return None


def quantization_settings(model_dir: str, scheme: Scheme) -> dict[str, Any]:
    """The quantization_config that says how `scheme`'s weights are read: the checkpoint's own (config.json or an
    older export's side file), or the on-the-fly mode's."""
    if isinstance(scheme, OnlineScheme):
        return scheme.settings()
    found = read_quantization_config(model_dir)
    assert found is not None, model_dir
    return found[0]


def parse_scheme(settings: dict[str, Any], source: str) -> Scheme:
    method = method_of(settings)
    if method == "gptq":
        return _gptq(settings, source)
    if method == "awq":
        return _awq(settings, source)
    if method == "fp8":
        return _fp8(settings, source)
    if method == "compressed-tensors":
        return _compressed_tensors(settings, source)
    raise QuantizedCheckpointError(
        f"The checkpoint is quantized with {method or 'an unnamed method'!r} (quantization_config in {source}); this "
        f"engine reads {', '.join(READ_METHODS)} checkpoints")


def _setting(settings: dict[str, Any], source: str, *keys: str, default: Any = None) -> Any:
    for key in keys:
        if settings.get(key) is not None:
            return settings[key]
    if default is None:
        raise QuantizedCheckpointError(f"quantization_config in {source} has no {keys[0]!r}")
    return default


def _bits(value: Any, allowed: tuple[int, ...], what: str, source: str) -> int:
    if value not in allowed:
        raise QuantizedCheckpointError(f"{what} checkpoints with {value!r} bits are not supported (quantization_config "
                                       f"in {source}); supported: {', '.join(map(str, allowed))}")
    return int(value)


def _group_size(value: Any, what: str, source: str) -> int:
    if not isinstance(value, int) or (value <= 0 and value != -1):
        raise QuantizedCheckpointError(f"{what} group_size {value!r} in {source} is neither a positive size nor -1")
    return value


def _gptq(settings: dict[str, Any], source: str) -> GPTQScheme:
    bits = _bits(_setting(settings, source, "bits"), (2, 4, 8), "GPTQ", source)
    fmt = str(settings.get("checkpoint_format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantizedCheckpointError(f"GPTQ checkpoint_format {fmt!r} in {source} is not supported (gptq, gptq_v2)")
    return GPTQScheme(bits, _group_size(_setting(settings, source, "group_size", default=-1), "GPTQ", source),
                      bool(settings.get("desc_act", False)), bool(settings.get("sym", True)),
                      zero_offset=1 if fmt == "gptq" else 0)


def _awq(settings: dict[str, Any], source: str) -> AWQScheme:
    bits = _bits(_setting(settings, source, "bits", "w_bit"), (4,), "AWQ", source)
    version = str(settings.get("version") or "gemm").lower()
    if version != "gemm":
        raise QuantizedCheckpointError(f"AWQ version {version!r} in {source} is not supported: only the GEMM layout")
    if not settings.get("zero_point", True):
        raise QuantizedCheckpointError(f"AWQ without zero points (zero_point false in {source}) is not supported")
    return AWQScheme(bits, _group_size(_setting(settings, source, "group_size", "q_group_size"), "AWQ", source))


def _pair(value: Any, what: str, source: str) -> Optional[tuple[int, int]]:
    if value is None:
        return None
    if (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        return int(value[0]), int(value[1])
    raise QuantizedCheckpointError(f"{what} {value!r} in {source} is not two positive sizes")


def _fp8(settings: dict[str, Any], source: str) -> FP8Scheme:
    fmt = str(settings.get("fmt") or "e4m3").lower()
    if fmt != "e4m3":
        raise QuantizedCheckpointError(f"FP8 format {fmt!r} in {source} is not supported: only e4m3")
    return FP8Scheme(_pair(settings.get("weight_block_size"), "weight_block_size", source),
                     str(settings.get("activation_scheme") or "dynamic") == "static")


_CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")


def _compressed_tensors(settings: dict[str, Any], source: str) -> CTScheme:
    sparsity = settings.get("sparsity_config") or {}
    if sparsity and str(sparsity.get("format") or "dense") != "dense":
        raise QuantizedCheckpointError(f"compressed-tensors sparsity format {sparsity.get('format')!r} in {source} is "
                                       "not supported")
    groups: list[CTWeights] = []
    activations = False
    for name, group in (settings.get("config_groups") or {}).items():
        weights = group.get("weights")
        activations = activations or bool(group.get("input_activations"))
        if not weights:
            continue
        fmt = str(group.get("format") or settings.get("format") or "")
        if fmt not in _CT_FORMATS:
            raise QuantizedCheckpointError(f"compressed-tensors format {fmt!r} (config group {name} in {source}) is "
                                           f"not supported; supported: {', '.join(_CT_FORMATS)}")
        kind = str(weights.get("type") or "int")
        bits = weights.get("num_bits")
        if kind == "float":
            _bits(bits, (8,), "compressed-tensors float", source)
        elif kind != "int" or not isinstance(bits, int) or not 1 <= bits <= 8 or (fmt != "pack-quantized"
                                                                                   and bits != 8):
            raise QuantizedCheckpointError(f"compressed-tensors weights of type {kind!r} with {bits!r} bits (config "
                                           f"group {name} in {source}) are not supported")
        strategy = str(weights.get("strategy") or "tensor")
        if strategy not in ("tensor", "channel", "group", "block"):
            raise QuantizedCheckpointError(f"compressed-tensors strategy {strategy!r} (config group {name} in "
                                           f"{source}) is not supported")
        group_size = weights.get("group_size")
        if strategy == "group":
            group_size = _group_size(group_size, "compressed-tensors", source)
        block = _pair(weights.get("block_structure"), "block_structure", source) if strategy == "block" else None
        if strategy == "block" and block is None:
            raise QuantizedCheckpointError(f"compressed-tensors block strategy without block_structure in {source}")
        groups.append(CTWeights(tuple(group.get("targets") or ("Linear",)), fmt, int(bits), kind,
                                bool(weights.get("symmetric", True)), strategy, group_size, block))
    if not groups:
        raise QuantizedCheckpointError(f"compressed-tensors quantization_config in {source} quantizes no weights")
    return CTScheme(tuple(groups), activations)


def dequantized_dtype(config: Any, scheme: Scheme) -> torch.dtype:
    """The dtype quantized weights are dequantized to: the checkpoint's own (`torch_dtype`), else the dtype GPTQ /
    AWQ scales are stored in (float16) or bf16 for the others. `config` is a transformers config or a directory."""
    stored = checkpoint_dtype(config)
    if stored in (torch.float16, torch.bfloat16, torch.float32):
        return stored
    if isinstance(scheme, OnlineScheme):
        return torch.float32  # a float checkpoint that does not say its dtype: nothing rounded beyond the format
    return torch.float16 if scheme.method in ("gptq", "awq") else torch.bfloat16


def describe_checkpoint_quantization(config: Any) -> Optional[str]:
    """`GPTQ 4-bit, group 128, ..., dequantized to float16 at load` for a config with a quantization_config, else
    None (the start of the `Weights:` log line)."""
    settings = _config_settings(config)
    scheme: Optional[Scheme] = online_scheme_of(config)
    if scheme is None:
        if not isinstance(settings, dict) or method_of(settings) not in READ_METHODS:
            return None
        scheme = parse_scheme(settings, "the model config")
    return f"{scheme.describe()}, dequantized to {dtype_name(dequantized_dtype(config, scheme))} at load"
