"""The attention backend interface: backends swap (torch SDPA on CPU, faster CPU/CUDA paths later)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch
from torch import nn

from sglang.srt.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Computes attention of the new tokens of a ForwardBatch against the paged KV cache."""

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build per-forward metadata once (shared by every layer) into forward_batch.attn_metadata."""

    @abstractmethod
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, forward_batch: ForwardBatch,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] for the new tokens. Stores k/v, returns [T, H * Dv].

        `sinks` [H] (None: none): a learned logit per head that joins each query's softmax denominator and
        contributes no value (attention sinks, GPT-OSS), so a query may attend to "nothing" in part."""

    @abstractmethod
    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, forward_batch: ForwardBatch,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Same contract as forward_extend with exactly one new token per sequence."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, forward_batch: ForwardBatch,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, sinks)
        return self.forward_extend(q, k, v, layer, forward_batch, sinks)


class AttentionLayerSpec:
    """What a backend needs to know about one attention layer.

    `sliding_window` (None: the whole sequence): a query at position p attends to positions p - window + 1 .. p
    only, as transformers' sliding-window masks do. `logit_softcap` (None: none): scores s become
    cap * tanh(s / cap) before the softmax (Gemma 2)."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float,
                 sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None) -> None:
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap

    @property
    def window(self) -> int:
        """The sliding window as the compiled kernels take it (0: none)."""
        return self.sliding_window or 0


def sliding_window_layers(model: nn.Module) -> dict[int, int]:
    """Layer id -> window of every attention layer of `model` that attends within a sliding window."""
    windows = {}
    for module in model.modules():
        spec = getattr(module, "spec", None)
        if isinstance(spec, AttentionLayerSpec) and spec.sliding_window:
            windows[spec.layer_id] = spec.sliding_window
    return windows
