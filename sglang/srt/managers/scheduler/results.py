"""Turning a forward's samples into request state: appended tokens, logprobs, finish checks, streaming."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.scheduler.grammar import accept_sampled_token, jump_forward_tokens
from sglang.srt.managers.scheduler.output import check_finished, record_input_logprobs, record_output_logprob
from sglang.srt.model_executor.model_runner import StepOutput

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler.loop import Scheduler


def process_result(sched: Scheduler, batch: ScheduleBatch, result: StepOutput) -> list[Req]:
    sched.forward_ct += 1
    sampled = result.sample.next_token_ids.tolist() if result.sample is not None else []
    sample_idx = 0
    logit_row = 0
    outputs: list[Req] = []
    now = time.monotonic()
    for i, req in enumerate(batch.reqs):
        rows = batch.logit_positions[i]
        sample_pos = batch.sample_row[i]
        if not batch.is_decode:
            req.kv_committed_len = len(req.fill_ids)
            n_input_rows = len(rows) - (1 if sample_pos is not None else 0)
            if req.return_logprob and not req.output_ids and result.input_logprobs is not None:
                first = max(batch.prefix_lens[i], req.input_logprob_start())
                record_input_logprobs(
                    req, result.input_logprobs, list(range(logit_row, logit_row + n_input_rows)), first
                )
            elif req.return_logprob and not req.output_ids and req.logprobs.input_token_idx == []:
                record_input_logprobs(req, torch.empty(0), [], 0)
            # The computed prompt goes into the prefix cache now, not when the request finishes, so that
            # requests admitted while this one decodes can share it.
            sched.mem.tree_cache.cache_unfinished_req(req)
            if req.is_chunked:
                logit_row += len(rows)
                continue
        else:
            req.kv_committed_len = req.seqlen
        logit_row += len(rows)
        token = sampled[sample_idx]
        row_in_sample = sample_idx
        sample_idx += 1
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
            outputs.append(req)
        else:
            if not batch.is_decode:
                sched.running.append(req)
            if jumped:
                requeue_for_prefill(sched, req)
            if req.stream and len(req.output_ids) - req.sent_output_len >= stream_interval(sched, req):
                outputs.append(req)
    if batch.is_decode:
        sched._maybe_log_decode()
    return outputs


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
