"""Admission of waiting requests into a prefill batch under token budgets."""

from __future__ import annotations

from typing import Optional

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.memory_pools import MemoryPools

# Decode tokens reserved per running request are capped so a huge max_new_tokens does not block admission.
MAX_RESERVED_DECODE_TOKENS = 4096


def reserved_decode_tokens(req: Req, new_token_ratio: float) -> int:
    remaining = req.sampling_params.max_new_tokens - len(req.output_ids)
    return int(max(0, min(remaining, MAX_RESERVED_DECODE_TOKENS)) * new_token_ratio)


class PrefillAdder:
    def __init__(
        self,
        mem: MemoryPools,
        running: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: Optional[int],
        max_running_requests: int,
    ) -> None:
        self.mem = mem
        self.new_token_ratio = new_token_ratio
        self.reserved = sum(reserved_decode_tokens(r, new_token_ratio) for r in running)
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens = chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else None
        self.free_running_slots = max_running_requests - len(running)
        self.free_rows = mem.req_to_token_pool.available_size()
        self.selected: list[Req] = []
        self.new_chunked_req: Optional[Req] = None
        self.admitted_tokens = 0

    def _budget(self) -> int:
        return self.mem.available_tokens() - self.reserved - self.admitted_tokens

    def add_chunked(self, req: Req) -> bool:
        """Continue a request whose prompt was split into chunks; it always goes first."""
        req.init_next_round_input()
        budget = self._budget()
        if budget <= 0:
            return False
        self.free_running_slots -= 1
        self._take(req, req.kv_committed_len, cap=budget)
        return True

    def add(self, req: Req) -> bool:
        """Try to admit `req` (its prefix already matched). False means stop admitting."""
        if self.new_chunked_req is not None or self.free_running_slots <= 0 or self.free_rows <= 0:
            return False
        prefix_len = len(req.prefix_indices)
        ext = len(req.fill_ids) - prefix_len
        if self.selected and ext > self.rem_input_tokens:
            return False
        self.mem.tree_cache.inc_lock_ref(req.last_node)
        first_chunk = ext if self.rem_chunk_tokens is None else min(ext, self.rem_chunk_tokens)
        need = first_chunk + (reserved_decode_tokens(req, self.new_token_ratio) if first_chunk == ext else 0)
        if need > self._budget() or first_chunk <= 0:
            self.mem.tree_cache.dec_lock_ref(req.last_node)
            return False
        self.free_running_slots -= 1
        self.free_rows -= 1
        self._take(req, prefix_len)
        return self.new_chunked_req is None

    def _take(self, req: Req, prefix_len: int, cap: Optional[int] = None) -> None:
        ext = len(req.fill_ids) - prefix_len
        limit = self.rem_chunk_tokens
        if cap is not None:
            limit = cap if limit is None else min(limit, cap)
        if limit is not None and ext > limit:
            ext = limit
            req.fill_ids = req.fill_ids[: prefix_len + ext]
            req.is_chunked = True
            self.new_chunked_req = req
        else:
            req.is_chunked = False
            self.admitted_tokens += reserved_decode_tokens(req, self.new_token_ratio)
        self.admitted_tokens += ext
        self.rem_input_tokens -= ext
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= ext
        self.selected.append(req)
