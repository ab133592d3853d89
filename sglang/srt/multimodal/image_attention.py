"""Prefill attention in which the tokens of one image attend to each other in both directions (Gemma 3).

Text stays causal; a query inside an image also sees the later tokens of the same image. Sliding-window layers
keep their window on top: a key is attended when (causal or same image) and key > query - window, as
transformers composes Gemma 3's masks. Decode steps are plain causal (the new token is text) and go to the
wrapped backend unchanged.

The mask holds exactly when the whole image runs in one extend, or when its start was computed in an earlier
forward that also saw its end (a prefix-cache hit). When a chunked prefill cuts an image in two, the tokens of
the first chunk were computed without the later ones; that part then differs from a single prefill.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers.attention.base import AttentionBackend, AttentionLayerSpec
from sglang.srt.layers.attention.masked import attend, extend_mask
from sglang.srt.layers.attention.torch_sdpa_backend import store_kv


def image_block_mask(prefix_len: int, extend_len: int, spans: list[tuple[int, int]], window: int,
                     device: torch.device) -> torch.Tensor:
    """[extend_len, prefix_len + extend_len] True where query j (position prefix_len + j) sees a key."""
    mask = extend_mask(prefix_len, extend_len, 0, device)
    query_positions = torch.arange(prefix_len, prefix_len + extend_len, device=device)[:, None]
    key_positions = torch.arange(prefix_len + extend_len, device=device)[None, :]
    for start, end in spans:
        in_query = (query_positions >= start) & (query_positions < end)
        in_key = (key_positions >= start) & (key_positions < end)
        mask |= in_query & in_key
    if window > 0:
        mask &= key_positions > query_positions - window
    return mask


class ImageBlockAttention(AttentionBackend):
    """Wraps the forward's backend for an extend whose sequences hold image spans (`spans[i]`: the [start, end)
    positions of the images sequence i extends)."""

    def __init__(self, inner: AttentionBackend, spans: list[list[tuple[int, int]]]) -> None:
        self.inner = inner
        self.spans = spans
        # (sequence, window) -> mask; every layer of one kind shares it
        self._masks: dict[tuple[int, int], torch.Tensor] = {}

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self.inner.init_forward_metadata(forward_batch)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, forward_batch: ForwardBatch,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return self.inner.forward_decode(q, k, v, layer, forward_batch, sinks)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, forward_batch: ForwardBatch,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        # Every new row is stored first: an image token reads the K/V of the later tokens of its image.
        store_kv(pool, layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_cache, v_cache = pool.get_kv_buffer(layer.layer_id)
        table = forward_batch.req_to_token_pool.req_to_token
        out = q.new_empty(q.shape[0], layer.num_heads, v_cache.shape[-1])
        start = 0
        for i, (prefix_len, extend_len) in enumerate(
            zip(forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu)
        ):
            seq_len = prefix_len + extend_len
            kv_indices = table[int(forward_batch.req_pool_indices[i]), :seq_len].to(q.device)
            key = (i, layer.window)
            if key not in self._masks:
                self._masks[key] = image_block_mask(prefix_len, extend_len, self.spans[i], layer.window, q.device)
            queries = q[start : start + extend_len].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            keys = k_cache.index_select(0, kv_indices).transpose(0, 1).unsqueeze(0).to(q.dtype)
            values = v_cache.index_select(0, kv_indices).transpose(0, 1).unsqueeze(0).to(q.dtype)
            seq_out = attend(queries, keys, values, self._masks[key], layer.scaling, layer.logit_softcap, sinks)
            out[start : start + extend_len] = seq_out[0].transpose(0, 1)
            start += extend_len
        return out.reshape(q.shape[0], -1)
