"""What the scheduler reports about itself: the memory invariant, its state for /get_server_info and metrics,
and the prefill / decode log lines. Functions of the Scheduler (`self`), kept apart from its loop."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from sglang.srt.managers.io_struct import SchedulerState
from sglang.srt.managers.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler.loop import Scheduler

logger = logging.getLogger(__name__)


def check_memory(self: Scheduler) -> None:
    """When idle, every slot is either free or held by the prefix cache, and nothing is locked."""
    free = self.mem.full_available()
    cached = self.mem.tree_cache.total_size()
    protected = self.mem.tree_cache.protected_size()
    rows_free = self.mem.req_to_token_pool.available_size()
    rows_total = self.max_running_requests + 1
    if free + cached != self.max_total_num_tokens or protected != 0 or rows_free != rows_total:
        self.invariant_error = (
            f"memory leak: free={free} cached={cached} protected={protected} "
            f"total={self.max_total_num_tokens} free_rows={rows_free}/{rows_total}"
        )
        logger.error(self.invariant_error)
    window_error = self.mem.idle_window_error()
    if window_error is not None:
        self.invariant_error = window_error
        logger.error(window_error)
    draft_error = self.speculator.idle_error() if self.speculator is not None else None
    if draft_error is not None:
        self.invariant_error = draft_error
        logger.error(draft_error)

def token_usage(self: Scheduler) -> float:
    used = self.max_total_num_tokens - self.mem.available_tokens()
    return used / self.max_total_num_tokens

def internal_state(self: Scheduler) -> SchedulerState:
    if self.is_idle():
        check_memory(self)
    used = self.max_total_num_tokens - self.mem.available_tokens()
    return SchedulerState(
        info=self.info(),
        last_gen_throughput=self.last_gen_throughput,
        num_running_reqs=len(self.running) + (self.chunked_req is not None),
        num_queue_reqs=len(self.waiting) + len(self.grammar_queue),
        num_grammar_queue_reqs=len(self.grammar_queue),
        num_jump_forward_tokens=self.num_jump_forward_tokens,
        token_usage=token_usage(self),
        used_kv_tokens=used,
        cache_hit_rate=self.total_cached_tokens / max(1, self.total_prompt_tokens),
        evictable_size=self.mem.tree_cache.evictable_size(),
        free_kv_tokens=self.mem.allocator.available_size(),
        free_window_kv_tokens=self.mem.window_available(),
        invariant_error=self.invariant_error,
        load=used + sum(len(r.origin_input_ids) for r in self.waiting),
        spec_accept_length=self.speculator.accept_length if self.speculator is not None else 0.0,
        spec_draft_used_kv_tokens=self.speculator.draft_used_tokens() if self.speculator is not None else 0,
    )

def log_prefill(self: Scheduler, batch: ScheduleBatch, cached: int) -> None:
    logger.info(
        "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
        "#running-req: %d, #queue-req: %d",
        len(batch), sum(batch.extend_lens), cached, token_usage(self), len(self.running), len(self.waiting),
    )

def maybe_log_decode(self: Scheduler) -> None:
    if self.forward_ct % self.args.decode_log_interval != 0:
        return
    now = time.monotonic()
    self.last_gen_throughput = self.num_generated_tokens / max(now - self.last_log_time, 1e-6)
    self.last_log_time, self.num_generated_tokens = now, 0
    spec = "" if self.speculator is None else f", accept len: {self.speculator.take_accept_length():.2f}"
    logger.info(
        "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
        "#queue-req: %d%s",
        len(self.running), self.max_total_num_tokens - self.mem.available_tokens(), token_usage(self),
        self.last_gen_throughput, len(self.waiting), spec,
    )
