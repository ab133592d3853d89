"""The blocks of a GPTQ / AWQ / compressed-tensors checkpoint for each linear layer of the model loaded from it.

A model loaded from such a checkpoint carries a `QuantizedSource` (model_loader/loader.py): its files and scheme.
Where the plan gives the model blocks for small batches (model_loader/q8_blocks.attach_q8_0_blocks), each quantized
weight's integers are repacked into Q4_1 / Q8_0 blocks of exactly their values (model_loader/int_blocks.py), as a
GGUF file's own blocks are attached (model_loader/gguf_quant.py): fused q/k/v and gate/up layers get their parts'
blocks stacked. It is all or nothing for a checkpoint: where one layer has no such blocks, none is served from the
file, and one log line says why.

The checkpoint is read once: where blocks may serve the model (`blocks_may_serve`: float32 on CPU with the GGUF
kernels, one tensor-parallel rank), the loader makes each weight's raw blocks as it reads and dequantizes it
(`QuantizedSource.made`; `--quantization w8a8_int8` thus quantizes each weight once), and they are dropped as they
are attached, or all at once where the model gets no blocks from them (`release_made_blocks`). Only a model loaded
without them (another device or dtype) reads the quantized weights a second time, unpacked
(model_loader/quantized_weights.iterate_quantized).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from sglang.srt.layers.linear import MergedLinear, hold_as
from sglang.srt.layers.moe.fused_moe import FusedMoE
from sglang.srt.layers.quantization.gguf_blocks import GGUFQuantWeight
from sglang.srt.model_loader.int_blocks import MadeBlocks, RawBlocks, blocks_of, checkpoint_block_reason
from sglang.srt.model_loader.quant_config import Scheme

logger = logging.getLogger(__name__)


@dataclass
class QuantizedSource:
    """Where a model's quantized weights came from, and which of its blocks were made from them."""

    files: list[Path]
    scheme: Scheme
    # id of each attached blocks tensor (GGUFQuantWeight.packed) made from the checkpoint -> its qtype
    served: dict[int, str] = field(default_factory=dict)
    # the raw blocks made as the weights were loaded, until they are attached or dropped (None: not made)
    made: Optional[MadeBlocks] = None

    def serve(self, raw: RawBlocks) -> GGUFQuantWeight:
        """Blocks made from the checkpoint's integers, as served (counted in `served` for the weights report)."""
        weight = GGUFQuantWeight(*raw)
        self.served[id(weight.packed)] = weight.qtype
        return weight

    def describe(self) -> str:
        qtypes = "/".join(sorted(set(self.served.values())))
        return f"{self.scheme.describe()}, served from its own {qtypes} blocks"


