"""The blocks of a GPTQ / AWQ / compressed-tensors checkpoint for each linear layer of the model loaded from it.

A model loaded from such a checkpoint carries a `QuantizedSource` (model_loader/loader.py): its files and scheme.
Where the plan gives the model blocks for small batches (model_loader/q8_blocks.attach_q8_0_blocks), the
checkpoint's quantized weights are read a second time, unpacked (model_loader/quantized_weights.iterate_quantized)
and repacked into Q4_1 / Q8_0 blocks of exactly their values (model_loader/int_blocks.py), as a GGUF file's own
blocks are attached (model_loader/gguf_quant.py): fused q/k/v and gate/up layers get their parts' blocks stacked.
It is all or nothing for a checkpoint: where one layer has no such blocks, none is served from the file, and one
log line says why.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import torch
from torch import nn

from sglang.srt.layers.linear import MergedLinear
from sglang.srt.model_loader.int_blocks import RawBlocks, blocks_of, checkpoint_block_reason
from sglang.srt.model_loader.quant_config import Scheme

logger = logging.getLogger(__name__)


@dataclass
class QuantizedSource:
    """Where a model's quantized weights came from, and which of its blocks were made from them."""

    files: list[Path]
    scheme: Scheme
    # id of each attached blocks tensor (GGUFQuantWeight.packed) made from the checkpoint -> its qtype
    served: dict[int, str] = field(default_factory=dict)

    def describe(self) -> str:
        qtypes = "/".join(sorted(set(self.served.values())))
        return f"{self.scheme.describe()}, served from its own {qtypes} blocks"


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
                      optional: Sequence[nn.Module] = ()) -> Union[dict[int, RawBlocks], str]:
    """id(module) -> the raw blocks of its weight made from the checkpoint's integers, for every module of `required`
    and those of `optional` (an LM head) the checkpoint quantizes; or why the checkpoint has none."""
    reason = checkpoint_block_reason(source.scheme)
    if reason is not None:
        return reason
    from sglang.srt.model_loader.quantized_weights import iterate_quantized

    names = {id(m): n for n, m in model.named_modules()}
    parts = {id(m): _checkpoint_parts(names.get(id(m), ""), m) for m in [*required, *optional]}
    wanted = {part for module_parts in parts.values() for part in module_parts}
    read: dict[str, RawBlocks] = {}
    for module_name, stored in iterate_quantized(source.files, source.scheme):
        if module_name in wanted:
            blocks = blocks_of(stored, module_name)
            if isinstance(blocks, str):
                return blocks
            read[module_name] = blocks
    out: dict[int, RawBlocks] = {}
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
