"""Qwen3-MoE: the Qwen3 decoder (q/k RMSNorm) with top-k routed SwiGLU experts and no shared expert; the router
renormalizes the chosen weights when `norm_topk_prob` is set. Sparse layers are chosen as in Qwen2-MoE."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.layers.moe.moe_block import SparseMoeBlock
from sglang.srt.layers.moe.topk import qwen_moe_topk_config
from sglang.srt.models.llama import MlpFactory
from sglang.srt.models.moe_common import check_full_attention, check_silu, is_sparse_layer
from sglang.srt.models.qwen3 import Qwen3ForCausalLM


def qwen3_moe_mlp(
    config: Any, layer_id: int, dtype: Optional[torch.dtype], device: Optional[torch.device | str]
) -> Optional[nn.Module]:
    if not is_sparse_layer(config, layer_id):
        return None
    check_silu(config)
    return SparseMoeBlock(layer_id, config.hidden_size, config.moe_intermediate_size, qwen_moe_topk_config(config),
                          dtype, device)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def __init__(
        self, config: Any, dtype: Optional[torch.dtype] = None, device: Optional[torch.device | str] = None
    ) -> None:
        check_full_attention(config)
        super().__init__(config, dtype, device)

    @classmethod
    def mlp_factory(cls) -> Optional[MlpFactory]:
        return qwen3_moe_mlp


EntryClass = Qwen3MoeForCausalLM
