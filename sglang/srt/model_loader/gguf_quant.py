"""Choosing the GGUF-blocks linear method at load time for a model read from a Q4_1 / Q8_0 GGUF file.

A model loaded from such a file keeps its float weights (dequantized exactly) and every linear layer and the LM
head also get the file's original blocks through `GGUFLinearMethod` (layers/quantization/gguf_linear.py), which
runs batches of at most `max_rows` rows on them. The blocks are attached only where their dequantized values
equal the loaded weights bit for bit, so both paths compute with the same weights.
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
    kernels_available,
    kernels_unavailable_reason,
    rotary_rows_gguf_to_hf,
)
from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod
from sglang.srt.model_loader.gguf_reader import read_gguf_quant_tensors

logger = logging.getLogger(__name__)

# Largest number of token rows sent to the quantized kernel (benchmarks/RESULTS.md: the dense float32 GEMM
# wins beyond this on the development machine).
DEFAULT_MAX_ROWS = 64


def _matching(candidates: Sequence[Callable[[], Optional[GGUFQuantWeight]]], target: torch.Tensor) -> Optional[
        GGUFQuantWeight]:
    """The first candidate whose dequantized weight equals `target` exactly."""
    for make in candidates:
        weight = make()
        if weight is not None and weight.shape == tuple(target.shape) and torch.equal(weight.dequantize(), target):
            return weight
    return None


def attach_gguf_quant_weights(model: Any, gguf_path: str, config: Any, max_rows: int = DEFAULT_MAX_ROWS) -> int:
    """Attach GGUF blocks to the linear layers of a Llama-family model; returns the bytes attached."""
    if not kernels_available():
        logger.info("Quantized GGUF kernels unavailable (%s); using float weights only", kernels_unavailable_reason())
        return 0
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or any(p.dtype != torch.float32 for p in model.parameters()):
        return 0
    if any(not hasattr(layer.mlp, "gate_up_proj") for layer in layers):
        logger.info("GGUF blocks are attached to dense models only; %s has expert layers", type(model).__name__)
        return 0
    tensors = read_gguf_quant_tensors(gguf_path)

    def block(name: str) -> Optional[GGUFQuantWeight]:
        entry = tensors.get(name)
        return None if entry is None else GGUFQuantWeight(entry[0], torch.from_numpy(entry[1].copy()), entry[2],
                                                          entry[3])

    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    attached = 0
    plan: list[tuple[Linear, Optional[GGUFQuantWeight]]] = []
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = (block(f"blk.{i}.attn_{n}.weight") for n in ("q", "k", "v"))
        if q is None or k is None or v is None:
            return 0

        def qkv_hf_order(q=q, k=k, v=v) -> GGUFQuantWeight:
            # llama.cpp's converter interleaves the rotary halves of Q and K for Llama models.
            return GGUFQuantWeight.concat([
                q.permute_rows(rotary_rows_gguf_to_hf(q.n, num_heads)),
                k.permute_rows(rotary_rows_gguf_to_hf(k.n, num_kv_heads)), v,
            ])

        gate, up = block(f"blk.{i}.ffn_gate.weight"), block(f"blk.{i}.ffn_up.weight")
        gate_up = [partial(GGUFQuantWeight.concat, [gate, up])] if gate is not None and up is not None else []
        matches = [
            (attn.qkv_proj, _matching([qkv_hf_order, partial(GGUFQuantWeight.concat, [q, k, v])],
                                      attn.qkv_proj.weight)),
            (attn.o_proj, _matching([partial(block, f"blk.{i}.attn_output.weight")], attn.o_proj.weight)),
            (mlp.gate_up_proj, _matching(gate_up, mlp.gate_up_proj.weight)),
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
    for module, weight in plan:
        assert weight is not None
        module.set_linear_method(GGUFLinearMethod(weight, max_rows))
        attached += weight.nbytes
    if head_weight is not None and hasattr(model, "logits_processor"):
        model.logits_processor.set_head_method(GGUFLinearMethod(head_weight, max_rows))
        attached += head_weight.nbytes
    logger.info("Attached %.1f MB of GGUF blocks for matmuls of up to %d rows", attached / 2**20, max_rows)
    return attached
