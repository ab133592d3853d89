"""What the decoders that rewire Llama's layers share (Granite, SmolLM3, OLMo 2; Phi-3 runs the layer loop).

Their layers keep the Llama layer's contract, `layer(cos_sin, hidden_states, forward_batch, residual) ->
(hidden_states, residual)`: the residual stream is carried beside the output of the last branch, which the next
layer (or the final norm) adds into it. `VariantModel` is LlamaModel's backbone with the variant's own layers, and
`VariantForCausalLM` puts the LM head on it and keeps LlamaForCausalLM's forward, logits and weight loading.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.distributed.parallel_state import get_tp_group
from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, get_rope
from sglang.srt.layers.vocab_parallel_embedding import vocab_embedding
from sglang.srt.models.llama import CosSin, LlamaForCausalLM, head_dim_of, run_layers

# (layer_id, rotary_dim) -> the decoder layer of that index.
LayerFactory = Callable[[int, int], nn.Module]


class PreNormDecoderLayer(nn.Module):
    """A decoder layer whose `self_attn` and `mlp` each run after an RMSNorm (`input_layernorm`,
    `post_attention_layernorm`), the residual carried through the fused add-and-norm; subclasses build `self_attn`
    and `mlp`, then the norms with `attach_norms`."""

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def attach_norms(self, config: Any, dtype: Optional[torch.dtype], device: Optional[torch.device | str]) -> None:
        """The two RMSNorms over the config's hidden size, with its rms_norm_eps."""
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)

    def forward(self, cos_sin: CosSin, hidden_states: torch.Tensor, forward_batch: ForwardBatch,
                residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(cos_sin, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class VariantModel(nn.Module):
    """Embeddings (optionally scaled), the variant's decoder layers and the final norm."""

    def __init__(self, config: Any, make_layer: LayerFactory, dtype: Optional[torch.dtype],
                 device: Optional[torch.device | str], embedding_multiplier: float = 1.0) -> None:
        super().__init__()
        self.config = config
        self.embedding_multiplier = embedding_multiplier
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.rotary_emb: RotaryEmbedding = get_rope(config, head_dim_of(config), device=device)
        self.layers = nn.ModuleList(make_layer(i, self.rotary_emb.rotary_dim) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, CosSin]:
        """Token embeddings and the rotary (cos, sin) of each position: the inputs of the first layer."""
        hidden_states = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            hidden_states = hidden_states * self.embedding_multiplier
        return hidden_states, self.rotary_emb.lookup(positions, hidden_states.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden_states, cos_sin = self.embed(input_ids, positions)
        return run_layers(self.layers, self.norm, hidden_states, cos_sin, forward_batch)


class VariantForCausalLM(LlamaForCausalLM, ABC):
    """A VariantModel with the LM head (tied or separate); forward, logits and weights as LlamaForCausalLM."""

    # Why the fused CPU decode step (model_executor/fused_cpu_decode.py), which runs plain Llama layers, cannot run
    # this model; None where its layers compute as Llama's.
    fused_decode_exclusion: Optional[str] = None
    # False where the layers cannot be split over tensor-parallel ranks: the model refuses --tp-size > 1.
    tensor_parallel = True

    def __init__(
        self, config: Any, dtype: Optional[torch.dtype] = None, device: Optional[torch.device | str] = None
    ) -> None:
        if not self.tensor_parallel and get_tp_group().size > 1:
            raise ValueError(f"{type(self).__name__} does not support tensor parallelism (--tp-size 1)")
        # LlamaForCausalLM.__init__ would build a LlamaModel: this class builds its own backbone instead.
        nn.Module.__init__(self)
        self.config = config
        # Not a LlamaModel, but the same parts (embed_tokens, rotary_emb, layers, norm, embed) under the same names.
        self.model = self.build_model(config, dtype, device)  # type: ignore[assignment]
        self.attach_head(config, dtype, device)

    @abstractmethod
    def build_model(self, config: Any, dtype: Optional[torch.dtype],
                    device: Optional[torch.device | str]) -> VariantModel:
        """The backbone of this variant."""
