"""Gemma 3 (text): Gemma 2's decoder (models/gemma2.py) with RMSNorm on each query and key head before RoPE, and
two RoPE tables: the global layers use `rope_parameters["full_attention"]` (rope_theta, 1e6 by default, with the
checkpoint's scaling), the sliding-window layers `rope_parameters["sliding_attention"]` (rope_local_base_freq,
1e4 by default). One global layer in every six by default (`sliding_window_pattern`); no soft-capping unless the
config sets it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from sglang.srt.layers.rotary_embedding import RotaryEmbedding, rope_parameters_from_config
from sglang.srt.models.gemma2 import Gemma2ForCausalLM
from sglang.srt.models.llama import head_dim_of

# transformers' defaults when a config names neither base
_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def rope_parameters_of(config: Any, layer_type: str) -> dict[str, Any]:
    """The RoPE parameters of one layer type: transformers >= 5 keeps a dict per type in config.rope_parameters;
    older configs have rope_theta (+ rope_scaling) for the global layers and rope_local_base_freq for the others."""
    per_type = getattr(config, "rope_parameters", None) or {}
    if layer_type in per_type:
        params = dict(per_type[layer_type] or {})
    elif layer_type == "full_attention":
        params = rope_parameters_from_config(config)
    else:
        params = {"rope_theta": getattr(config, "rope_local_base_freq", None)}
    params["rope_type"] = params.get("rope_type") or params.pop("type", None) or "default"
    if params.get("rope_theta") is None:
        params["rope_theta"] = _DEFAULT_THETA[layer_type]
    return params


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    default_sliding_window_pattern = 6
    qk_norm = True

    @classmethod
    def rotary_embeddings(cls, config: Any, device: Optional[torch.device | str]
                          ) -> tuple[Optional[RotaryEmbedding], Optional[RotaryEmbedding]]:
        head_dim = head_dim_of(config)
        max_positions = int(getattr(config, "max_position_embeddings", 2048))
        full = RotaryEmbedding(head_dim, max_positions, rope_parameters_of(config, "full_attention"), device=device)
        local = RotaryEmbedding(head_dim, max_positions, rope_parameters_of(config, "sliding_attention"),
                                device=device)
        return full, local


EntryClass = Gemma3ForCausalLM