def blocks_may_serve(scheme: Scheme, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model of `dtype` on `device` loaded from a checkpoint of `scheme` may be served from blocks made of
    its integers (model_loader/q8_blocks.why_no_q8_0_blocks: float32 on CPU with the GGUF kernels; tensor-parallel
    ranks keep their shards dense): the loader then makes them as it reads each weight."""
    from sglang.srt.distributed.parallel_state import get_tp_group
    from sglang.srt.layers.quantization.gguf_blocks import kernels_available

    return (device.type == "cpu" and dtype == torch.float32 and checkpoint_block_reason(scheme) is None
            and kernels_available() and get_tp_group().size == 1)


def linears_released_for_checkpoint_blocks(model: nn.Module, files: list[Path], scheme: Scheme,
                                           linears: Callable[[nn.Module], Sequence[nn.Module]]
                                           ) -> Optional[Callable[[nn.Module], None]]:
    """For a model on the meta device read from a quantized checkpoint whose integers make blocks, where the checkpoint
    quantizes every one of the layers `linears` gives: a function to run once the model has storage that releases
    their weights (meta tensors: loading skips them), so that they never exist as floats. The blocks made as the
    checkpoint is read serve them (q8_blocks.attach_q8_0_blocks); where none come after all, `reload_released` reads
    their dequantized values again. None where one of them is not quantized in the checkpoint (no blocks would
    come)."""
    from sglang.srt.model_loader.quantized_weights import TensorStore, plan_quantized_modules

    names = {id(m): n for n, m in model.named_modules()}
    try:
        plan = plan_quantized_modules(TensorStore(files).names, scheme)
    except ValueError:  # the loader reports it
        return None
    parts = [part for m in linears(model) for part in _checkpoint_parts(names.get(id(m), ""), m)]
    if not parts or any(part not in plan for part in parts):
        return None

    def release(allocated: nn.Module) -> None:
        held = linears(allocated)
        for module in held:
            weight: torch.Tensor = module.weight  # type: ignore[assignment]
            hold_as(module, "weight", weight.dtype, "meta")
        logger.info("The weights of %d linear layers are not loaded as floats: the blocks made from the checkpoint's "
                    "integers serve them", len(held))

    return release


def reload_released(model: nn.Module, source: QuantizedSource, what: str) -> None:
    """Parameters released before loading (meta tensors: blocks made from the checkpoint's integers were to serve
    them) that get none after all: give them storage (float32, on CPU) and read their dequantized values from the
    checkpoint again, as loading would have (in the checkpoint's dtype, then widened). `what` names them in the
    log."""
    from sglang.srt.model_loader.quant_config import dequantized_dtype
    from sglang.srt.model_loader.quantized_weights import iterate_dequantized
    from sglang.srt.model_loader.weights import load_checkpoint_weights, released_checkpoint_names

    wanted = released_checkpoint_names(model)
    released = [(module, leaf) for module in model.modules()
                for leaf, param in module.named_parameters(recurse=False) if param.is_meta]
    if not released:
        return
    for module, leaf in released:
        hold_as(module, leaf, torch.float32, "cpu")
    dtype = dequantized_dtype(str(source.files[0].parent), source.scheme)
    load_checkpoint_weights(model, iterate_dequantized(source.files, source.scheme, dtype, wanted=wanted.__contains__),
                            partial=True)
    logger.info("%s read again, dequantized: the checkpoint has no blocks for them", what)


def release_made_blocks(model: nn.Module) -> None:
    """Drop the blocks made at load of a model that gets none of them."""
    source = getattr(model, "quantized_checkpoint", None)
    if source is not None:
        source.made = None


def _read_blocks(source: QuantizedSource, wanted: set[str]) -> Union[dict[str, RawBlocks], str]:
    """The raw blocks of the checkpoint modules `wanted` (the blocks made at load, else read again), or why the
    first of them in file order has none."""
    made, source.made = source.made, None  # taken: each block is released once it is attached
    if made is None:
        from sglang.srt.model_loader.quantized_weights import iterate_quantized

        made = {module: blocks_of(stored, module) for module, stored in iterate_quantized(source.files, source.scheme)
                if module in wanted}
    read: dict[str, RawBlocks] = {}
    for module, blocks in made.items():
        if module not in wanted:
            continue
        if isinstance(blocks, str):
            return blocks
        read[module] = blocks
    return read


def _checkpoint_parts(name: str, module: nn.Module) -> list[str]:
    """The checkpoint modules whose weights make up `module`'s, in row order (q/k/v, gate/up of a fused layer)."""
    if isinstance(module, MergedLinear):
        parent = name.rpartition(".")[0]
        return [f"{parent}.{shard}" if parent else shard for shard in module.shard_rows]
    return [name]


def _stack(parts: list[RawBlocks]) -> RawBlocks:
    qtypes = {p[0] for p in parts}
    widths = {p[3] for p in parts}
    if len(qtypes) != 1 or len(widths) != 1:
        raise ValueError(f"parts of {sorted(qtypes)} blocks and input widths {sorted(widths)} cannot be stacked")
    return parts[0][0], torch.cat([p[1] for p in parts]), sum(p[2] for p in parts), parts[0][3]


def checkpoint_blocks(model: nn.Module, source: QuantizedSource, required: Sequence[nn.Module],
                      optional: Sequence[nn.Module] = (), experts: Sequence[FusedMoE] = ()
                      ) -> Union[dict[Any, RawBlocks], str]:
    """id(module) -> the raw blocks of its weight made from the checkpoint's integers, for every module of `required`
    and those of `optional` (an LM head) the checkpoint quantizes; or why the checkpoint has none. With `experts`
    (stacked experts, layers/moe/fused_moe.FusedMoE, whose checkpoint quantizes each expert under its own names),
    those of every expert too: `expert_blocks` reads them from the result."""
    reason = checkpoint_block_reason(source.scheme)
    if reason is not None:
        source.made = None
        return reason
    names = {id(m): n for n, m in model.named_modules()}
    parts = {id(m): _checkpoint_parts(names.get(id(m), ""), m) for m in [*required, *optional]}
    per_expert = {id(f): f.checkpoint_expert_modules(names.get(id(f), "")) for f in experts}
    wanted = {part for module_parts in parts.values() for part in module_parts}
    wanted.update(name for modules in per_expert.values() for expert in modules for name in expert)
    read = _read_blocks(source, wanted)
    if isinstance(read, str):
        return read
    out: dict[Any, RawBlocks] = {}
    for fused in experts:
        for e, (gate, up, down) in enumerate(per_expert[id(fused)]):
            missing = [p for p in (gate, up, down) if p not in read]
            if missing:
                return f"{missing[0]} is not quantized in the checkpoint"
            try:
                out[_expert_key(fused, e, "gate_up_proj")] = _stack([read.pop(gate), read.pop(up)])
            except ValueError as err:
                return f"{gate}: {err}"
            out[_expert_key(fused, e, "down_proj")] = read.pop(down)
    for module in [*required, *optional]:
        module_parts = parts[id(module)]
        missing = [p for p in module_parts if p not in read]
        if missing:
            if module in optional:
                continue
            return f"{missing[0]} is not quantized in the checkpoint"
        try:
            stacked = _stack([read.pop(p) for p in module_parts])  # each part once: the raw copies go as they stack
        except ValueError as e:
            return f"{names.get(id(module))}: {e}"
        weight: torch.Tensor = module.weight  # type: ignore[assignment]
        if (stacked[2], stacked[3]) != tuple(weight.shape):
            return (f"{names.get(id(module))} is [{weight.shape[0]}, {weight.shape[1]}] here but [{stacked[2]}, "
                    f"{stacked[3]}] in the checkpoint (a tensor-parallel shard)")
        out[id(module)] = stacked
    return out


def _expert_key(fused: FusedMoE, expert: int, param: str) -> tuple[int, int, str]:
    # a key of its own per expert projection, beside the ids of the linear layers
    return id(fused), expert, param


def expert_blocks(found: dict[Any, RawBlocks], fused: FusedMoE) -> list[tuple[RawBlocks, RawBlocks]]:
    """Per expert of `fused`, the raw blocks of its gate/up (gate rows, then up rows) and down projections taken out
    of a `checkpoint_blocks` result made with it among `experts`; the shapes checked against the layer's."""
    out = []
    for e in range(fused.num_experts):
        gate_up, down = found.pop(_expert_key(fused, e, "gate_up_proj")), found.pop(_expert_key(fused, e, "down_proj"))
        for raw, param in ((gate_up, fused.gate_up_proj), (down, fused.down_proj)):
            if (raw[2], raw[3]) != tuple(param.shape[1:]):
                raise ValueError(f"expert {e}: blocks of [{raw[2]}, {raw[3]}] for a projection of "
                                 f"{list(param.shape[1:])}")
        out.append((gate_up, down))
    return out


def log_outcome(source: QuantizedSource, result: Union[dict[int, RawBlocks], str], attached_bytes: int,
                what: str) -> None:
    """The one startup line saying whether the checkpoint is served from its own blocks, and why not."""
    if isinstance(result, str):
        logger.info("The %s checkpoint keeps the dequantize path (its weights dequantized at load, blocks for small "
                    "batches quantized from them): %s", source.scheme.describe(), result)
        return
    logger.info("Serving the %s checkpoint from its own %s blocks, made exactly from its integers: %.1f MB for %s",
                source.scheme.describe(), "/".join(sorted(set(source.served.values()))), attached_bytes / 2**20,
                what)
