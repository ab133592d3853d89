"""Final hidden states -> float32 logits, only for the token rows that need them."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.distributed.parallel_state import get_tp_group
from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers.linear import DENSE, LinearMethod
from sglang.srt.layers.vocab_parallel_embedding import unpad_gathered_logits


def select_logit_rows(hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
    """The rows of hidden_states [T, hidden] whose logits are wanted.

    `forward_batch.logits_indices` when set; otherwise the last token of every sequence, which in decode
    mode is every row (so nothing is gathered).
    """
    if forward_batch.logits_indices is not None:
        return hidden_states.index_select(0, forward_batch.logits_indices)
    if forward_batch.forward_mode.is_decode() or hidden_states.shape[0] == forward_batch.batch_size:
        return hidden_states
    return hidden_states.index_select(0, forward_batch.last_token_indices())


class LogitsProcessor(nn.Module):
    """Projects the selected hidden states with the LM head (tied or separate) and returns float32 logits."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.vocab_size = int(config.vocab_size)
        # Some checkpoints scale logits (e.g. Cohere-style configs); 1.0 for the families here.
        self.logit_scale = float(getattr(config, "logit_scale", None) or 1.0)
        # How the LM head multiplies: dense unless the loader chose another method (e.g. GGUF blocks).
        self.head_method: LinearMethod = DENSE
        # With tensor parallelism each rank's head holds a slice of the vocabulary (vocab_parallel_embedding.py).
        self.tp = get_tp_group()

    def set_head_method(self, method: LinearMethod) -> None:
        self.head_method = method

    def forward(
        self,
        hidden_states: torch.Tensor,
        lm_head_weight: torch.Tensor,
        forward_batch: ForwardBatch,
        lm_head_bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        selected = select_logit_rows(hidden_states, forward_batch)
        # Matmul in the weight dtype (as the reference models do), then widen for sampling.
        logits = self.tp.all_gather(self.head_method.apply(lm_head_weight, selected, lm_head_bias)).float()
        if self.logit_scale != 1.0:
            logits.mul_(self.logit_scale)
        return unpad_gathered_logits(logits, self.vocab_size, self.tp.size)
