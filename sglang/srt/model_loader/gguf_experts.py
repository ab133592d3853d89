"""The experts of a GGUF mixture-of-experts file served from the file's own blocks.

llama.cpp stores a layer's experts stacked: `blk.N.ffn_gate_exps` and `ffn_up_exps` [experts, intermediate, hidden]
and `ffn_down_exps` [experts, hidden, intermediate], each in one block type (a K-quant "M" file mixes types between
tensors: Q4_K gate/up and Q6_K down, say). Each expert of a `FusedMoE` layer gets one block weight for its fused
gate/up projection (the file's gate rows then its up rows, as the stacked `gate_up_proj` holds them) and one for its
down projection, through the same choice as the file's dense matrices (model_loader/gguf_quant.py): the file's
Q4_1 / Q8_0 blocks as stored, Q4_0 as the Q4_1 blocks of the same values, the other types converted at load
(model_loader/gguf_block_convert.py, with its bounds). Blocks are attached only where their values equal the loaded
experts (float32: the file's values exactly) for every expert of every layer; otherwise nothing changes and the
experts are quantized at load as those of other checkpoints are (model_loader/moe_blocks.py).

A file's experts thus keep their size (a Q4_K expert is served as Q4_1, ~0.63 bytes per weight, where Q8_0 blocks
quantized from its values took ~1.06) and their values.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.layers.moe.expert_blocks import ExpertBlocks
from sglang.srt.layers.moe.fused_moe import FusedMoE
from sglang.srt.layers.quantization.gguf_blocks import QK, GGUFQuantWeight, RawBlocks, kernels_available
from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod
from sglang.srt.model_loader.gguf_reader import GGML_BLOCK_TYPES, gguf_tensor_table
from sglang.srt.model_loader.q8_blocks import LargeFromBlocks

logger = logging.getLogger(__name__)

# Served blocks of one expert, the stored types they were read from ("Q4_K", "Q4_K+Q6_K"), and whether they are the
# file's blocks as stored.
Served = tuple[GGUFQuantWeight, str, bool]
Matches = Callable[[list[RawBlocks], torch.Tensor], bool]
Serve = Callable[[list[RawBlocks]], tuple[GGUFQuantWeight, bool]]
Block = Callable[[str], Optional[RawBlocks]]


def expert_tensor_names(layer: int) -> list[str]:
    """The file's stacked gate, up and down expert tensors of `layer`."""
    return [f"blk.{layer}.ffn_{role}_exps.weight" for role in ("gate", "up", "down")]


def _expert_layers(model: Any) -> list[tuple[int, FusedMoE]]:
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return [(i, layer.mlp.experts) for i, layer in enumerate(layers)
            if isinstance(getattr(getattr(layer, "mlp", None), "experts", None), FusedMoE)]


def experts_read_from_file(model: nn.Module, gguf_path: str | os.PathLike) -> Optional[Callable[[nn.Module], None]]:
    """For a model built on the meta device whose every `FusedMoE` layer has its experts in the file as stacked
    tensors of a block type the kernels serve (as stored or converted) and of the layer's shapes: a function to run
    once the model has storage, before the checkpoint is read, that releases those stacked parameters (meta
    tensors: reading the checkpoint skips them), so that the experts never exist as floats; `attach_file_experts`
    then reads them from the file. None where that does not hold (the experts load as floats)."""
    layers = _expert_layers(model)
    if not layers or not kernels_available():
        return None
    _, table = gguf_tensor_table(gguf_path)
    listed = {name: (dims, ttype) for name, dims, ttype, _ in table}
    for i, fused in layers:
        size, hidden = fused.intermediate_size, fused.down_proj.shape[1]
        if size % QK or hidden % QK:
            return None
        shapes = ([hidden, size, fused.num_experts],) * 2 + ([size, hidden, fused.num_experts],)
        for name, dims in zip(expert_tensor_names(i), shapes):
            dims_found, ttype = listed.get(name, (None, None))
            if dims_found != dims or ttype not in GGML_BLOCK_TYPES:
                return None

    def release(allocated: nn.Module) -> None:
        for _, fused in _expert_layers(allocated):
            fused.hold_stacked(device="meta")

    return release


def block_origins(model: Any) -> dict[int, str]:
    """What each attached block weight converted at load was read from (id of its packed tensor -> "GGUF Q4_K"),
    for the weights report (model_loader/weight_report.py)."""
    if getattr(model, "gguf_block_origins", None) is None:
        model.gguf_block_origins = {}
    return model.gguf_block_origins


def _expert(blocks: RawBlocks, index: int, rows: int) -> Optional[RawBlocks]:
    """Expert `index`'s `rows` rows of stacked blocks [experts * rows, row_bytes]; None when they do not fit."""
    qtype, raw, n, k = blocks
    if n % rows or (index + 1) * rows > n:
        return None
    return qtype, raw[index * rows : (index + 1) * rows], rows, k


