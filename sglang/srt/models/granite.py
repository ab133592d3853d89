"""Granite (IBM Granite 3): the Llama decoder with four scalars from the config.

- `embedding_multiplier` scales the token embeddings;
- `residual_multiplier` scales the attention and MLP outputs before each is added to the residual stream;
- `attention_multiplier` is the attention's softmax scale (instead of 1 / sqrt(head_dim));
- `logits_scaling` divides the logits.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.models.llama import CosSin, DecoderOptions, LlamaDecoderLayer
from sglang.srt.models.llama_variants import VariantForCausalLM, VariantModel


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any, layer_id: int, rotary_dim: int, options: DecoderOptions,
                 dtype: Optional[torch.dtype], device: Optional[torch.device | str]) -> None:
        super().__init__(config, layer_id, rotary_dim, options, dtype, device)
        attn = self.self_attn
        attn.attn = RadixAttention(layer_id, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                   float(config.attention_multiplier))
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(
        self,
        cos_sin: CosSin,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        residual: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # `hidden_states` is the previous layer's scaled MLP output (or the embeddings): the norm adds it in.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        attn_out = self.self_attn(cos_sin, hidden_states, forward_batch).to(residual.dtype)
        hidden_states, residual = self.post_attention_layernorm(attn_out * self.residual_multiplier, residual)
        return self.mlp(hidden_states) * self.residual_multiplier, residual


class GraniteForCausalLM(VariantForCausalLM):
    # The fused CPU decode step (model_executor/fused_cpu_decode.py) runs plain Llama layers.
    fused_decode_exclusion = ("Granite scales its embeddings, residual branches and logits "
                              "(the fused step runs unscaled Llama layers)")

    def __init__(
        self, config: Any, dtype: Optional[torch.dtype] = None, device: Optional[torch.device | str] = None
    ) -> None:
        super().__init__(config, dtype, device)
        # transformers divides the logits by logits_scaling.
        self.logits_processor.logit_scale = 1.0 / float(config.logits_scaling)

    def build_model(self, config: Any, dtype: Optional[torch.dtype],
                    device: Optional[torch.device | str]) -> VariantModel:
        options = self.decoder_options(config)

        def make_layer(layer_id: int, rotary_dim: int) -> GraniteDecoderLayer:
            return GraniteDecoderLayer(config, layer_id, rotary_dim, options, dtype, device)

        return VariantModel(config, make_layer, dtype, device,
                            embedding_multiplier=float(config.embedding_multiplier))


EntryClass = GraniteForCausalLM
