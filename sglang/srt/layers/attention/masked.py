"""Attention in torch for the layers SDPA's causal flag cannot describe: sliding windows, logit soft-capping and
attention sinks.

A sliding window of W keeps, for the query at position p, the keys at positions p - W + 1 .. p (transformers'
`sliding_window_overlay`: kv_idx > q_idx - W). Soft-capping (Gemma 2) maps each scaled score s to
cap * tanh(s / cap) before the mask and the softmax, which SDPA has no hook for, so those layers run the same
steps as transformers' eager attention: scores, cap, mask, float32 softmax, weighted values. Attention sinks
(GPT-OSS) add one learned logit per head to each softmax row and drop its probability afterwards, so the weights
of a row sum to less than one.
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
           softcap: Optional[float], sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B, H, n, D], k/v [B, Hkv, L, D] (H a multiple of Hkv), mask broadcastable to [B, H, n, L] (True: attended;
    every query sees at least one key) -> [B, H, n, Dv]. `sinks` [H]: one more logit per head in every softmax
    denominator, whose probability is dropped (it has no value)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads)
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    rows = q.shape[2]
    # The explicit path holds a few [B, H, rows, L] score tensors: a long prefill runs in slices of query rows that
    # keep one of them within SCORE_BUDGET elements (each row is computed alone either way).
    step = max(1, SCORE_BUDGET // max(1, q.shape[0] * heads * k.shape[2]))
    if rows <= step:
        return _attend_rows(q, k, v, mask, scale, softcap, sinks)
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    for start in range(0, rows, step):
        end = min(rows, start + step)
        rows_mask = mask if mask is None or mask.dim() < 2 or mask.shape[-2] == 1 else mask[..., start:end, :]
        out[:, :, start:end] = _attend_rows(q[:, :, start:end], k, v, rows_mask, scale, softcap, sinks)
    return out


# Elements of one [B, H, rows, L] score tensor on the explicit path (float32: 256 MiB).
SCORE_BUDGET = 1 << 26


def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                 softcap: Optional[float], sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """attend's explicit steps with K/V already repeated to q's heads."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, v)
    sink_column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink_column], dim=-1)
    # max subtracted first, as the reference does: it keeps exp() finite in reduced precision
    combined = combined - combined.max(dim=-1, keepdim=True).values
    weights = torch.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype)
    return torch.matmul(weights, v)
