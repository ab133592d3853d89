"""What the models that read images share (Qwen2-VL, Gemma 3): a vision part and a text decoder held under the
checkpoint's names (`model.language_model`, ...), the LM head on the decoder (tied to its embeddings or separate),
the token embeddings of a prompt whose image tokens carry ids beyond the vocabulary, and weight loading after the
model's renaming of older layouts."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.model_loader.weights import load_checkpoint_weights

WeightStream = Iterable[tuple[str, torch.Tensor]]


class VisionLanguageModel(nn.Module, ABC):
    has_image_understanding = True
    # A module whose `language_model` is the text decoder (with `embed_tokens`), set by the subclass.
    model: Any

    def attach_head(self, config: Any, text_config: Any, tie_by_default: bool, dtype: Optional[torch.dtype],
                    device: Optional[torch.device | str]) -> None:
        """The LM head (the decoder's input embeddings when tied) and the logits processor, after `self.model`."""
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", tie_by_default))
        if self.tie_word_embeddings:
            self.lm_head: nn.Module = self.model.language_model.embed_tokens
        else:
            self.lm_head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False, dtype=dtype,
                                     device=device)
        self.logits_processor = LogitsProcessor(text_config)
        self.vocab_size = int(text_config.vocab_size)

    def text_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's token embeddings. Image tokens may carry cache-key ids beyond the vocabulary: they embed
        as token 0 here, and their rows are replaced by the image embeddings."""
        ids = torch.where(input_ids < self.vocab_size, input_ids, torch.zeros_like(input_ids))
        return self.model.language_model.embed_tokens(ids)

    @abstractmethod
    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
                       ) -> torch.Tensor:
        """Final normed hidden states [num_tokens, hidden_size] of every token in the batch."""

    @staticmethod
    @abstractmethod
    def current_names(weights: WeightStream) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under this module's names (older layouts renamed)."""

    def compute_logits(self, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.logits_processor(hidden_states, self.lm_head.weight, forward_batch)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.compute_logits(self.forward_hidden(input_ids, positions, forward_batch), forward_batch)

    def load_weights(self, weights: WeightStream) -> None:
        aliases = {"lm_head.weight": "model.language_model.embed_tokens.weight"} if self.tie_word_embeddings else {}
        load_checkpoint_weights(self, self.current_names(weights), tied_aliases=aliases)
