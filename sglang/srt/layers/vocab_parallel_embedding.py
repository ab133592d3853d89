"""Embedding table and LM head split by vocabulary rows over the tensor-parallel ranks.

Rank r holds token ids [r * per_rank, (r + 1) * per_rank) with per_rank = ceil(vocab / tp); the last rank's
rows past the vocabulary are zero. A lookup sums the ranks' partial embeddings (each rank contributes only the
ids it holds); the LM head's logits are gathered along the vocabulary (LogitsProcessor) and the padding cut off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed.parallel_state import TPGroup, get_tp_group


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: Optional[torch.dtype],
                 device: Optional[torch.device | str], tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // tp.size)
        self.start = tp.rank * self.per_rank
        # rows of the checkpoint this rank holds (the last rank may hold fewer, or none for tiny vocabularies)
        self.num_local = max(0, min(self.per_rank, num_embeddings - self.start))
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim, dtype=dtype, device=device),
                                   requires_grad=False)

    def checkpoint_slicers(self) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        def weight(t: torch.Tensor) -> torch.Tensor:
            if t.dim() != 2 or t.shape[0] != self.num_embeddings:
                return t  # the copy reports the shape mismatch
            part = t.narrow(0, self.start, self.num_local)
            return F.pad(part, (0, 0, 0, self.per_rank - self.num_local))

        return {"weight": weight}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        held = (local >= 0) & (local < self.num_local)
        out = F.embedding(torch.where(held, local, torch.zeros_like(local)), self.weight)
        out.mul_(held.unsqueeze(-1).to(out.dtype))
        return self.tp.all_reduce(out)


def vocab_embedding(num_embeddings: int, embedding_dim: int, dtype: Optional[torch.dtype],
                    device: Optional[torch.device | str]) -> nn.Module:
    """nn.Embedding, or its vocabulary-parallel split when the tensor-parallel group has several ranks."""
    tp = get_tp_group()
    if tp.size == 1:
        return nn.Embedding(num_embeddings, embedding_dim, dtype=dtype, device=device)
    return VocabParallelEmbedding(num_embeddings, embedding_dim, dtype, device, tp)


def lm_head(hidden_size: int, vocab_size: int, dtype: Optional[torch.dtype],
            device: Optional[torch.device | str]) -> nn.Module:
    """An untied LM head: nn.Linear, or vocabulary rows of it per rank (logits gathered by LogitsProcessor)."""
    tp = get_tp_group()
    if tp.size == 1:
        return nn.Linear(hidden_size, vocab_size, bias=False, dtype=dtype, device=device)
    return VocabParallelEmbedding(vocab_size, hidden_size, dtype, device, tp)
