"""The adapters a scheduler serves: loading, unloading, which are in memory (lora/pool.py), and which requests may
share a batch."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.layers.linear import ColumnParallelLinear, Linear, MergedLinear, RowParallelLinear, held_parameter
from sglang.srt.lora.adapter import (
    SUPPORTED_MODULES,
    LoraAdapter,
    LoraAdapterError,
    load_adapter,
    normalize_target_modules,
    parse_lora_specs,
)
from sglang.srt.lora.layers import LoraBatchState, LoraLinear, LoraPart
from sglang.srt.lora.packed import pack_adapter
from sglang.srt.lora.pool import AdapterPool
from sglang.srt.lora.tp_slice import RankSlice, rank_slice

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


def _site(layer: nn.Module, path: str, fused: bool) -> Linear:
    module: Any = layer
    for part in path.split("."):
        module = getattr(module, part, None)
    # under tensor parallelism the fused projections are column-parallel and the others row-parallel
    kinds = (Linear, MergedLinear, ColumnParallelLinear if fused else RowParallelLinear)
    if type(module) not in kinds:
        raise LoraAdapterError(f"LoRA serving needs a Llama-family decoder with plain linear layers; "
                               f"{path} of this model is {type(module).__name__}")
    return module


@dataclass
class _Registered:
    """An adapter the server serves by name, whether or not its weights are in memory now."""

    path: str
    pinned: bool
    # The prefix cache keys the adapter's K/V by this id: fresh per load, so a name loaded again (maybe from
    # another path) never reuses the K/V computed with the weights it had before.
    uid: int


class LoraManager:
    def __init__(self, model: nn.Module, max_lora_rank: int, target_modules: Optional[list[str]],
                 max_loras_per_batch: int, dtype: torch.dtype, max_loaded_loras: Optional[int] = None,
                 eviction_policy: str = "lru") -> None:
        self.max_lora_rank = max_lora_rank
        self.max_loras_per_batch = max_loras_per_batch
        self.target_modules = (normalize_target_modules(target_modules, "--lora-target-modules")
                               if target_modules else SUPPORTED_MODULES)
        self.dtype = dtype
        self.device = held_parameter(model).device
        self.state = LoraBatchState()
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not isinstance(layers, nn.ModuleList) or not layers:
            raise LoraAdapterError(f"LoRA serving needs a Llama-family decoder; {type(model).__name__} has none")
        self.num_layers = len(layers)
        # (layer, module) -> (the LoRA of the Linear holding it, first output row, rows) of its slice of the
        # layer's output. The LoraLinear objects, not the Linears: a weight update moves them to the new model.
        self.sites: dict[tuple[int, str], tuple[LoraLinear, int, int]] = {}
        # (layer, module) -> this rank's part of its adapter weights (all of them without tensor parallelism)
        self.slices: dict[tuple[int, str], RankSlice] = {}
        for i, layer in enumerate(layers):
            for module in self.target_modules:
                path, shard = _MODULE_SITES[module]
                linear = _site(layer, path, shard is not None)
                if shard is not None:
                    if not isinstance(linear, MergedLinear):
                        raise LoraAdapterError(f"{path} of this model does not hold {module}")
                    row, rows = linear.shard_rows[shard]
                else:
                    row, rows = 0, linear.out_features
                if linear.lora is None or linear.lora.state is not self.state:  # one manager per model
                    linear.lora = LoraLinear(self.state, linear.out_features)
                self.sites[(i, module)] = (linear.lora, row, rows)
                self.slices[(i, module)] = rank_slice(linear, shard, rows)
        self.layers = list({id(lora): lora for lora, _, _ in self.sites.values()}.values())
        # (layer, module) -> (output features of the linear holding it, its first output row, its rows)
        self.out_rows = {key: (lora.out_features, row, rows) for key, (lora, row, rows) in self.sites.items()}
        # module -> (in_features, out_features) of the full projection, which the adapter's weights must match
        self.module_shapes = {module: (self.slices[(0, module)].full_in, self.slices[(0, module)].full_out)
                              for module in self.target_modules}
        self.registered: dict[str, _Registered] = {}
        self.adapters: dict[str, LoraAdapter] = {}  # those whose weights are in memory (the pool's)
        self.pool = AdapterPool(max_loaded_loras, eviction_policy)
        # Adapters being unloaded: refused to new requests, gone once the requests using them finish.
        self.draining: set[str] = set()
        self._next_uid = itertools.count(1)
        logger.info("LoRA enabled (max rank %d, target modules %s, %d adapters per batch, %s adapters in memory, "
                    "%s eviction); the fused CPU decode step adds the deltas of the decode batches it serves, "
                    "prefills and larger batches add them layer by layer",
                    max_lora_rank, list(self.target_modules), max_loras_per_batch,
                    max_loaded_loras or "all", eviction_policy)

    @classmethod
    def for_server(cls, args: Any, model: nn.Module, dtype: torch.dtype) -> Optional[LoraManager]:
        """The manager for the server's settings, with --lora-paths loaded; None when LoRA is off."""
        if not (args.enable_lora or args.lora_paths):
            return None
        manager = cls(model, args.max_lora_rank, args.lora_target_modules, args.max_loras_per_batch, dtype,
                      args.max_loaded_loras, args.lora_eviction_policy)
        for spec in parse_lora_specs(args.lora_paths or []):
            manager.load(spec.name, spec.path, spec.pinned)
        return manager

    # ---- adapters -------------------------------------------------------------------------------------
    def load(self, name: str, path: str, pinned: bool = False, in_use: Collection[str] = ()) -> None:
        """Serve the adapter at `path` as `name`. Its weights stay in memory when the pool has room (evicting
        an adapter `in_use` does not name if needed); else they are read again on first use."""
        if not isinstance(name, str) or not name:
            raise LoraAdapterError("lora_name must be a non-empty string")
        if name in self.registered:
            raise LoraAdapterError(f"The LoRA adapter {name!r} is already loaded; unload it first")
        capacity = self.pool.capacity
        if pinned and capacity is not None and len(self.pool.pinned) + 1 >= capacity:
            raise LoraAdapterError(f"Cannot pin the LoRA adapter {name!r}: {len(self.pool.pinned)} adapters are "
                                   f"pinned and --max-loaded-loras {capacity} must leave room for one unpinned")
        adapter = self._read(name, path)
        if not self._make_room(in_use):
            if pinned:
                raise LoraAdapterError(f"Cannot pin the LoRA adapter {name!r}: every one of the "
                                       f"{capacity} loaded adapters is pinned or in use")
            self.registered[name] = _Registered(path, pinned, next(self._next_uid))
            logger.info("Registered LoRA adapter %s from %s; its weights load on first use", name, path)
            return
        self.registered[name] = _Registered(path, pinned, next(self._next_uid))
        self._attach(adapter, pinned)
        logger.info("Loaded LoRA adapter %s from %s (rank %d, modules %s%s)", name, path, adapter.rank,
                    list(adapter.target_modules), ", pinned" if pinned else "")

    def unload(self, name: str) -> None:
        if name not in self.registered:
            raise LoraAdapterError(f"The LoRA adapter {name!r} is not loaded")
        if name in self.adapters:
            self._detach(name)
        del self.registered[name]
        self.draining.discard(name)
        logger.info("Unloaded LoRA adapter %s", name)

    def loaded(self) -> dict[str, str]:
        """Adapter name -> path, in load order (those in memory and those evicted from it alike)."""
        return {name: r.path for name, r in self.registered.items()}

    @property
    def uids(self) -> dict[str, int]:
        return {name: r.uid for name, r in self.registered.items()}

    def ensure_resident(self, names: Collection[str], in_use: Collection[str]) -> bool:
        """Bring `names` into memory, evicting adapters neither they nor `in_use` name; False when there is no
        room now (every other adapter in memory is pinned or in use). Raises LoraAdapterError when an evicted
        adapter's files can no longer be read."""
        protected = set(names) | set(in_use)
        for name in names:
            if name in self.adapters:
                continue
            if not self._make_room(protected):
                return False
            record = self.registered[name]
            self._attach(self._read(name, record.path), record.pinned)
            logger.info("Loaded LoRA adapter %s again from %s", name, record.path)
        for name in names:
            self.pool.touch(name)
        return True

    def _read(self, name: str, path: str) -> LoraAdapter:
        """The adapter at `path`, checked whole, keeping this rank's part of it (lora/tp_slice.py)."""
        adapter = load_adapter(name, path, self.max_lora_rank, self.target_modules, self.module_shapes,
                               self.num_layers, self.dtype)
        adapter.weights = {key: self.slices[key].take(a, b) for key, (a, b) in adapter.weights.items()}
        return adapter

    def _make_room(self, protected: Collection[str]) -> bool:
        while self.pool.full():
            victim = self.pool.victim(protected)
            if victim is None:
                return False
            self._detach(victim)
            logger.info("Evicted LoRA adapter %s from memory (%s)", victim, self.pool.policy)
        return True

    def _attach(self, adapter: LoraAdapter, pinned: bool) -> None:
        # One copy of the weights, in the fused decode step's layout; the layers' parts are views of it (B scaled).
        packed, views = pack_adapter(adapter.weights, adapter.rank, adapter.scaling, self.num_layers, self.out_rows,
                                     self.device)
        adapter.weights = {}
        parts: dict[int, list[LoraPart]] = {}
        for (layer, module), (a, b) in views.items():
            lora, row, _ = self.sites[(layer, module)]
            parts.setdefault(id(lora), []).append((a, b, 1.0, row))
        for lora in self.layers:
            if id(lora) in parts:
                lora.set_parts(adapter.name, parts[id(lora)])
        self.state.add_packed(adapter.name, packed)
        self.adapters[adapter.name] = adapter
        self.pool.add(adapter.name, pinned)

    def _detach(self, name: str) -> None:
        for lora in self.layers:
            lora.drop(name)
        self.state.drop_packed(name)
        del self.adapters[name]
        self.pool.remove(name)

    # ---- scheduling -----------------------------------------------------------------------------------
    def resolve(self, lora_path: str) -> str:
        """The adapter's name for a request's `lora_path`, which may also give a loaded adapter's path."""
        if lora_path in self.registered:
            return lora_path
        return next((name for name, r in self.registered.items() if r.path == lora_path), lora_path)

    def check_request(self, lora_path: Optional[str]) -> Optional[str]:
        """Why a request naming `lora_path` cannot run (None: it can)."""
        if lora_path is None:
            return None
        if lora_path in self.draining:
            return f"lora_path: the LoRA adapter {lora_path!r} is being unloaded"
        if lora_path not in self.registered:
            return (f"lora_path: the LoRA adapter {lora_path!r} is not loaded; "
                    f"loaded adapters: {sorted(self.registered)}")
        return None

    def admits(self, lora_path: Optional[str], batch_loras: Iterable[Optional[str]]) -> bool:
        """Whether a request with `lora_path` fits a batch already running `batch_loras`
        (at most --max-loras-per-batch distinct adapters; the base model takes no slot)."""
        if lora_path is None:
            return True
        distinct = {name for name in batch_loras if name is not None}
        return lora_path in distinct or len(distinct) < self.max_loras_per_batch
