"""Reading and checking a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`)."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

# The projections of a Llama-family decoder layer an adapter may target, as PEFT names them.
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_WEIGHT_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class LoraAdapterError(ValueError):
    """An adapter that cannot be served; the message names what is wrong."""


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    # (layer index, module name) -> (A [rank, in_features], B [out_features, rank])
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter_config(path: str) -> dict:
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise LoraAdapterError(f"LoRA adapter path {path!r} has no adapter_config.json")
    with open(config_file) as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise LoraAdapterError(f"{config_file} is not a JSON object")
    return config


def normalize_target_modules(value: object, where: str) -> tuple[str, ...]:
    """The adapter's (or the server's) target modules as a tuple of supported names ("all" / "all-linear": all)."""
    if value in ("all", "all-linear") or value == ["all"]:
        return SUPPORTED_MODULES
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(m, str) for m in value):
        raise LoraAdapterError(f"{where}: target_modules must be a list of module names")
    names = tuple(m.rsplit(".", 1)[-1] for m in value)
    unknown = sorted(set(names) - set(SUPPORTED_MODULES))
    if unknown:
        raise LoraAdapterError(f"{where}: unsupported LoRA target modules {unknown}; "
                               f"supported: {list(SUPPORTED_MODULES)}")
    return names


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st_file = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st_file):
        from safetensors.torch import load_file

        return load_file(st_file)
    bin_file = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(bin_file):
        return torch.load(bin_file, map_location="cpu", weights_only=True)
    raise LoraAdapterError(f"LoRA adapter path {path!r} has no adapter_model.safetensors")


def load_adapter(name: str, path: str, max_rank: int, allowed_modules: tuple[str, ...],
                 module_shapes: dict[str, tuple[int, int]], num_layers: int, dtype: torch.dtype) -> LoraAdapter:
    """Load the adapter at `path` and check it against the server's limits and the base model's shapes
    (`module_shapes`: module name -> (in_features, out_features))."""
    if not os.path.isdir(path):
        raise LoraAdapterError(f"LoRA adapter path {path!r} is not a directory")
    config = read_adapter_config(path)
    rank = config.get("r")
    if not isinstance(rank, int) or rank <= 0:
        raise LoraAdapterError(f"LoRA adapter {name!r}: adapter_config.json needs a positive integer r")
    if rank > max_rank:
        raise LoraAdapterError(f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoraAdapterError(f"LoRA adapter {name!r}: rank_pattern / alpha_pattern are not supported")
    targets = normalize_target_modules(config.get("target_modules"), f"LoRA adapter {name!r}")
    outside = sorted(set(targets) - set(allowed_modules))
    if outside:
        raise LoraAdapterError(f"LoRA adapter {name!r} targets {outside}, not in --lora-target-modules "
                               f"{list(allowed_modules)}")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(path).items():
        m = _WEIGHT_NAME.search(key)
        if m is None:
            raise LoraAdapterError(f"LoRA adapter {name!r}: unsupported weight {key}")
        layer, module, part = int(m.group(1)), m.group(2), m.group(3)
        if module not in targets or layer >= num_layers:
            raise LoraAdapterError(f"LoRA adapter {name!r}: weight {key} is outside the adapter's target "
                                   f"modules or the model's {num_layers} layers")
        parts.setdefault((layer, module), {})[part] = tensor
    if not parts:
        raise LoraAdapterError(f"LoRA adapter {name!r} has no LoRA weights")
    weights = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise LoraAdapterError(f"LoRA adapter {name!r}: layer {layer} {module} lacks lora_A or lora_B")
        in_features, out_features = module_shapes[module]
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise LoraAdapterError(
                f"LoRA adapter {name!r}: layer {layer} {module} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, the base model expects ({rank}, {in_features}) and ({out_features}, {rank})")
        weights[(layer, module)] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return LoraAdapter(name, path, rank, scaling, targets, weights)


@dataclass(frozen=True)
class LoraSpec:
    """One adapter to serve: its name, its PEFT directory, and whether it stays in memory for good."""

    name: str
    path: str
    pinned: bool = False


def _parse_lora_spec(value: str) -> LoraSpec:
    if value.lstrip().startswith("{"):
        try:
            entry = json.loads(value)
        except json.JSONDecodeError as e:
            raise LoraAdapterError(f"--lora-paths entry {value!r} is not valid JSON: {e}") from None
        name, path, pinned = entry.get("lora_name"), entry.get("lora_path"), entry.get("pinned", False)
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise LoraAdapterError(f"--lora-paths entry {value!r} needs non-empty lora_name and lora_path strings")
        if not isinstance(pinned, bool):
            raise LoraAdapterError(f"--lora-paths entry {value!r}: pinned must be true or false")
        return LoraSpec(name, path, pinned)
    name, sep, path = value.partition("=")
    if not sep:
        name = path = value
    if not name or not path:
        raise LoraAdapterError(f"--lora-paths entry {value!r} must be NAME=PATH, PATH, or "
                               '{"lora_name": ..., "lora_path": ..., "pinned": ...}')
    return LoraSpec(name, path)


def parse_lora_specs(values: list[str]) -> list[LoraSpec]:
    """`--lora-paths` entries as SGLang accepts them: `name=path`, a bare path (named by itself), or the JSON
    object `{"lora_name", "lora_path", "pinned"}`."""
    specs: list[LoraSpec] = []
    for value in values:
        spec = _parse_lora_spec(value)
        if any(s.name == spec.name for s in specs):
            raise LoraAdapterError(f"--lora-paths names adapter {spec.name!r} twice")
        specs.append(spec)
    return specs


def parse_lora_paths(values: list[str]) -> dict[str, str]:
    """`--lora-paths` as adapter name -> path, in order."""
    return {spec.name: spec.path for spec in parse_lora_specs(values)}
