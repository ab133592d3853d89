"""Mistral: the Llama decoder with an optional sliding window over every layer (`config.sliding_window`).

As transformers' Mistral does, the window applies to all layers alike: a token at position p attends to positions
p - sliding_window + 1 .. p. Without one (null in the config, as in Mistral-7B v0.2 and later) it is Llama.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.models.llama import LlamaAttention, LlamaForCausalLM


def window_every_layer(model: LlamaForCausalLM, window: Optional[int]) -> None:
    """Give every attention layer of a Llama-structured model the sliding window `window` (None: none)."""
    if window is None:
        return
    for attn in [m for m in model.modules() if isinstance(m, LlamaAttention)]:
        spec = attn.attn.spec
        attn.attn = RadixAttention(spec.layer_id, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.scaling,
                                   sliding_window=int(window))


class MistralForCausalLM(LlamaForCausalLM):
    def __init__(
        self, config: Any, dtype: Optional[torch.dtype] = None, device: Optional[torch.device | str] = None
    ) -> None:
        super().__init__(config, dtype=dtype, device=device)
        window_every_layer(self, getattr(config, "sliding_window", None))


EntryClass = MistralForCausalLM
