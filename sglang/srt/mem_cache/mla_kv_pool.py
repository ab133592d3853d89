"""The KV pool of multi-head latent attention (DeepSeek-V2/V3): one compressed row per token and layer.

MLA caches no per-head K/V. Each token keeps its normed KV latent (`kv_lora_rank` channels) and its rotated key
part shared by every head (`qk_rope_head_dim` channels), one "head" of `kv_lora_rank + qk_rope_head_dim` channels;
attention expands nothing from it (layers/attention/mla.py attends over the latent with absorbed projections). The
same buffer serves as keys and as values (the values are its first `kv_lora_rank` channels), so `get_kv_buffer`
returns it twice and a store writes it once: the pool holds half of what a K/V pair of that width would, and a
small fraction of what the expanded heads would (DeepSeek-V2-Lite: 576 channels per token and layer instead of
16 heads x (192 + 128)).
"""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.kv_dtype import to_kv_dtype
from sglang.srt.mem_cache.kv_pool import KVPool


class MLAKVPool(KVPool):
    """`[size + 1, 1, latent_dim]` per layer (latent_dim = kv_lora_rank + qk_rope_head_dim), slot 0 the dummy."""

    def __init__(self, size: int, num_layers: int, latent_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        # Not KVPool.__init__: it would allocate a second (value) buffer per layer.
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = 1
        self.head_dim = latent_dim
        self.v_head_dim = latent_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # One head: head-major and slot-major storage are the same layout.
        self.head_major = False
        self.k_buffer = [self._buffer(size, 1, latent_dim) for _ in range(num_layers)]
        self.v_buffer = self.k_buffer

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """One latent row per layer (no separate values)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * num_kv_heads * head_dim * itemsize

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the latent rows k [num_tokens, 1, latent_dim] (v is the same tensor: the values are part of it)."""
        if v is not k:
            raise ValueError("the latent pool stores one row per token: pass the latent as both k and v")
        self.k_buffer[layer_id][loc] = to_kv_dtype(k, self.dtype)
