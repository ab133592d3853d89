"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama decoder, stored with fused `qkv_proj` and `gate_up_proj` weights, with
LongRoPE (layers/rotary_embedding.LongRopeRotaryEmbedding) and partial rotary (`partial_rotary_factor`) where the
config asks for them.

With LongRoPE the rotation of a token depends on the length of its sequence (short factors up to the original
length, long ones past it), so a prefill looks its rows up with each sequence's length: a prompt longer than the
original length is rotated with the long factors throughout, as in transformers. K/V computed in an earlier forward
(a cached prefix, an earlier chunk of a chunked prefill, the decode steps before the sequence grew past the length)
keep the rotation they were computed with, as in transformers' forward with a KV cache. transformers' `generate`
instead recomputes the whole sequence with the long factors at the step where it first grows past the original
length, so a generation that crosses it while decoding may differ from `generate` from that step on.

A `sliding_window` (Phi-3-mini-4k: 2047) applies to every layer, as in transformers (models/mistral.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch

from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers.rotary_embedding import LongRopeRotaryEmbedding
from sglang.srt.models.llama import LlamaForCausalLM, head_dim_of
from sglang.srt.models.llama_variants import run_layers
from sglang.srt.models.mistral import window_every_layer


def split_fused_weights(config: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's fused `qkv_proj` / `gate_up_proj` tensors as the q/k/v and gate/up shards the model's merged
    linears load (so each tensor-parallel rank takes its own rows of each)."""
    head_dim = head_dim_of(config)
    q_size = config.num_attention_heads * head_dim
    kv_size = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    for name, tensor in weights:
        if name.endswith(".self_attn.qkv_proj.weight"):
            prefix = name[: -len("qkv_proj.weight")]
            for shard, part in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q_size, kv_size, kv_size])):
                yield f"{prefix}{shard}.weight", part
        elif name.endswith(".mlp.gate_up_proj.weight"):
            prefix = name[: -len("gate_up_proj.weight")]
            gate, up = tensor.split([config.intermediate_size, config.intermediate_size])
            yield f"{prefix}gate_proj.weight", gate
            yield f"{prefix}up_proj.weight", up
        else:
            yield name, tensor


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(
        self, config: Any, dtype: Optional[torch.dtype] = None, device: Optional[torch.device | str] = None
    ) -> None:
        super().__init__(config, dtype, device)
        window_every_layer(self, getattr(config, "sliding_window", None))

    def forward_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        rotary = self.model.rotary_emb
        if not isinstance(rotary, LongRopeRotaryEmbedding) or forward_batch.forward_mode.is_decode():
            # Every decode token is the last of its sequence: the plain lookup is exact (and the fused CPU decode
            # step, which calls model.embed, computes the same rows).
            return self.model(input_ids, positions, forward_batch)
        hidden_states = self.model.embed_tokens(input_ids)
        seq_lens = torch.repeat_interleave(
            forward_batch.seq_lens.to(positions.device),
            torch.tensor(forward_batch.extend_seq_lens_cpu, device=positions.device),
            output_size=positions.shape[0],
        )
        cos_sin = rotary.lookup_in_sequences(positions, seq_lens, hidden_states.dtype)
        return run_layers(self.model.layers, self.model.norm, hidden_states, cos_sin, forward_batch)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.compute_logits(self.forward_hidden(input_ids, positions, forward_batch), forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(split_fused_weights(self.config, weights))


EntryClass = Phi3ForCausalLM
