"""Qwen2-MoE: the Qwen2 decoder whose sparse layers route each token to top-k of `num_experts` SwiGLU experts and
add a shared expert scaled by a per-token sigmoid gate. Which layers are sparse: `decoder_sparse_step` and
`mlp_only_layers` (models/moe_common.py); the others keep a dense MLP of `intermediate_size`."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.layers.moe.moe_block import SparseMoeBlock
from sglang.srt.layers.moe.topk import qwen_moe_topk_config
from sglang.srt.models.llama import DecoderOptions, LlamaForCausalLM, LlamaMLP, MlpFactory
from sglang.srt.models.moe_common import check_silu, is_sparse_layer


def qwen2_moe_mlp(
    config: Any, layer_id: int, dtype: Optional[torch.dtype], device: Optional[torch.device | str]
) -> Optional[nn.Module]:
    if not is_sparse_layer(config, layer_id):
        return None  # the dense LlamaMLP of intermediate_size
    check_silu(config)
    shared_size = getattr(config, "shared_expert_intermediate_size", 0) or 0
    shared = (LlamaMLP(config.hidden_size, shared_size, "silu", False, dtype, device) if shared_size > 0
              else None)
    return SparseMoeBlock(layer_id, config.hidden_size, config.moe_intermediate_size, qwen_moe_topk_config(config),
                          dtype, device, shared_expert=shared)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return DecoderOptions(qkv_bias=bool(getattr(config, "qkv_bias", True)), o_proj_bias=False, mlp_bias=False)

    @classmethod
    def mlp_factory(cls) -> Optional[MlpFactory]:
        return qwen2_moe_mlp


EntryClass = Qwen2MoeForCausalLM
