"""The decode step of a Llama-family model on CPU in one compiled call (csrc/decode_stack.cpp).

Run op by op from Python, a batch-1 decode step of SmolLM2-135M spends more time in dispatch (about 15 aten ops,
5 kernel calls and a dozen module calls per layer, 30 layers) than in arithmetic. When every linear layer of the
model carries GGUF blocks (see sglang/srt/model_loader/gguf_quant.py), the decoder layers of a decode batch of at
most `max_rows` sequences instead run inside one C++ call: one OpenMP team, five phases per layer whose work items
the threads claim from shared counters. The embeddings, the RoPE table lookup and the LM head stay in Python.

The result equals the layer-by-layer path up to float32 summation order. SGLANG_DISABLE_FUSED_DECODE=1 turns it
off.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers.cpu_extension import CpuExtension
from sglang.srt.layers.cpu_ops import CSRC
from sglang.srt.layers.quantization.gguf_blocks import KERNELS_HEADER

logger = logging.getLogger(__name__)

DISABLE_ENV = "SGLANG_DISABLE_FUSED_DECODE"
_EXTENSION = CpuExtension("sglang_decode_stack", CSRC / "decode_stack.cpp", "fused CPU decode step", DISABLE_ENV,
                          headers=[CSRC / "cpu_kernels.h", KERNELS_HEADER])


def available() -> bool:
    return _EXTENSION.available()


class FusedDecode:
    """Runs the decoder layers and final norm of decode batches of up to `max_rows` sequences."""

    def __init__(self, stack: Any, max_rows: int) -> None:
        self.stack = stack
        self.max_rows = max_rows

    def accepts(self, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> bool:
        return (forward_batch.forward_mode.is_decode() and 0 < forward_batch.batch_size <= self.max_rows
                and hidden_states.dtype == torch.float32)

    def __call__(self, hidden_states: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                 forward_batch: ForwardBatch) -> torch.Tensor:
        batch = hidden_states.shape[0]
        cos, sin = cos_sin  # [B, 1, rotary_dim]
        return self.stack.forward(
            hidden_states, cos.view(batch, -1), sin.view(batch, -1), forward_batch.out_cache_loc,
            forward_batch.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
        )


def _quant_args(module: nn.Module) -> Optional[tuple[torch.Tensor, str, Optional[torch.Tensor]]]:
    weight = getattr(module, "quant_weight", None)
    if weight is None:
        return None
    bias = getattr(module, "bias", None)
    return weight.packed, weight.qtype, None if bias is None else bias.detach().contiguous()


def build_fused_decode(model: nn.Module, k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor],
                       max_rows: int) -> Optional[FusedDecode]:
    """A FusedDecode for `model.model` (a LlamaModel), or None when it cannot run this model."""
    backbone = getattr(model, "model", None)
    layers = getattr(backbone, "layers", None)
    if not layers or max_rows <= 0 or not available():
        return None
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in [*k_buffers, *v_buffers]):
        return None
    first = layers[0].self_attn
    rotary = backbone.rotary_emb
    stack = _EXTENSION.module().DecodeStack(
        hidden_size=backbone.config.hidden_size, num_heads=first.num_heads, num_kv_heads=first.num_kv_heads,
        head_dim=first.head_dim, rotary_dim=rotary.rotary_dim,
        intermediate_size=layers[0].mlp.down_proj.in_features, eps=backbone.norm.variance_epsilon,
        scale=first.attn.spec.scaling, final_norm=backbone.norm.weight.detach(),
    )
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [_quant_args(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(args is None for args in linears):
            return None
        norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]
        if any(n is not None and n.variance_epsilon != backbone.norm.variance_epsilon for n in norms):
            return None
        stack.add_layer(*linears[0], *linears[1], *linears[2], *linears[3],
                        *(None if n is None else n.weight.detach() for n in norms))
    stack.set_kv_cache(k_buffers, v_buffers)
    logger.info("Decode batches of up to %d sequences run the fused CPU decode step", max_rows)
    return FusedDecode(stack, max_rows)
