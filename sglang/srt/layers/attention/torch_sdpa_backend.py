"""Attention over the paged KV cache with torch's scaled_dot_product_attention (CPU and CUDA alike).

Decode is batched. On CPU a compiled kernel reads each sequence's K/V rows from the pool by slot index (see
sglang/srt/layers/cpu_ops.py); otherwise the KV slots of all sequences are gathered into one padded
[B, Hkv, max_len, D] tensor and a key mask hides the padding, so every layer runs a single SDPA call. Extend
(prefill) on CPU likewise runs one compiled kernel call per layer for all sequences, causal from each sequence's
cached prefix on; otherwise one SDPA call per sequence with a causal mask shifted by the cached prefix.

A layer with a sliding window passes it to the compiled kernels; on the torch path its masks also hide the keys
before the window (attention/masked.py). With hybrid sliding-window memory (mem_cache/swa_pool.py) such a layer's
K/V live in the window pool: its metadata is a second copy whose slot indices (rows and the new tokens' slots) are
translated to window slots once per forward, and every path reads and writes through them.

A layer with logit soft-capping or attention sinks always takes the torch path, which computes
them as transformers' eager attention does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers import cpu_ops
from sglang.srt.layers.attention.base import AttentionBackend, AttentionLayerSpec
from sglang.srt.layers.attention.masked import attend, decode_key_mask, extend_mask
from sglang.srt.mem_cache.kv_dtype import KERNEL_KV_DTYPES
from sglang.srt.mem_cache.kv_pool import KVPool
from sglang.srt.mem_cache.swa_pool import SWAKVPool


@dataclass
class DecodeMetadata:
    # [B, max_len] KV slots per sequence; padding points at the dummy slot 0.
    kv_indices: torch.Tensor
    # [B, 1, 1, max_len] True where a key is attended; None when all sequences have the same length.
    key_mask: Optional[torch.Tensor]
    # Run the compiled CPU kernel (which needs no mask and no gather) instead of SDPA.
    use_kernel: bool = False
    # The new tokens' slots in this metadata's buffers when they are not forward_batch.out_cache_loc (window slots)
    out_cache_loc: Optional[torch.Tensor] = None
    # The same metadata in window slots, for the sliding-window layers of a hybrid pool
    window: Optional[DecodeMetadata] = None


@dataclass
class ExtendSequence:
    token_start: int
    token_end: int
    # [seq_len] KV slots of the sequence: the cached prefix followed by the new tokens.
    kv_indices: torch.Tensor
    # [extend_len, seq_len] True where attended; None when plain causal (no prefix) or a single query row.
    mask: Optional[torch.Tensor]
    is_causal: bool


@dataclass
class ExtendKernelArgs:
    """What the compiled CPU extend kernel takes for the whole batch (cpu_ops.extend_attention)."""

    kv_rows: torch.Tensor  # [N, max seq_len] KV slots of each sequence
    token_starts: torch.Tensor  # [N] first query row of each sequence
    extend_lens: torch.Tensor  # [N]
    prefix_lens: torch.Tensor  # [N]


@dataclass
class ExtendMetadata:
    # One SDPA call per sequence; None until a layer needs them (where the kernel is set).
    sequences: Optional[list[ExtendSequence]]
    # Set on CPU when the compiled kernels are built: one kernel call per layer instead of one SDPA per sequence.
    kernel: Optional[ExtendKernelArgs]
    out_cache_loc: Optional[torch.Tensor] = None  # as DecodeMetadata's
    window: Optional[ExtendMetadata] = None


def store_kv(pool: KVPool, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write a layer's new K/V rows [T, Hkv, D] at slots `loc`: on CPU one compiled pass that converts to the
    pool's dtype as it scatters (the same bytes as KVPool.set_kv_buffer, which runs otherwise)."""
    k_cache, v_cache = pool.get_kv_buffer(layer_id)
    # A latent pool (mem_cache/mla_kv_pool.py) keys and values with one buffer: its own store writes it once.
    if (k_cache is not v_cache and k_cache.device.type == "cpu" and k_cache.dtype in KERNEL_KV_DTYPES
            and k.dtype == v.dtype == torch.float32
            and k.shape == v.shape and k_cache.shape[1:] == v_cache.shape[1:] == k.shape[1:]
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
            and loc.dtype == torch.int64 and loc.is_contiguous() and cpu_ops.available()):
        cpu_ops.store_kv(k_cache, v_cache, loc, k, v)
    else:
        pool.set_kv_buffer(layer_id, loc, k, v)


