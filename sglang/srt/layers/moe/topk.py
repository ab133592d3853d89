"""Router top-k selection: which experts each token goes to, and with what weight.

All three supported families take the softmax of the router logits in float32 and keep the top_k largest
probabilities. They differ in two details that change the result:

- renormalization: Mixtral always rescales the chosen probabilities to sum to 1; Qwen2-MoE and Qwen3-MoE do so
  only when the config sets `norm_topk_prob`;
- the dtype of the weights: Mixtral keeps them in float32 (so the weighted expert outputs are summed from float32
  products), Qwen2-MoE / Qwen3-MoE round them to the model dtype first.

Ties between equal probabilities are broken the way `torch.topk` breaks them, as transformers does, so the
experts chosen here are the experts the reference implementation chooses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


class TopKOutput(NamedTuple):
    weights: torch.Tensor  # [num_tokens, top_k] routing weight of each chosen expert
    ids: torch.Tensor  # [num_tokens, top_k] int64 expert index, in decreasing order of probability


@dataclass(frozen=True)
class TopKConfig:
    num_experts: int
    top_k: int
    renormalize: bool
    # True: weights stay float32; False: rounded to the dtype of the router logits (the model dtype).
    float32_weights: bool

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in 1..{self.num_experts} (the expert count)")


def select_experts(router_logits: torch.Tensor, config: TopKConfig) -> TopKOutput:
    """Top-k experts of each row of `router_logits` [num_tokens, num_experts]."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, config.top_k, dim=-1)
    if config.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not config.float32_weights:
        weights = weights.to(router_logits.dtype)
    return TopKOutput(weights, ids)


def mixtral_topk_config(config: Any) -> TopKConfig:
    """Mixtral: softmax over all experts, top-k, renormalized over the chosen ones, float32 weights."""
    return TopKConfig(config.num_local_experts, config.num_experts_per_tok, renormalize=True, float32_weights=True)


def qwen_moe_topk_config(config: Any) -> TopKConfig:
    """Qwen2-MoE / Qwen3-MoE: softmax, top-k, renormalized only with `norm_topk_prob`, weights in model dtype."""
    return TopKConfig(config.num_experts, config.num_experts_per_tok,
                      renormalize=bool(getattr(config, "norm_topk_prob", False)), float32_weights=False)
