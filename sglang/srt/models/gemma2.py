"""Gemma 2: a decoder whose layers alternate between sliding-window and global attention, with Gemma's own parts.

What differs from the Llama decoder (as transformers' Gemma2 computes it):
- the token embeddings are scaled by sqrt(hidden_size), the factor rounded to the model dtype first;
- RMSNorm multiplies by (1 + weight), in float32, and rounds once to the activation dtype;
- each layer has four norms: before and after attention, before and after the MLP (the "post" norms act on the
  sublayer's output before the residual add);
- the MLP is GeGLU with the tanh approximation of gelu (`hidden_activation: gelu_pytorch_tanh`);
- scores are scaled by query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5) and soft-capped
  (attn_logit_softcapping: s -> cap * tanh(s / cap)); the layers marked "sliding_attention" in `layer_types`
  attend to the last `sliding_window` positions only;
- the final logits are soft-capped too (final_logit_softcapping).

Gemma 3 (models/gemma3.py) reuses all of it with per-head q/k norms and a second RoPE base for its sliding layers.
Soft-capped attention runs on the torch path of the attention backend (layers/attention/masked.py), which computes
it as transformers' eager attention does; layers without a cap use the compiled CPU kernels, window included.
Tensor parallelism splits the heads (with their q/k norms and windows) and the MLP as Llama's decoder does; every
part above acts on one head or on whole hidden rows, so nothing else changes between ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers.activation import GeluAndMul
from sglang.srt.layers.linear import merged_linear, row_parallel_linear
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, get_rope
from sglang.srt.layers.vocab_parallel_embedding import lm_head, vocab_embedding
from sglang.srt.model_loader.weights import load_checkpoint_weights
from sglang.srt.models.llama import CosSin, DecoderOptions, LlamaAttention, head_dim_of

# transformers' names of the gelu variants Gemma configs use -> torch's `approximate`
_GELU_APPROXIMATION = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight), computed in float32 and rounded once to `out_dtype` (default: x's)."""

    def __init__(self, hidden_size: int, eps: float, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device | str] = None) -> None:
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.variance_epsilon)
        return (normed * (1.0 + self.weight.float())).to(out_dtype or x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"


def layer_types_of(config: Any, default_pattern: int) -> list[str]:
    """config.layer_types, or the pattern older configs imply: every `default_pattern`-th layer global."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return list(layer_types)
    pattern = int(getattr(config, "sliding_window_pattern", None) or default_pattern)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(config.num_hidden_layers)]


class GemmaMLP(nn.Module):
    def __init__(self, config: Any, dtype: Optional[torch.dtype], device: Optional[torch.device | str]) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if act not in _GELU_APPROXIMATION:
            raise ValueError(f"Unsupported hidden_activation {act!r}; supported: {', '.join(_GELU_APPROXIMATION)}")
        inter = config.intermediate_size
        self.gate_up_proj = merged_linear(config.hidden_size, [("gate_proj", inter), ("up_proj", inter)], False,
                                          dtype, device)
        self.down_proj = row_parallel_linear(inter, config.hidden_size, False, dtype, device)
        self.act_fn = GeluAndMul(_GELU_APPROXIMATION[act])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaAttention(LlamaAttention):
    """Llama's attention (fused q/k/v, RoPE, GQA) with Gemma's score scale, soft cap, window and q/k norms."""

    def __init__(self, config: Any, layer_id: int, layer_type: str, rotary_dim: int, qk_norm: bool,
                 dtype: Optional[torch.dtype], device: Optional[torch.device | str]) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer_id, rotary_dim, DecoderOptions(qkv_bias=bias, o_proj_bias=bias), dtype,
                         device)
        if qk_norm:
            eps = config.rms_norm_eps
            self.q_norm = GemmaRMSNorm(self.head_dim, eps, dtype, device)  # type: ignore[assignment]
            self.k_norm = GemmaRMSNorm(self.head_dim, eps, dtype, device)  # type: ignore[assignment]
        window = config.sliding_window if layer_type == "sliding_attention" else None
        self.attn = RadixAttention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim,
                                   float(config.query_pre_attn_scalar) ** -0.5,
                                   sliding_window=None if window is None else int(window),
                                   logit_softcap=getattr(config, "attn_logit_softcapping", None))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, layer_type: str, rotary_dim: int, qk_norm: bool,
                 dtype: Optional[torch.dtype], device: Optional[torch.device | str]) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = GemmaAttention(config, layer_id, layer_type, rotary_dim, qk_norm, dtype, device)
        self.mlp = GemmaMLP(config, dtype, device)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)

    def forward(self, cos_sin: CosSin, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        residual = hidden_states
        attn_out = self.self_attn(cos_sin, self.input_layernorm(hidden_states), forward_batch)
        hidden_states = residual + self.post_attention_layernorm(attn_out, out_dtype=residual.dtype)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mlp_out, out_dtype=hidden_states.dtype)


def softcap(logits: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """cap * tanh(logits / cap), or the logits unchanged without a cap."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


class GemmaModel(nn.Module):
    """Embeddings scaled by sqrt(hidden), the decoder layers and the final norm. `local_rotary_emb` (Gemma 3) turns
    the sliding layers' positions with its own base; otherwise every layer uses `rotary_emb`."""

    def __init__(self, config: Any, layer_types: list[str], qk_norm: bool, dtype: Optional[torch.dtype],
                 device: Optional[torch.device | str], rotary_emb: Optional[RotaryEmbedding] = None,
                 local_rotary_emb: Optional[RotaryEmbedding] = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.rotary_emb: RotaryEmbedding = rotary_emb or get_rope(config, head_dim_of(config), device=device)
        self.local_rotary_emb = local_rotary_emb
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, layer_types[i], self.rotary_emb.rotary_dim, qk_norm, dtype, device)
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.run_layers(self.scale_embeddings(self.embed_tokens(input_ids)), positions, forward_batch)

    def scale_embeddings(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # The factor as transformers holds it: a float32 scalar, rounded to the model dtype before the multiply.
        return hidden_states * torch.tensor(self.config.hidden_size**0.5).to(hidden_states.dtype)

    def run_layers(self, hidden_states: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
                   ) -> torch.Tensor:
        """The decoder layers over the (scaled) input embeddings, then the final norm."""
        # One table lookup per forward and RoPE base, shared by the layers that use it.
        global_cos_sin = self.rotary_emb.lookup(positions, hidden_states.dtype)
        local_cos_sin = (global_cos_sin if self.local_rotary_emb is None
                         else self.local_rotary_emb.lookup(positions, hidden_states.dtype))
        for layer in self.layers:
            cos_sin = local_cos_sin if layer.layer_type == "sliding_attention" else global_cos_sin
            hidden_states = layer(cos_sin, hidden_states, forward_batch)
        return self.norm(hidden_states)


class Gemma2ForCausalLM(nn.Module):
    # Older configs without layer_types: every second layer is global.
    default_sliding_window_pattern = 2
    qk_norm = False

    def __init__(
        self, config: Any, dtype: Optional[torch.dtype] = None, device: Optional[torch.device | str] = None
    ) -> None:
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Bidirectional Gemma attention (embedding models) is not supported; only causal decoders")
        self.config = config
        layer_types = layer_types_of(config, self.default_sliding_window_pattern)
        rotary, local_rotary = self.rotary_embeddings(config, device)
        self.model = GemmaModel(config, layer_types, self.qk_norm, dtype, device, rotary, local_rotary)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head: nn.Module = self.model.embed_tokens
        else:
            self.lm_head = lm_head(config.hidden_size, config.vocab_size, dtype, device)
        self.logits_processor = LogitsProcessor(config)
        self.final_logit_softcapping: Optional[float] = getattr(config, "final_logit_softcapping", None)

    @classmethod
    def rotary_embeddings(cls, config: Any, device: Optional[torch.device | str]
                          ) -> tuple[Optional[RotaryEmbedding], Optional[RotaryEmbedding]]:
        """(global, local) RoPE; None: the config's single RoPE for every layer."""
        return None, None

    def forward_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """Final normed hidden states [num_tokens, hidden_size] of every token in the batch."""
        return self.model(input_ids, positions, forward_batch)

    def compute_logits(self, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [num_selected, vocab], soft-capped where the config asks."""
        return softcap(self.logits_processor(hidden_states, self.lm_head.weight, forward_batch),
                       self.final_logit_softcapping)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.compute_logits(self.model(input_ids, positions, forward_batch), forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        aliases = {"lm_head.weight": "model.embed_tokens.weight"} if self.tie_word_embeddings else {}
        load_checkpoint_weights(self, weights, tied_aliases=aliases)


EntryClass = Gemma2ForCausalLM
