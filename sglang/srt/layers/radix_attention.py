"""The attention module a model places in each layer; the actual kernel comes from the forward's backend."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers.attention.base import AttentionLayerSpec


class RadixAttention(nn.Module):
    """Attention of the new tokens against the paged KV cache of their sequences.

    Holds no weights: only the layer's shape, which the backend needs to address the pool and run the kernel.
    """

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float,
                 sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.spec = AttentionLayerSpec(layer_id, num_heads, num_kv_heads, head_dim, scaling, sliding_window,
                                       logit_softcap)

    @property
    def layer_id(self) -> int:
        return self.spec.layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H * D]; `sinks` [H]: per-head sink logits (AttentionBackend.forward)."""
        return forward_batch.attn_backend.forward(q, k, v, self.spec, forward_batch, sinks)

    def extra_repr(self) -> str:
        s = self.spec
        extra = "" if s.sliding_window is None else f", sliding_window={s.sliding_window}"
        if s.logit_softcap is not None:
            extra += f", logit_softcap={s.logit_softcap}"
        return f"layer_id={s.layer_id}, heads={s.num_heads}, kv_heads={s.num_kv_heads}, head_dim={s.head_dim}{extra}"
