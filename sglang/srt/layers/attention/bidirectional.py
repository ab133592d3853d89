"""Bidirectional (encoder) attention over a flat batch of variable-length sequences, without a KV cache.

Encoders such as BERT attend to the whole sequence, so nothing is cached between forwards. The flat tokens are
scattered once into a padded [batch, max_len] layout, attention runs as one SDPA call with a key-padding mask,
and the outputs are gathered back; the projections around it stay on the unpadded tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass
class PaddedLayout:
    batch_size: int
    max_len: int
    # [num_tokens] slot of each flat token in the padded [batch * max_len] layout
    token_slots: torch.Tensor
    # [batch, 1, 1, max_len] True where a key is a real token; None when no sequence is padded
    key_mask: Optional[torch.Tensor]

    @classmethod
    def build(cls, seq_lens: list[int], device: torch.device) -> PaddedLayout:
        batch, max_len = len(seq_lens), max(seq_lens)
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        starts = lens.cumsum(0) - lens
        seq = torch.repeat_interleave(torch.arange(batch), lens)
        offset_in_seq = torch.arange(int(lens.sum())) - starts[seq]
        slots = (seq * max_len + offset_in_seq).to(device)
        mask = None
        if min(seq_lens) != max_len:
            mask = (torch.arange(max_len).unsqueeze(0) < lens.unsqueeze(1)).view(batch, 1, 1, max_len).to(device)
        return cls(batch, max_len, slots, mask)


def bidirectional_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PaddedLayout, scale: float
) -> torch.Tensor:
    """q/k/v [num_tokens, heads, head_dim] -> [num_tokens, heads * head_dim]."""
    num_tokens, heads, head_dim = q.shape
    if layout.batch_size == 1:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=scale
        )
        return out.transpose(0, 1).reshape(num_tokens, heads * head_dim)
    out = F.scaled_dot_product_attention(
        _pad(q, layout), _pad(k, layout), _pad(v, layout), attn_mask=layout.key_mask, scale=scale
    )
    # [B, H, L, D] -> [B * L, H * D] -> the real tokens only
    out = out.transpose(1, 2).reshape(layout.batch_size * layout.max_len, heads * head_dim)
    return out.index_select(0, layout.token_slots)


def _pad(x: torch.Tensor, layout: PaddedLayout) -> torch.Tensor:
    _, heads, head_dim = x.shape
    padded = x.new_zeros(layout.batch_size * layout.max_len, heads, head_dim)
    padded.index_copy_(0, layout.token_slots, x)
    return padded.view(layout.batch_size, layout.max_len, heads, head_dim).transpose(1, 2)
