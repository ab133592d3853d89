"""What the served model's weights occupy, by format: the `Weights:` line of the log and `weights` in
/get_server_info.

A layer may hold its weights in several forms (a float weight, GGUF blocks for small batches, a bf16 or int8 copy
for large ones); each form is counted once, under its own name, and only where it holds storage (a layer whose
blocks serve every batch keeps a meta placeholder of no bytes: model_loader/q8_blocks.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from sglang.srt.layers.linear import LinearMethod, linear_methods
from sglang.srt.layers.moe.fused_moe import expert_linear_methods
from sglang.srt.layers.quantization.block_embedding import BlockEmbedding, KQuantTable
from sglang.srt.layers.quantization.gguf_blocks import GGUFQuantWeight
from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod
from sglang.srt.model_loader.dtype import dtype_name
from sglang.srt.model_loader.quant_config import describe_checkpoint_quantization


def _method_copies(method: LinearMethod, from_checkpoint: dict[int, str], method_read: str,
                   from_gguf: dict[int, str]) -> list[tuple[Any, str, int]]:
    """(identity, format, bytes) of the weight forms a linear method holds beside the layer's own parameter; blocks
    made from a quantized checkpoint's integers (ids in `from_checkpoint`) named for the `method_read`, blocks
    converted from a GGUF file's other types (ids in `from_gguf`, model_loader/gguf_quant.py) for those types."""
    out: list[tuple[Any, str, int]] = []
    if isinstance(method, GGUFLinearMethod):
        qw = method.quant_weight
        read = method_read if id(qw.packed) in from_checkpoint else ""
        out.append(_blocks_entry(qw, read, from_gguf))
        method = method.large
    nbytes = int(getattr(method, "nbytes", 0) or 0)
    if nbytes:
        out.append((id(method), method.weight_format, nbytes))
    return out


def _blocks_entry(qw: GGUFQuantWeight | KQuantTable, checkpoint_read: str,
                  from_gguf: dict[int, str]) -> tuple[Any, str, int]:
    """(identity, format, bytes) of blocks: made from the `checkpoint_read` checkpoint's integers (where not ""), or
    converted from what a GGUF file stored (`from_gguf`), or as the file stored them."""
    origin = f" from the {checkpoint_read} checkpoint" if checkpoint_read else ""
    if id(qw.packed) in from_gguf:
        origin = f" from {from_gguf[id(qw.packed)]}"
    return id(qw.packed), f"{qw.qtype} blocks{origin}", qw.nbytes


def weight_bytes_by_format(model: nn.Module) -> dict[str, int]:
    """Format name -> bytes held, largest first: parameters by dtype, then each kind of block or copy."""
    totals: dict[str, int] = {}
    seen: set[Any] = set()
    source = getattr(model, "quantized_checkpoint", None)
    from_checkpoint, method_read = (source.served, source.scheme.method) if source is not None else ({}, "")
    for param in model.parameters():
        if param.device.type == "meta" or id(param) in seen:
            continue
        seen.add(id(param))
        name = dtype_name(param.dtype)
        totals[name] = totals.get(name, 0) + param.numel() * param.element_size()
    from_gguf = getattr(model, "gguf_block_origins", None) or {}
    copies = [copy for method in linear_methods(model) + expert_linear_methods(model)  # experts' blocks included
              for copy in _method_copies(method, from_checkpoint, method_read, from_gguf)]
    copies += [_blocks_entry(m.quant_weight, "", from_gguf) for m in model.modules() if isinstance(m, BlockEmbedding)]
    for key, name, nbytes in copies:
        if key not in seen:
            seen.add(key)
            totals[name] = totals.get(name, 0) + nbytes
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def describe_weights(model: nn.Module) -> str:
    """One log line: `Weights: 2.21 GB as Q8_0 blocks 1.80 GB, float32 0.41 GB`; for a quantized checkpoint what was
    read first: `Weights: GPTQ 4-bit, group 128, ..., dequantized to bfloat16 at load, then served as ...`, or
    `Weights: GPTQ 4-bit, group 128, ..., served from its own Q4_1 blocks: 0.93 GB as Q4_1 blocks from the gptq
    checkpoint 0.80 GB, ...` where blocks were made from its integers (model_loader/checkpoint_blocks.py)."""
    by_format = weight_bytes_by_format(model)
    parts = ", ".join(f"{name} {nbytes / 1e9:.2f} GB" for name, nbytes in by_format.items())
    total = sum(by_format.values()) / 1e9
    source = getattr(model, "quantized_checkpoint", None)
    if source is not None and source.served:
        return f"Weights: {source.describe()}: {total:.2f} GB as {parts}"
    read = describe_checkpoint_quantization(getattr(model, "config", None))
    if read:
        return f"Weights: {read}, then served as {parts or 'nothing'} ({total:.2f} GB)"
    return f"Weights: {total:.2f} GB as {parts or 'nothing'}"
