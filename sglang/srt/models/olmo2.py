"""OLMo 2: a Llama-like decoder with post-norms and QK-norm over the whole projections.

- q and k are RMS-normalised over all their heads at once (norms of size heads * head_dim and kv_heads * head_dim)
  before the rotary embedding, not per head as in Qwen3 (under tensor parallelism each rank normalises its heads
  with the sum of squares added up over the ranks);
- a layer has no input norm: the attention reads the residual stream itself, and its output is normalised
  (`post_attention_layernorm`) before it is added back; the MLP likewise (`post_feedforward_layernorm`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.distributed.parallel_state import get_tp_group
from sglang.srt.distributed.partition import head_partition
from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers.layernorm import RMSNorm, rms_norm_over_heads
from sglang.srt.layers.linear import merged_linear, row_parallel_linear
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import apply_rotary_emb
from sglang.srt.models.llama import CosSin, LlamaMLP, head_dim_of
from sglang.srt.models.llama_variants import VariantForCausalLM, VariantModel


class Olmo2Attention(nn.Module):
    def __init__(self, config: Any, layer_id: int, rotary_dim: int, dtype: Optional[torch.dtype],
                 device: Optional[torch.device | str]) -> None:
        super().__init__()
        tp = get_tp_group()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        Olmo2ForCausalLM.check_tensor_parallel(config, tp.size)
        heads = head_partition(total_heads, total_kv_heads, tp.size, tp.rank)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.head_dim = head_dim_of(config)
        self.rotary_dim = rotary_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = merged_linear(
            config.hidden_size, [("q_proj", total_heads * self.head_dim), ("k_proj", total_kv_heads * self.head_dim),
                                 ("v_proj", total_kv_heads * self.head_dim)],
            bias, dtype, device, slices=heads.row_slices(self.head_dim),
        )
        self.o_proj = row_parallel_linear(total_heads * self.head_dim, config.hidden_size, bias, dtype, device,
                                          cols=(heads.q_start * self.head_dim, self.q_size))
        eps = config.rms_norm_eps
        # over all heads: summed over the ranks under tensor parallelism (layers/layernorm.ShardedRMSNorm)
        self.q_norm = rms_norm_over_heads(total_heads * self.head_dim, heads.q_start * self.head_dim, self.q_size,
                                          eps, dtype, device)
        self.k_norm = rms_norm_over_heads(total_kv_heads * self.head_dim, heads.kv_start * self.head_dim,
                                          self.kv_size, eps, dtype, device)
        self.attn = RadixAttention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, cos_sin: CosSin, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        num_tokens = qkv.shape[0]
        qk_end = self.q_size + self.kv_size
        q = self.q_norm(qkv[:, : self.q_size].contiguous()).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_norm(qkv[:, self.q_size : qk_end].contiguous()).view(num_tokens, self.num_kv_heads, self.head_dim)
        cos, sin = cos_sin
        q = apply_rotary_emb(q, cos, sin, self.rotary_dim)
        k = apply_rotary_emb(k, cos, sin, self.rotary_dim)
        v = qkv[:, qk_end:].view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, forward_batch))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, rotary_dim: int, dtype: Optional[torch.dtype],
                 device: Optional[torch.device | str]) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, layer_id, rotary_dim, dtype, device)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, getattr(config, "hidden_act", "silu"),
                            False, dtype, device)
        eps = config.rms_norm_eps
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)

    def forward(
        self,
        cos_sin: CosSin,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        residual: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # `hidden_states` is the previous layer's normed MLP output (or the embeddings): add it to the stream first.
        residual = hidden_states if residual is None else residual + hidden_states
        attn_out = self.self_attn(cos_sin, residual, forward_batch)
        residual = residual + self.post_attention_layernorm(attn_out)
        return self.post_feedforward_layernorm(self.mlp(residual)), residual


class Olmo2ForCausalLM(VariantForCausalLM):
    # The fused CPU decode step (model_executor/fused_cpu_decode.py) runs pre-norm Llama layers.
    fused_decode_exclusion = ("OLMo 2 normalises whole q/k projections and the attention and MLP outputs "
                              "(the fused step runs pre-norm Llama layers)")

    @staticmethod
    def check_tensor_parallel(config: Any, tp_size: int) -> None:
        """A replicated K/V head would count twice in k_norm's sum over the ranks: at most one rank per K/V head."""
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        if tp_size > kv_heads:
            raise ValueError(f"--tp-size {tp_size}: OLMo 2 splits its {kv_heads} key/value heads over the ranks (its "
                             f"k norm spans them all); choose a tensor-parallel size of at most {kv_heads}")

    def build_model(self, config: Any, dtype: Optional[torch.dtype],
                    device: Optional[torch.device | str]) -> VariantModel:
        def make_layer(layer_id: int, rotary_dim: int) -> nn.Module:
            return Olmo2DecoderLayer(config, layer_id, rotary_dim, dtype, device)

        return VariantModel(config, make_layer, dtype, device)


EntryClass = Olmo2ForCausalLM
