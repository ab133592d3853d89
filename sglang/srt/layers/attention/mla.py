"""Multi-head latent attention (DeepSeek-V2/V3) over the compressed KV cache, with absorbed projections.

Each token caches one row: its normed KV latent c (kv_lora_rank channels) and its rotated key part k_pe shared by
all heads (mem_cache/mla_kv_pool.py). A head's key is [W_UK c, k_pe] and its value W_UV c, with W_UK and W_UV the
head's rows of `kv_b_proj`. Instead of expanding every cached token into per-head keys and values, the up
projections are absorbed into the query and the output:

    q . k  = q_nope . (W_UK c) + q_pe . k_pe = (W_UK^T q_nope) . c + q_pe . k_pe
    sum p v = W_UV (sum p c)

so attention runs as multi-query attention with one KV "head" [c, k_pe] of kv_lora_rank + rope channels, queries
[W_UK^T q_nope, q_pe] and the row itself as value (the first kv_lora_rank channels of the output are sum p c; the
rest is dropped). Prefill and decode both take this form, through the forward's attention backend and its kernels
(a backend that serves grouped-query attention serves this). Per step the work is O(heads x kv_lora_rank) per
cached token instead of the expansion's O(heads x (nope + v) x kv_lora_rank).
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers.radix_attention import RadixAttention


def deinterleave_pairs(x: torch.Tensor) -> torch.Tensor:
    """Channels (x0, y0, x1, y1, ...) as (x0, x1, ..., y0, y1, ...): DeepSeek's rotary layout rotates interleaved
    pairs; in the halves layout the rotate-half RoPE rotates the same pairs by the same angles. Queries and keys are
    both rearranged, so their dot products are unchanged."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class LatentAttention(nn.Module):
    """Absorbed MLA of one layer: (q_nope, q_pe, latent, k_pe) of the new tokens -> per-head outputs [T, H * v]."""

    def __init__(self, layer_id: int, num_heads: int, qk_nope_head_dim: int, v_head_dim: int, kv_lora_rank: int,
                 qk_rope_head_dim: int, scaling: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.latent_dim = kv_lora_rank + qk_rope_head_dim
        self.attn = RadixAttention(layer_id, num_heads, 1, self.latent_dim, scaling)

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                kv_b_weight: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] (rotated), latent [T, kv_lora_rank] (normed), k_pe [T, rope]
        (rotated), kv_b_weight [H * (nope + v), kv_lora_rank] -> [T, H * v]."""
        num_tokens = q_nope.shape[0]
        heads, nope, rank = self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank
        w_kv = kv_b_weight.view(heads, nope + self.v_head_dim, rank)
        w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]  # [H, nope, rank], [H, v, rank]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk)  # [H, T, rank]
        q = torch.cat([q_latent.transpose(0, 1), q_pe.to(q_latent.dtype)], dim=-1)
        kv = torch.cat([latent, k_pe.to(latent.dtype)], dim=-1).unsqueeze(1)  # [T, 1, rank + rope]
        out = self.attn(q, kv, kv, forward_batch).view(num_tokens, heads, self.latent_dim)[..., :rank]
        out = torch.bmm(out.transpose(0, 1).to(w_uv.dtype), w_uv.transpose(1, 2))  # [H, T, v]
        return out.transpose(0, 1).reshape(num_tokens, heads * self.v_head_dim)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, latent_dim={self.latent_dim}, "
                f"v_head_dim={self.v_head_dim}")
