"""Embedding table and LM head split by vocabulary rows over the tensor-parallel ranks.

Rank r holds the token ids of `partition(vocab, tp, r)` (distributed/partition.py: as even as possible, the
first ranks one row more when tp does not divide the vocabulary), in a table of per_rank = ceil(vocab / tp)
rows whose rows past its share are zero. A lookup sums the ranks' partial embeddings (each rank contributes only
the ids it holds); the LM head's logits are gathered along the vocabulary (LogitsProcessor) and each rank's
padding cut off (`unpad_gathered_logits`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed.parallel_state import TPGroup, get_tp_group
from sglang.srt.distributed.partition import partition


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: Optional[torch.dtype],
                 device: Optional[torch.device | str], tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // tp.size)
        # rows of the checkpoint this rank holds (one fewer than per_rank on the last ranks when tp does not
        # divide the vocabulary: every rank's table has per_rank rows, so the gathered logits are equal parts)
        self.start, self.num_local = partition(num_embeddings, tp.size, tp.rank)
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


def unpad_gathered_logits(logits: torch.Tensor, vocab_size: int, tp_size: int) -> torch.Tensor:
    """The vocabulary columns of logits gathered from every rank's padded table of ceil(vocab / tp) rows
    (a single unsharded head only has padding at the end, if any)."""
    per_rank = -(-vocab_size // tp_size)
    if tp_size == 1 or vocab_size % tp_size == 0 or logits.shape[-1] != per_rank * tp_size:
        return logits[..., :vocab_size] if logits.shape[-1] > vocab_size else logits
    return logits.index_select(-1, _held_columns(vocab_size, tp_size).to(logits.device))


@functools.lru_cache(maxsize=8)
def _held_columns(vocab_size: int, tp_size: int) -> torch.Tensor:
    per_rank = -(-vocab_size // tp_size)
    return torch.cat([torch.arange(rank * per_rank, rank * per_rank + partition(vocab_size, tp_size, rank)[1])
                      for rank in range(tp_size)])
