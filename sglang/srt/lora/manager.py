"""The adapters a scheduler serves: loading, unloading, and which requests may share a batch."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.layers.linear import Linear, MergedLinear
from sglang.srt.lora.adapter import (
    SUPPORTED_MODULES,
    LoraAdapter,
    LoraAdapterError,
    load_adapter,
    normalize_target_modules,
    parse_lora_paths,
)
from sglang.srt.lora.layers import LoraBatchState, LoraLinear

logger = logging.getLogger(__name__)

# PEFT module name -> (attribute path of the layer holding it in a decoder layer, shard name in a fused layer)
_MODULE_SITES = {
    "q_proj": ("self_attn.qkv_proj", "q_proj"),
    "k_proj": ("self_attn.qkv_proj", "k_proj"),
    "v_proj": ("self_attn.qkv_proj", "v_proj"),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", "gate_proj"),
    "up_proj": ("mlp.gate_up_proj", "up_proj"),
    "down_proj": ("mlp.down_proj", None),
}


def _site(layer: nn.Module, path: str) -> Linear:
    module: Any = layer
    for part in path.split("."):
        module = getattr(module, part, None)
    if type(module) not in (Linear, MergedLinear):
        raise LoraAdapterError(f"LoRA serving needs a Llama-family decoder with plain linear layers; "
                               f"{path} of this model is {type(module).__name__}")
    return module


class LoraManager:
    def __init__(self, model: nn.Module, max_lora_rank: int, target_modules: Optional[list[str]],
                 max_loras_per_batch: int, dtype: torch.dtype) -> None:
        self.max_lora_rank = max_lora_rank
        self.max_loras_per_batch = max_loras_per_batch
        self.target_modules = (normalize_target_modules(target_modules, "--lora-target-modules")
                               if target_modules else SUPPORTED_MODULES)
        self.dtype = dtype
        self.device = next(model.parameters()).device
        self.state = LoraBatchState()
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not isinstance(layers, nn.ModuleList) or not layers:
            raise LoraAdapterError(f"LoRA serving needs a Llama-family decoder; {type(model).__name__} has none")
        self.num_layers = len(layers)
        # (layer, module) -> (the Linear, first output row, rows) of its slice of the layer's output
        self.sites: dict[tuple[int, str], tuple[Linear, int, int]] = {}
        for i, layer in enumerate(layers):
            for module in self.target_modules:
                path, shard = _MODULE_SITES[module]
                linear = _site(layer, path)
                if shard is not None:
                    if not isinstance(linear, MergedLinear):
                        raise LoraAdapterError(f"{path} of this model does not hold {module}")
                    row, rows = linear.shard_rows[shard]
                else:
                    row, rows = 0, linear.out_features
                if linear.lora is None:
                    linear.lora = LoraLinear(self.state)
                self.sites[(i, module)] = (linear, row, rows)
        self.module_shapes = {module: (self.sites[(0, module)][0].in_features, self.sites[(0, module)][2])
                              for module in self.target_modules}
        self.adapters: dict[str, LoraAdapter] = {}
        # A fresh id per load: the prefix cache keys an adapter's KV by it, so a reloaded name never reuses
        # the KV computed with the weights it had before.
        self.uids: dict[str, int] = {}
        self._next_uid = itertools.count(1)
        logger.info("LoRA enabled (max rank %d, target modules %s, %d adapters per batch); batches with adapter "
                    "rows run layer by layer, never through the fused CPU decode step",
                    max_lora_rank, list(self.target_modules), max_loras_per_batch)

    @classmethod
    def for_server(cls, args: Any, model: nn.Module, dtype: torch.dtype) -> Optional[LoraManager]:
        """The manager for the server's settings, with --lora-paths loaded; None when LoRA is off."""
        if not (args.enable_lora or args.lora_paths):
            return None
        manager = cls(model, args.max_lora_rank, args.lora_target_modules, args.max_loras_per_batch, dtype)
        for name, path in parse_lora_paths(args.lora_paths or []).items():
            manager.load(name, path)
        return manager

    # ---- adapters -------------------------------------------------------------------------------------
    def load(self, name: str, path: str) -> None:
        if not isinstance(name, str) or not name:
            raise LoraAdapterError("lora_name must be a non-empty string")
        if name in self.adapters:
            raise LoraAdapterError(f"The LoRA adapter {name!r} is already loaded; unload it first")
        adapter = load_adapter(name, path, self.max_lora_rank, self.target_modules, self.module_shapes,
                               self.num_layers, self.dtype)
        for (layer, module), (a, b) in adapter.weights.items():
            linear, row, _ = self.sites[(layer, module)]
            assert linear.lora is not None
            part = (a.to(self.device), b.to(self.device), adapter.scaling, row)
            linear.lora.parts.setdefault(name, []).append(part)
        self.adapters[name] = adapter
        self.uids[name] = next(self._next_uid)
        logger.info("Loaded LoRA adapter %s from %s (rank %d, modules %s)", name, path, adapter.rank,
                    list(adapter.target_modules))

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise LoraAdapterError(f"The LoRA adapter {name!r} is not loaded")
        for linear, _, _ in self.sites.values():
            assert linear.lora is not None
            linear.lora.parts.pop(name, None)
        del self.adapters[name]
        del self.uids[name]
        logger.info("Unloaded LoRA adapter %s", name)

    def loaded(self) -> dict[str, str]:
        """Adapter name -> path, in load order."""
        return {name: a.path for name, a in self.adapters.items()}

    # ---- scheduling -----------------------------------------------------------------------------------
    def resolve(self, lora_path: str) -> str:
        """The adapter's name for a request's `lora_path`, which may also give a loaded adapter's path."""
        if lora_path in self.adapters:
            return lora_path
        return next((name for name, a in self.adapters.items() if a.path == lora_path), lora_path)

    def check_request(self, lora_path: Optional[str]) -> Optional[str]:
        """Why a request naming `lora_path` cannot run (None: it can)."""
        if lora_path is not None and lora_path not in self.adapters:
            return (f"lora_path: the LoRA adapter {lora_path!r} is not loaded; "
                    f"loaded adapters: {sorted(self.adapters)}")
        return None

    def admits(self, lora_path: Optional[str], batch_loras: Iterable[Optional[str]]) -> bool:
        """Whether a request with `lora_path` fits a batch already running `batch_loras`
        (at most --max-loras-per-batch distinct adapters; the base model takes no slot)."""
        if lora_path is None:
            return True
        distinct = {name for name in batch_loras if name is not None}
        return lora_path in distinct or len(distinct) < self.max_loras_per_batch
