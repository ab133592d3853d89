"""Per-sequence reduction of a flat batch of hidden states: mean, last token or first (CLS) token.

The batch is the runner's flat token dimension (sequences concatenated, lengths in
`ForwardBatch.extend_seq_lens_cpu`); every reduction is one tensor op over the whole batch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class PoolingType(enum.Enum):
    MEAN = "mean"
    LAST = "last"
    CLS = "cls"


@dataclass(frozen=True)
class PoolingConfig:
    pooling_type: PoolingType
    normalize: bool


def segment_ids(seq_lens: list[int], device: torch.device) -> torch.Tensor:
    """[num_tokens] index of the sequence each flat token belongs to."""
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(len(seq_lens)), lens).to(device)


def first_token_indices(seq_lens: list[int], device: torch.device) -> torch.Tensor:
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    return (lens.cumsum(0) - lens).to(device)


def last_token_indices(seq_lens: list[int], device: torch.device) -> torch.Tensor:
    return (torch.tensor(seq_lens, dtype=torch.int64).cumsum(0) - 1).to(device)


def pool(hidden: torch.Tensor, seq_lens: list[int], pooling_type: PoolingType) -> torch.Tensor:
    """hidden [num_tokens, H] -> [num_seqs, H] in float32."""
    device = hidden.device
    if pooling_type is PoolingType.LAST:
        return hidden.index_select(0, last_token_indices(seq_lens, device)).float()
    if pooling_type is PoolingType.CLS:
        return hidden.index_select(0, first_token_indices(seq_lens, device)).float()
    sums = torch.zeros(len(seq_lens), hidden.shape[-1], dtype=torch.float32, device=device)
    sums.index_add_(0, segment_ids(seq_lens, device), hidden.float())
    return sums / torch.tensor(seq_lens, dtype=torch.float32, device=device).unsqueeze(1)


class Pooler:
    """Reduce then (optionally) L2-normalize, as a sentence-transformers Pooling + Normalize pair does."""

    def __init__(self, config: PoolingConfig) -> None:
        self.config = config

    def __call__(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        pooled = pool(hidden, seq_lens, self.config.pooling_type)
        return F.normalize(pooled, p=2, dim=-1) if self.config.normalize else pooled
