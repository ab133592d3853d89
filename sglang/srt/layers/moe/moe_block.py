"""The MLP of a sparse decoder layer: router, top-k selection, the batched experts and an optional shared expert.

The router (`gate`) and the shared-expert gate are plain `nn.Linear`, not `layers.linear.Linear`, so the loader
never gives them a reduced-precision method (int8 / bf16 copies for large batches): routing decisions must be
computed in the model dtype to pick the experts the checkpoint's authors trained with. The experts are stacked
parameters (fused_moe.py) in the model dtype, or, where blocks serve every batch, their Q8_0 blocks
(layers/moe/expert_blocks.py); the routers stay in the model dtype either way.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
from sglang.srt.layers.moe.fused_moe import HF_EXPERT_NAMES, FusedMoE
from sglang.srt.layers.moe.topk import TopKConfig, select_experts


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        layer_id: int,
        hidden_size: int,
        intermediate_size: int,
        topk_config: TopKConfig,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device | str] = None,
        expert_names: tuple[str, str, str] = HF_EXPERT_NAMES,
        shared_expert: Optional[nn.Module] = None,
        checkpoint_block: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.topk_config = topk_config
        self.gate = nn.Linear(hidden_size, topk_config.num_experts, bias=False, dtype=dtype, device=device)
        self.experts = FusedMoE(topk_config.num_experts, hidden_size, intermediate_size, dtype, device, expert_names,
                                checkpoint_block)
        self.shared_expert = shared_expert
        # Qwen2-MoE scales the shared expert's output by sigmoid(x . w) per token.
        self.shared_expert_gate: Optional[nn.Linear] = (
            nn.Linear(hidden_size, 1, bias=False, dtype=dtype, device=device) if shared_expert is not None else None
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        topk = select_experts(self.gate(hidden_states), self.topk_config)
        get_global_expert_distribution_recorder().on_select_experts(self.layer_id, topk.ids)
        output = self.experts(hidden_states, topk)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
            output = output + shared
        return output
