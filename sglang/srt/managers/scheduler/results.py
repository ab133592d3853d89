"""Turning a forward's samples into request state: appended tokens, logprobs, finish checks, streaming."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.managers.finish_reason import FinishAbort, bad_request
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.scheduler.grammar import accept_sampled_token, jump_forward_tokens
from sglang.srt.managers.scheduler.output import check_finished, record_input_logprobs, record_output_logprob
from sglang.srt.managers.scheduler.stats import maybe_log_decode
from sglang.srt.model_executor.model_runner import StepOutput

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler.loop import Scheduler

logger = logging.getLogger(__name__)


def process_result(sched: Scheduler, batch: ScheduleBatch, result: StepOutput) -> list[Req]:
    """Apply one forward's samples to every request of `batch`; the requests to report (finished or streaming).

    An exception while handling one request aborts that request alone (its client gets a 500) and the others
    carry on."""
    if batch.spec_verify is not None:
        return sched.speculator.process_verify(sched, batch, result)
    sched.forward_ct += 1
    sampled = result.sample.next_token_ids.tolist() if result.sample is not None else []
    sample_idx = 0
    logit_row = 0
    outputs: list[Req] = []
    now = time.monotonic()
    for i, req in enumerate(batch.reqs):
        first_row = logit_row
        logit_row += len(batch.logit_positions[i])
        # A prompt chunk that does not end its prompt samples nothing.
        row_in_sample = None if not batch.is_decode and req.is_chunked else sample_idx
        if row_in_sample is not None:
            sample_idx += 1
        try:
            inject_fault(req)
            report = _process_req(sched, batch, i, req, result, first_row, row_in_sample, sampled, now)
        except Exception as e:  # noqa: BLE001 - isolate the failure to this request
            report = fail_request(sched, req, e)
        if report:
            outputs.append(req)
    if batch.is_decode:
        if sched.speculator is not None:
            sched.speculator.on_plain_decode(batch)
        maybe_log_decode(sched)
    return outputs


def _process_req(sched: Scheduler, batch: ScheduleBatch, i: int, req: Req, result: StepOutput, first_row: int,
                 row_in_sample: Optional[int], sampled: list[int], now: float) -> bool:
    if not batch.is_decode:
        rows = batch.logit_positions[i]
        req.kv_committed_len = len(req.fill_ids)
        n_input_rows = len(rows) - (1 if batch.sample_row[i] is not None else 0)
        if req.return_logprob and not req.output_ids and result.input_logprobs is not None:
            first = max(batch.prefix_lens[i], req.input_logprob_start())
            record_input_logprobs(
                req, result.input_logprobs, list(range(first_row, first_row + n_input_rows)), first
            )
        elif req.return_logprob and not req.output_ids and req.logprobs.input_token_idx == []:
            record_input_logprobs(req, torch.empty(0), [], 0)
        # The computed prompt goes into the prefix cache now, not when the request finishes, so that
        # requests admitted while this one decodes can share it.
        sched.mem.tree_cache.cache_unfinished_req(req)
        if row_in_sample is None:
            return False
    else:
        req.kv_committed_len = req.seqlen
    assert row_in_sample is not None
    token = sampled[row_in_sample]
    failed = result.sample.failed_rows if result.sample is not None else None
    if failed and row_in_sample in failed and req.to_abort is None:
        req.to_abort = bad_request(failed[row_in_sample])  # its processor raised: the token is not used
    if req.sampling_params.max_new_tokens > 0 and req.to_abort is None:
        req.output_ids.append(token)
        sched.num_generated_tokens += 1
        if req.return_logprob:
            record_output_logprob(req, result.sample, row_in_sample, token)
        if req.first_token_time is None:
            req.first_token_time = now
        req.last_token_time = now
        accept_sampled_token(req, token)
    check_finished(req, sched.tokenizer)
    jumped = False
    if not req.finished() and sched.enable_jump_forward and req.grammar is not None and not req.return_logprob:
        jumped = jump_forward(sched, req)
    if req.finished():
        if req in sched.running:
            sched.running.remove(req)
        sched.release(req)
        return True
    if not batch.is_decode:
        sched.running.append(req)
    if jumped:
        requeue_for_prefill(sched, req)
    return req.stream and len(req.output_ids) - req.sent_output_len >= stream_interval(sched, req)


def fail_request(sched: Scheduler, req: Req, error: BaseException) -> bool:
    """End `req` with an internal-error abort (HTTP 500 for its client) and free what it holds; True (report it).
    Only the KV computed before the failing step is kept for the prefix cache (see cache_finished_req)."""
    logger.error("Request %s failed in the scheduler; aborting it", req.rid, exc_info=error)
    req.finished_reason = FinishAbort(f"Internal server error while running the request: "
                                      f"{type(error).__name__}: {error}", status_code=500,
                                      err_type="InternalServerError")
    if req in sched.running:
        sched.running.remove(req)
    if sched.chunked_req is req:
        sched.chunked_req = None
    sched.release(req)
    return True


def fail_batch(sched: Scheduler, batch: ScheduleBatch, error: BaseException) -> list[Req]:
    """The forward of `batch` raised: every request in it ends with an internal error; the server carries on."""
    sched.forward_ct += 1
    if batch.spec_verify is not None:
        batch.spec_verify.release(sched.mem)  # the spare KV slots and rows its draft trees were lent
    return [req for req in batch.reqs if fail_request(sched, req, error)]


def inject_fault(req: Req) -> None:
    """Testing aid: a request whose id starts with $SGLANG_TEST_FAULT_RID_PREFIX fails here, so tests can show
    that one failing request does not take the others down."""
    prefix = _FAULT_PREFIX
    if prefix and req.rid.startswith(prefix):
        raise RuntimeError(f"fault injected for request {req.rid}")


_FAULT_PREFIX = os.environ.get("SGLANG_TEST_FAULT_RID_PREFIX", "")


def stream_interval(sched: Scheduler, req: Req) -> int:
    return req.sampling_params.stream_interval or sched.args.stream_interval


def jump_forward(sched: Scheduler, req: Req) -> bool:
    """Append the tokens the grammar forces (jump-forward decoding). True when any were appended: the
    request then computes their KV in one extend instead of one decode step per token."""
    tokens = jump_forward_tokens(req, sched.tokenizer)
    if not tokens:
        return False
    req.output_ids.extend(tokens)
    sched.num_jump_forward_tokens += len(tokens)
    check_finished(req, sched.tokenizer)
    return True


def requeue_for_prefill(sched: Scheduler, req: Req) -> None:
    """Hand the request's KV to the prefix cache and put it first in the queue; its next prefill matches
    everything computed so far and extends only the new tokens."""
    sched.running.remove(req)
    req.already_computed = req.kv_committed_len  # so the re-prefill does not count as cache hits
    sched.release(req)
    req.reset_for_reprefill()
    sched.waiting.insert(0, req)