def layer_expert_blocks(fused: FusedMoE, stacked: list[Optional[RawBlocks]], matches: Matches, serve: Serve
                        ) -> Optional[tuple[list[Served], list[Served]]]:
    """Per expert of `fused`, the served blocks of its gate/up and its down projection read from the layer's stacked
    file tensors (`stacked`: gate, up, down), or None when a tensor is missing or an expert's values are not the
    loaded ones (`matches`: the stored values equal a float tensor, or fit the shape of one never loaded; `serve`: the
    blocks the kernels read, converted where needed)."""
    gate, up, down = stacked
    if gate is None or up is None or down is None:
        return None
    size, hidden = fused.intermediate_size, fused.down_proj.shape[1]
    gate_up: list[Served] = []
    downs: list[Served] = []
    for index in range(fused.num_experts):
        pieces = [_expert(gate, index, size), _expert(up, index, size)]
        own_down = _expert(down, index, hidden)
        if own_down is None or any(p is None for p in pieces):
            return None
        for parts, target, out in (([p for p in pieces if p is not None], fused.gate_up_proj[index], gate_up),
                                   ([own_down], fused.down_proj[index], downs)):
            if not matches(parts, target):
                return None
            weight, as_stored = serve(parts)
            out.append((weight, "+".join(sorted({p[0] for p in parts})), as_stored))
    return gate_up, downs


def serve_layer_experts(fused: FusedMoE, blocks: tuple[list[Served], list[Served]], max_rows: int,
                        large: LargeFromBlocks, int8_activations: bool, dtype: torch.dtype) -> int:
    """Serve `fused` from its experts' file blocks (the block kernels up to `max_rows` rows, the method `large`
    makes beyond, over the blocks' values) and release its stacked float experts; returns the blocks' bytes."""
    methods: list[list[GGUFLinearMethod]] = [[], []]
    for served, out in zip(blocks, methods):
        for weight, _, _ in served:
            method = GGUFLinearMethod(weight, max_rows, int8_activations=int8_activations)
            method.large = large(weight, weight.dequantize)
            out.append(method)
    experts = ExpertBlocks(methods[0], methods[1], dtype)
    fused.serve_from_blocks(experts, dtype)
    return experts.nbytes


def attach_file_experts(model: Any, block: Block, matches: Matches, serve: Serve, max_rows: int,
                        large: LargeFromBlocks, int8_activations: bool,
                        drop: Callable[[int, int], None] = lambda address, nbytes: None) -> int:
    """Serve every `FusedMoE` layer of `model` from its experts' blocks in the file (`block`: a file tensor by name,
    as raw blocks) where those of every layer match; returns their bytes (0: none served, the reason logged).
    Experts that were never loaded (experts_read_from_file) have no float values to fall back on: a file whose
    experts then cannot be served is a startup error naming the layer. Once a layer's experts are read (`serve`
    copies them), `drop(address, nbytes)` gets each of its stacked tensors (gguf_reader.mapped_page_dropper: the
    file's pages leave the process, so the mapped file does not add to the load's peak)."""
    layers = _expert_layers(model)
    unloaded = any(fused.gate_up_proj.is_meta for _, fused in layers)
    plan: list[tuple[FusedMoE, tuple[list[Served], list[Served]]]] = []
    for i, fused in layers:
        stacked = [block(name) for name in expert_tensor_names(i)]
        try:
            found = layer_expert_blocks(fused, stacked, matches, serve)
            why = "are not blocks holding the loaded experts' values" if found is None else ""
        except ValueError as err:
            found, why = None, f"could not be converted ({err})"
        if found is None:
            if unloaded:
                raise ValueError(f"the GGUF expert tensors of layer {i} ({', '.join(expert_tensor_names(i))}) {why}")
            logger.info("GGUF expert blocks of layer %d %s; the experts keep their float weights", i, why)
            return 0
        plan.append((fused, found))
        for _, raw, _, _ in (s for s in stacked if s is not None):
            drop(raw.data_ptr(), raw.numel())
    origins = block_origins(model)
    routes: set[str] = set()
    for _, found in plan:
        for weight, read, as_stored in (served for projection in found for served in projection):
            if not as_stored:
                origins[id(weight.packed)] = f"GGUF {read}"
                routes.add(f"{read} as {weight.qtype}")
    dtype = model.model.norm.weight.dtype
    attached = sum(serve_layer_experts(fused, found, max_rows, large, int8_activations, dtype) for fused, found in plan)
    converted = f" (converted at load: {', '.join(sorted(routes))})" if routes else ""
    logger.info("Attached %.1f MB of GGUF blocks for %d x %d experts%s%s", attached / 2**20, len(plan),
                plan[0][0].num_experts, converted, " (never loaded as floats)" if unloaded else "")
    return attached
