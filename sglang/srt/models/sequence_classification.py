"""Decoder models with a scoring head: reward models and sequence classifiers (one score row per sequence).

They reuse the Llama / Qwen2 backbone (and so the paged KV attention of a prefill); the head reads the hidden
state of each sequence's last token, as the Hugging Face classes do for unpadded inputs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers.linear import Linear
from sglang.srt.layers.pooler import last_token_indices
from sglang.srt.model_loader.weights import load_checkpoint_weights
from sglang.srt.models.llama import DecoderOptions, LlamaForCausalLM, LlamaModel
from sglang.srt.models.qwen2 import Qwen2ForCausalLM

Device = Optional[torch.device | str]


class LlamaForSequenceClassification(nn.Module):
    """Backbone + `score` (linear, no bias) on the last token: a reward model's scalar, or class logits."""

    pooling_output = "scores"
    is_encoder = False

    def __init__(self, config: Any, dtype: Optional[torch.dtype] = None, device: Device = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.decoder_options(config), dtype=dtype, device=device)
        self.score = self.build_head(config, dtype, device)

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return LlamaForCausalLM.decoder_options(config)

    def build_head(self, config: Any, dtype: Optional[torch.dtype], device: Device) -> nn.Module:
        return Linear(config.hidden_size, config.num_labels, False, dtype=dtype, device=device)

    def forward_scores(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
                       ) -> torch.Tensor:
        hidden = self.model(input_ids, positions, forward_batch)
        last = hidden.index_select(0, last_token_indices(forward_batch.extend_seq_lens_cpu, hidden.device))
        return self.score(last).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint_weights(self, weights)


class Qwen2ForSequenceClassification(LlamaForSequenceClassification):
    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return Qwen2ForCausalLM.decoder_options(config)


class Qwen2ForRewardModel(Qwen2ForSequenceClassification):
    """Qwen2.5-Math-RM style: `score` is Linear(h, h) -> ReLU -> Linear(h, num_labels), both with bias."""

    def build_head(self, config: Any, dtype: Optional[torch.dtype], device: Device) -> nn.Module:
        h = config.hidden_size
        return nn.Sequential(
            Linear(h, h, True, dtype=dtype, device=device),
            nn.ReLU(),
            Linear(h, getattr(config, "num_labels", 1), True, dtype=dtype, device=device),
        )
