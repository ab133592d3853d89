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

from collections.abc import Callable
from typing import Optional

import torch

from sglang.srt.layers.moe.expert_blocks import ExpertBlocks
from sglang.srt.layers.moe.fused_moe import FusedMoE
from sglang.srt.layers.quantization.gguf_blocks import GGUFQuantWeight
from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod
from sglang.srt.model_loader.q8_blocks import LargeFromBlocks

# (stored type, raw uint8 [rows, row_bytes], rows, K): as model_loader/gguf_quant.RawBlocks
RawBlocks = tuple[str, torch.Tensor, int, int]
# Served blocks of one expert, the stored types they were read from ("Q4_K", "Q4_K+Q6_K"), and whether they are the
# file's blocks as stored.
Served = tuple[GGUFQuantWeight, str, bool]
Matches = Callable[[list[RawBlocks], torch.Tensor], bool]
Serve = Callable[[list[RawBlocks]], tuple[GGUFQuantWeight, bool]]


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
    loaded ones (`matches`: the stored values equal a float tensor; `serve`: the blocks the kernels read, converted
    where needed)."""
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
            method.large = large(weight, weight.dequantize())
            out.append(method)
    experts = ExpertBlocks(methods[0], methods[1], dtype)
    fused.serve_from_blocks(experts, dtype)
    return experts.nbytes