class TorchSDPABackend(AttentionBackend):
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        pool = forward_batch.token_to_kv_pool
        window_slots = pool.window_slots if isinstance(pool, SWAKVPool) else None
        meta: DecodeMetadata | ExtendMetadata
        if forward_batch.forward_mode.is_decode():
            meta = self._decode_metadata(forward_batch)
            if window_slots is not None:
                meta.window = DecodeMetadata(window_slots(meta.kv_indices), meta.key_mask, meta.use_kernel,
                                             window_slots(forward_batch.out_cache_loc))
        else:
            kv_rows = self._kv_index_rows(forward_batch, max(forward_batch.seq_lens_cpu))
            meta = self._extend_metadata(forward_batch, kv_rows)
            if window_slots is not None:
                meta.window = self._extend_metadata(forward_batch, window_slots(kv_rows))
                meta.window.out_cache_loc = window_slots(forward_batch.out_cache_loc)
        forward_batch.attn_metadata = meta

    @staticmethod
    def _layer_metadata(forward_batch: ForwardBatch, layer: AttentionLayerSpec) -> tuple[Any, torch.Tensor]:
        """The metadata addressing this layer's buffers, and the new tokens' slots in them."""
        meta = forward_batch.attn_metadata
        pool = forward_batch.token_to_kv_pool
        if meta.window is not None and isinstance(pool, SWAKVPool) and pool.is_windowed(layer.layer_id):
            meta = meta.window
        return meta, forward_batch.out_cache_loc if meta.out_cache_loc is None else meta.out_cache_loc

    # ---- metadata --------------------------------------------------------------------------------------
    @staticmethod
    def _kv_index_rows(forward_batch: ForwardBatch, max_len: int) -> torch.Tensor:
        table = forward_batch.req_to_token_pool.req_to_token
        return table[forward_batch.req_pool_indices, :max_len]

    def _decode_metadata(self, forward_batch: ForwardBatch) -> DecodeMetadata:
        seq_lens = forward_batch.seq_lens_cpu
        max_len = max(seq_lens)
        kv_indices = self._kv_index_rows(forward_batch, max_len)
        if kv_indices.device.type == "cpu" and cpu_ops.available():
            return DecodeMetadata(kv_indices, None, use_kernel=True)
        if min(seq_lens) == max_len:
            return DecodeMetadata(kv_indices, None)
        device = kv_indices.device
        key_positions = torch.arange(max_len, device=device)
        lens = forward_batch.seq_lens.to(device)
        valid = key_positions[None, :] < lens[:, None]
        # Stale table entries past a sequence's end are redirected to the dummy slot so they are always in range.
        kv_indices = torch.where(valid, kv_indices, torch.zeros_like(kv_indices))
        return DecodeMetadata(kv_indices, valid[:, None, None, :])

    def _extend_metadata(self, forward_batch: ForwardBatch, kv_rows: torch.Tensor) -> ExtendMetadata:
        if kv_rows.device.type == "cpu" and cpu_ops.available():
            prefix_lens = torch.tensor(forward_batch.extend_prefix_lens_cpu, dtype=torch.int64)
            extend_lens = torch.tensor(forward_batch.extend_seq_lens_cpu, dtype=torch.int64)
            token_starts = torch.cumsum(extend_lens, 0) - extend_lens
            kernel = ExtendKernelArgs(kv_rows.to(torch.int64), token_starts, extend_lens, prefix_lens)
            # the per-sequence SDPA inputs are built only if a layer cannot use the kernel (a bf16 model)
            return ExtendMetadata(None, kernel)
        return ExtendMetadata(self._extend_sequences(forward_batch, kv_rows), None)

    @staticmethod
    def _extend_sequences(forward_batch: ForwardBatch, kv_rows: torch.Tensor) -> list[ExtendSequence]:
        device = kv_rows.device
        sequences: list[ExtendSequence] = []
        start = 0
        for i, (prefix_len, extend_len) in enumerate(
            zip(forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu)
        ):
            seq_len = prefix_len + extend_len
            mask = None
            if prefix_len > 0 and extend_len > 1:
                # Query j sits at position prefix_len + j and sees keys 0 .. prefix_len + j.
                query_positions = torch.arange(prefix_len, seq_len, device=device)
                key_positions = torch.arange(seq_len, device=device)
                mask = key_positions[None, :] <= query_positions[:, None]
            is_causal = prefix_len == 0 and extend_len > 1
            sequences.append(ExtendSequence(start, start + extend_len, kv_rows[i, :seq_len], mask, is_causal))
            start += extend_len
        return sequences

    # ---- attention -------------------------------------------------------------------------------------
    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, forward_batch: ForwardBatch,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        meta, loc = self._layer_metadata(forward_batch, layer)
        store_kv(pool, layer.layer_id, loc, k, v)
        k_cache, v_cache = pool.get_kv_buffer(layer.layer_id)
        if (meta.use_kernel and layer.logit_softcap is None and sinks is None and q.dtype == torch.float32
                and k_cache.dtype in KERNEL_KV_DTYPES):
            out = cpu_ops.paged_decode_attention(
                q, k_cache, v_cache, meta.kv_indices, forward_batch.seq_lens, layer.scaling, layer.window
            )
            return out.reshape(q.shape[0], -1)
        batch, max_len = meta.kv_indices.shape
        queries = q.unsqueeze(2)  # [B, H, 1, D]
        if layer.window or layer.logit_softcap is not None or sinks is not None:
            visible = decode_key_mask(forward_batch.seq_lens.to(meta.kv_indices.device), max_len, layer.window)
            # slots outside a sequence (stale table entries) read the dummy slot, always in range
            kv_indices = torch.where(visible, meta.kv_indices, torch.zeros_like(meta.kv_indices))
            keys, values = _gather(k_cache, v_cache, kv_indices, queries.dtype)
            out = attend(queries, keys, values, visible[:, None, None, :], layer.scaling, layer.logit_softcap, sinks)
            return out.reshape(batch, -1)
        keys, values = _gather(k_cache, v_cache, meta.kv_indices, queries.dtype)
        out = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=meta.key_mask,
            scale=layer.scaling,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )
        return out.reshape(batch, -1)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, forward_batch: ForwardBatch,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        meta, loc = self._layer_metadata(forward_batch, layer)
        store_kv(pool, layer.layer_id, loc, k, v)
        k_cache, v_cache = pool.get_kv_buffer(layer.layer_id)
        num_tokens = q.shape[0]
        if (meta.kernel is not None and layer.logit_softcap is None and sinks is None and q.dtype == torch.float32
                and k_cache.dtype in KERNEL_KV_DTYPES):
            args = meta.kernel
            out = cpu_ops.extend_attention(q, k_cache, v_cache, args.kv_rows, args.token_starts, args.extend_lens,
                                           args.prefix_lens, layer.scaling, layer.window)
            return out.reshape(num_tokens, -1)
        if meta.sequences is None:
            assert meta.kernel is not None  # the sequences are left unbuilt only beside the kernel's arguments
            meta.sequences = self._extend_sequences(forward_batch, meta.kernel.kv_rows)
        out = q.new_empty(num_tokens, layer.num_heads, v_cache.shape[-1])
        enable_gqa = layer.num_heads != layer.num_kv_heads
        masked = bool(layer.window) or layer.logit_softcap is not None or sinks is not None
        for seq in meta.sequences:
            queries = q[seq.token_start : seq.token_end].transpose(0, 1)  # [H, n, D]
            keys = k_cache.index_select(0, seq.kv_indices).transpose(0, 1)  # [Hkv, L, D]
            values = v_cache.index_select(0, seq.kv_indices).transpose(0, 1)
            if keys.dtype != queries.dtype:
                keys, values = keys.to(queries.dtype), values.to(queries.dtype)
            if masked:
                extend_len = seq.token_end - seq.token_start
                mask = extend_mask(seq.kv_indices.shape[0] - extend_len, extend_len, layer.window, q.device)
                seq_out = attend(queries.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), mask, layer.scaling,
                                 layer.logit_softcap, sinks)
                out[seq.token_start : seq.token_end] = seq_out[0].transpose(0, 1)
                continue
            seq_out = F.scaled_dot_product_attention(
                queries.unsqueeze(0),
                keys.unsqueeze(0),
                values.unsqueeze(0),
                attn_mask=seq.mask,
                is_causal=seq.is_causal,
                scale=layer.scaling,
                enable_gqa=enable_gqa,
            )
            out[seq.token_start : seq.token_end] = seq_out[0].transpose(0, 1)
        return out.reshape(num_tokens, -1)


def _gather(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indices: torch.Tensor, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V rows of kv_indices [B, L] as [B, Hkv, L, D] tensors of `dtype`."""
    batch, max_len = kv_indices.shape
    # index_select on the flat slot list is several times faster on CPU than 2-D advanced indexing.
    flat_indices = kv_indices.view(-1)
    keys = k_cache.index_select(0, flat_indices).view(batch, max_len, *k_cache.shape[1:]).transpose(1, 2)
    values = v_cache.index_select(0, flat_indices).view(batch, max_len, *v_cache.shape[1:]).transpose(1, 2)
    if keys.dtype != dtype:
        keys, values = keys.to(dtype), values.to(dtype)
    return keys, values
