"""Attention in torch for the layers SDPA's causal flag cannot describe: sliding windows and logit soft-capping.

A sliding window of W keeps, for the query at position p, the keys at positions p - W + 1 .. p (transformers'
`sliding_window_overlay`: kv_idx > q_idx - W). Soft-capping (Gemma 2) maps each scaled score s to
cap * tanh(s / cap) before the mask and the softmax, which SDPA has no hook for, so those layers run the same
steps as transformers' eager attention: scores, cap, mask, float32 softmax, weighted values.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def extend_mask(prefix_len: int, extend_len: int, window: int, device: torch.device) -> torch.Tensor:
    """[extend_len, prefix_len + extend_len] True where the new token j (at position prefix_len + j) sees a key:
    causal, and within the last `window` positions when window > 0."""
    query_positions = torch.arange(prefix_len, prefix_len + extend_len, device=device)[:, None]
    key_positions = torch.arange(prefix_len + extend_len, device=device)[None, :]
    mask = key_positions <= query_positions
    if window > 0:
        mask &= key_positions > query_positions - window
    return mask


def decode_key_mask(seq_lens: torch.Tensor, max_len: int, window: int) -> torch.Tensor:
    """[B, max_len] True for the keys the next token of each sequence sees: its first seq_len positions, of them
    the last `window` when window > 0."""
    key_positions = torch.arange(max_len, device=seq_lens.device)[None, :]
    lens = seq_lens[:, None]
    mask = key_positions < lens
    if window > 0:
        mask &= key_positions >= lens - window
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
           softcap: Optional[float]) -> torch.Tensor:
    """q [B, H, n, D], k/v [B, Hkv, L, D] (H a multiple of Hkv), mask broadcastable to [B, H, n, L] (True: attended;
    every query sees at least one key) -> [B, H, n, Dv]."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads)
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)
