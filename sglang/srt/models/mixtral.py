"""Mixtral: the Llama decoder with every MLP replaced by top-k of `num_local_experts` SwiGLU experts, the chosen
softmax probabilities renormalized to sum to 1.

Hub checkpoints name the block `block_sparse_moe` and the expert projections w1 (gate), w3 (up), w2 (down);
transformers' fused layout names it `mlp`, as this model does. Both load: the experts know their hub names
(fused_moe.FusedMoE.checkpoint_pieces) and the hub router `block_sparse_moe.gate.weight` is read as `mlp.gate.weight`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.layers.moe.fused_moe import MIXTRAL_EXPERT_NAMES
from sglang.srt.layers.moe.moe_block import SparseMoeBlock
from sglang.srt.layers.moe.topk import mixtral_topk_config
from sglang.srt.models.llama import LlamaForCausalLM, MlpFactory
from sglang.srt.models.moe_common import check_full_attention, check_silu

HUB_BLOCK = "block_sparse_moe"


def mixtral_mlp(
    config: Any, layer_id: int, dtype: Optional[torch.dtype], device: Optional[torch.device | str]
) -> Optional[nn.Module]:
    check_silu(config)
    return SparseMoeBlock(layer_id, config.hidden_size, config.intermediate_size, mixtral_topk_config(config),
                          dtype, device, expert_names=MIXTRAL_EXPERT_NAMES, checkpoint_block=HUB_BLOCK)


def _hub_router_as_ours(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield name.replace(f".{HUB_BLOCK}.gate.", ".mlp.gate."), tensor


class MixtralForCausalLM(LlamaForCausalLM):
    def __init__(
        self, config: Any, dtype: Optional[torch.dtype] = None, device: Optional[torch.device | str] = None
    ) -> None:
        check_full_attention(config)
        super().__init__(config, dtype, device)

    @classmethod
    def mlp_factory(cls) -> Optional[MlpFactory]:
        return mixtral_mlp

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_hub_router_as_ours(weights))


EntryClass = MixtralForCausalLM
