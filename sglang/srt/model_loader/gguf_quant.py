"""Choosing the GGUF-blocks linear method at load time for a model read from a Q4_0 / Q4_1 / Q8_0 GGUF file.

Every linear layer and the LM head get the file's original blocks through `GGUFLinearMethod`
(layers/quantization/gguf_linear.py), which runs batches of at most `max_rows` rows on them. The blocks are attached
only where their dequantized values equal the loaded float weights bit for bit, so every path computes with the
same weights. Where the plan serves every batch from blocks (`--large-batch-weights blocks`, the default on CPUs
with native bf16) the float weights are then released and large batches multiply the blocks too (or an int8 copy
made from them: model_loader/gemm_methods.blocks_large_method): the model holds the file's bytes, not a float32 copy.
Otherwise the float weights stay for large batches.
Q4_0 tensors arrive as the Q4_1 blocks of the same values (model_loader/gguf_reader.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Optional

import torch

from sglang.srt.layers.linear import Linear
from sglang.srt.layers.quantization.gguf_blocks import (
    GGUFQuantWeight,
    as_raw_tensor,
    dequantize_raw,
    kernels_available,
    kernels_unavailable_reason,
    normalize_qtype,
    rotary_rows_gguf_to_hf,
)
from sglang.srt.model_loader.gguf_reader import read_gguf_quant_tensors
from sglang.srt.model_loader.q8_blocks import LargeFromBlocks, blocks_method

logger = logging.getLogger(__name__)

# Largest number of token rows sent to the quantized kernel (benchmarks/RESULTS.md: the dense float32 GEMM
# wins beyond this on the development machine).
DEFAULT_MAX_ROWS = 64


# A GGUF matrix as read from the file, before packing: (qtype, raw uint8 [n, row_bytes], n, k).
RawBlocks = tuple[str, torch.Tensor, int, int]


def _rows(blocks: RawBlocks, index: torch.Tensor) -> RawBlocks:
    qtype, raw, n, k = blocks
    return qtype, raw[index], n, k


def _concat(parts: Sequence[Optional[RawBlocks]]) -> Optional[RawBlocks]:
    """Blocks stacked along N (fused QKV, gate/up); None when a part is missing or the parts do not fit."""
    if not parts or any(p is None for p in parts):
        return None
    full = [p for p in parts if p is not None]
    qtype, k = full[0][0], full[0][3]
    if any(p[0] != qtype or p[3] != k for p in full):
        return None
    return qtype, torch.cat([p[1] for p in full]), sum(p[2] for p in full), k


# Weights compared per slice when checking a candidate: a few MB of float32, so the dequantized copy stays in cache,
# in slices large enough that the per-op overheads of the dequantization stay small. SmolLM2-135M's check took
# 0.94-1.06 s in slices of 128 rows and 0.45-0.47 s in slices of this many values on 2 AVX2 cores
# (benchmarks/bench_gguf_load_check.py).
CHECK_SLICE_VALUES = 1 << 20


def _dequantizes_to(blocks: RawBlocks, target: torch.Tensor, slice_values: Optional[int] = None) -> bool:
    """Whether the blocks dequantize to `target` bit for bit (a bf16 target: to the bf16 rounding of their values,
    which still tells a wrong row order or tensor apart). Compared a slice of rows (of about `slice_values` values,
    default CHECK_SLICE_VALUES) at a time, so the float copy stays in cache and a wrong candidate is rejected at its
    first slice instead of after the whole weight."""
    qtype, raw, n, k = blocks
    if tuple(target.shape) != (n, k) or target.dtype not in (torch.float32, torch.bfloat16):
        return False
    rows_per_slice = max(1, (slice_values or CHECK_SLICE_VALUES) // k)
    for start in range(0, n, rows_per_slice):
        rows = raw[start : start + rows_per_slice]
        values = dequantize_raw(qtype, rows, rows.shape[0], k).to(target.dtype)
        if not torch.equal(values, target[start : start + rows.shape[0]]):
            return False
    return True


def _matching(candidates: Sequence[Callable[[], Optional[RawBlocks]]], target: torch.Tensor) -> Optional[
        GGUFQuantWeight]:
    """The first candidate whose dequantized weight equals `target` exactly, packed for the kernels."""
    for make in candidates:
        blocks = make()
        if blocks is not None and _dequantizes_to(blocks, target):
            return GGUFQuantWeight(*blocks)
    return None


def attach_gguf_quant_weights(model: Any, gguf_path: str, config: Any, max_rows: int = DEFAULT_MAX_ROWS,
                              large: Optional[LargeFromBlocks] = None) -> int:
    """Attach GGUF blocks to the linear layers of a Llama-family model; returns the bytes attached (0: none were,
    the float weights serve). `large`: the blocks serve every batch and the float weights are released
    (model_loader/q8_blocks.blocks_method)."""
    if not kernels_available():
        logger.info("Quantized GGUF kernels unavailable (%s); using float weights only", kernels_unavailable_reason())
        return 0
    layers = getattr(getattr(model, "model", None), "layers", None)
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, Linear)}
    head = getattr(model, "lm_head", None)
    if head is not None:
        linear_weights.add(id(head.weight))
    # linear weights may have loaded in bf16 (model_executor/model_runner.load_for_plan); everything else float32
    if layers is None or any(p.dtype != torch.float32 and id(p) not in linear_weights for p in model.parameters()):
        return 0
    if any(not hasattr(layer.mlp, "gate_up_proj") for layer in layers):
        logger.info("GGUF blocks are attached to dense models only; %s has expert layers", type(model).__name__)
        return 0
    tensors = read_gguf_quant_tensors(gguf_path)

    def block(name: str) -> Optional[RawBlocks]:
        entry = tensors.get(name)
        if entry is None:
            return None
        qtype, raw, n, k = entry
        return normalize_qtype(qtype), as_raw_tensor(raw, qtype, n, k), n, k  # copied out of the memory map

    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    attached = 0
    plan: list[tuple[Linear, Optional[GGUFQuantWeight]]] = []
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = (block(f"blk.{i}.attn_{n}.weight") for n in ("q", "k", "v"))
        if q is None or k is None or v is None:
            return 0

        def qkv_hf_order(q: RawBlocks = q, k: RawBlocks = k, v: RawBlocks = v) -> Optional[RawBlocks]:
            # llama.cpp's converter interleaves the rotary halves of Q and K for Llama models.
            return _concat([_rows(q, rotary_rows_gguf_to_hf(q[2], num_heads)),
                            _rows(k, rotary_rows_gguf_to_hf(k[2], num_kv_heads)), v])

        gate_up = partial(_concat, [block(f"blk.{i}.ffn_gate.weight"), block(f"blk.{i}.ffn_up.weight")])
        matches = [
            (attn.qkv_proj, _matching([qkv_hf_order, partial(_concat, [q, k, v])], attn.qkv_proj.weight)),
            (attn.o_proj, _matching([partial(block, f"blk.{i}.attn_output.weight")], attn.o_proj.weight)),
            (mlp.gate_up_proj, _matching([gate_up], mlp.gate_up_proj.weight)),
            (mlp.down_proj, _matching([partial(block, f"blk.{i}.ffn_down.weight")], mlp.down_proj.weight)),
        ]
        if any(w is None for _, w in matches):
            logger.info("GGUF blocks of layer %d do not match the loaded weights; using float weights only", i)
            return 0
        plan += matches
    head = getattr(model, "lm_head", None)
    head_weight = None
    if head is not None:
        head_weight = _matching([lambda: block("output.weight"), lambda: block("token_embd.weight")], head.weight)
    dtype = model.model.embed_tokens.weight.dtype
    for module, weight in plan:
        assert weight is not None
        module.set_linear_method(blocks_method(module, weight, max_rows, large, dtype, from_file=True))
        attached += weight.nbytes
    if head_weight is not None and head is not None and hasattr(model, "logits_processor"):
        release = dtype if head.weight is not model.model.embed_tokens.weight else None
        model.logits_processor.set_head_method(blocks_method(head, head_weight, max_rows, large, release,
                                                             from_file=True))
        attached += head_weight.nbytes
    what = "every matmul (no float weights kept)" if large is not None else f"matmuls of up to {max_rows} rows"
    logger.info("Attached %.1f MB of GGUF blocks for %s", attached / 2**20, what)
    return attached
