"""The attention backend interface: backends swap (torch SDPA on CPU, faster CPU/CUDA paths later)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from sglang.srt.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Computes attention of the new tokens of a ForwardBatch against the paged KV cache."""

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build per-forward metadata once (shared by every layer) into forward_batch.attn_metadata."""

    @abstractmethod
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] for the new tokens. Stores k/v, returns [T, H * Dv]."""

    @abstractmethod
    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """Same contract as forward_extend with exactly one new token per sequence."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch)
        return self.forward_extend(q, k, v, layer, forward_batch)


class AttentionLayerSpec:
    """What a backend needs to know about one attention layer."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float) -> None:
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
