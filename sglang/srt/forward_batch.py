"""The tensors of one model forward.

`ForwardBatch` sits below layers, models and the runner: they all import it, it imports none of them.
A forward is always an *extend*: every sequence has `prefix_len` tokens whose K/V already sit in the
pool and `extend_len` new tokens to run. Decode is the special case `extend_len == 1` for every
sequence, flagged as `ForwardMode.DECODE` so backends can take a cheaper path.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from sglang.srt.mem_cache.kv_pool import KVPool
    from sglang.srt.mem_cache.req_to_token import ReqToTokenPool


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    # [num_tokens] flat token ids and positions of the tokens to run (extend parts concatenated).
    input_ids: torch.Tensor
    positions: torch.Tensor
    # [batch_size] rows of the request->token table.
    req_pool_indices: torch.Tensor
    # [batch_size] total length (prefix + extend) of each sequence after this forward.
    seq_lens: torch.Tensor
    # [num_tokens] KV slots that receive the K/V of the new tokens.
    out_cache_loc: torch.Tensor
    # Python copies of the lengths, used to build metadata without device syncs.
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: KVPool
    attn_backend: Any = None
    # Indices into the flat token dimension whose hidden states become logits.
    # None means the last token of each sequence.
    logits_indices: Optional[torch.Tensor] = None
    # Whether the runner returns log-softmax of every logits row (some request asked for input logprobs).
    return_input_logprobs: bool = False
    # Backend-specific metadata, filled by attn_backend.init_forward_metadata().
    attn_metadata: Any = None
    # [num_tokens] segment ids of encoder inputs (BERT sentence pairs); None means all zeros.
    token_type_ids: Optional[torch.Tensor] = None
    # Image embeddings and M-RoPE positions for vision-language models (multimodal/forward_inputs.py).
    multimodal: Any = None
    # Some rows are later positions of the same sequence as earlier rows (a speculative verify step): each row's
    # attention must see the K/V the earlier rows store in the same layer. The attention backend stores every row
    # before attending; the fused CPU decode step stores per attention item, so it runs such a batch on one thread.
    rows_share_sequences: bool = False
    # [batch_size] the LoRA adapter of each sequence (None: the base model); None when no sequence uses one.
    lora_ids: Optional[list[Optional[str]]] = None

    def last_token_indices(self) -> torch.Tensor:
        ends = torch.tensor(self.extend_seq_lens_cpu, dtype=torch.int64).cumsum(0) - 1
        return ends.to(self.input_ids.device)


def build_positions(prefix_lens: list[int], extend_lens: list[int], device: torch.device) -> torch.Tensor:
    """Positions prefix_len .. prefix_len+extend_len-1 for each sequence, concatenated."""
    if all(n == 1 for n in extend_lens):
        return torch.tensor(prefix_lens, dtype=torch.int64, device=device)
    parts = [torch.arange(p, p + n, dtype=torch.int64) for p, n in zip(prefix_lens, extend_lens)]
    return torch.cat(parts).to(device)
