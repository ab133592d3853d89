"""Turning a step's samples into request state: appended tokens, logprobs, finish checks, outgoing messages."""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.managers.finish_reason import FinishLength, FinishMatched
from sglang.srt.managers.io_struct import BatchTokenIDOutput
from sglang.srt.managers.schedule_batch import Req


def check_finished(req: Req, tokenizer) -> None:
    """Finish conditions in contract order: abort, length, grammar terminated, stop token, stop string."""
    if req.finished():
        return
    if req.to_abort is not None:
        req.finished_reason = req.to_abort
        return
    params = req.sampling_params
    if len(req.output_ids) >= params.max_new_tokens:
        req.finished_reason = FinishLength(params.max_new_tokens)
        return
    last = req.output_ids[-1] if req.output_ids else None
    if last is None:
        return
    if req.grammar is not None and req.grammar.is_terminated():
        req.finished_reason = FinishMatched(last)
        return
    if not params.ignore_eos and last in req.stop_token_ids:
        req.finished_reason = FinishMatched(last)
        return
    if params.stop and tokenizer is not None:
        tail_len = params.stop_str_max_len + 2
        tail = tokenizer.decode(req.output_ids[-tail_len:])
        for stop in params.stop:
            if stop and stop in tail:
                req.finished_reason = FinishMatched(stop)
                return


def record_input_logprobs(req: Req, logprobs: torch.Tensor, rows: list[int], first_pos: int) -> None:
    """rows[i] holds logits at prompt position first_pos + i, scoring prompt token first_pos + i + 1."""
    state = req.logprobs
    if not state.input_token_idx:
        start = req.input_logprob_start()
        state.input_token_val.append(None)
        state.input_token_idx.append(req.origin_input_ids[start])
        state.input_top.append(None)
        state.input_ids_logprobs.append(None)
    if not rows:
        return
    next_ids = req.origin_input_ids[first_pos + 1 : first_pos + 1 + len(rows)]
    lp = logprobs[rows]
    ids = torch.tensor(next_ids, dtype=torch.int64)
    vals = lp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    state.input_token_val.extend(vals)
    state.input_token_idx.extend(next_ids)
    k = req.top_logprobs_num
    if k > 0:
        top_v, top_i = lp.topk(k, dim=-1)
        state.input_top.extend(zip(top_v.tolist(), top_i.tolist()))
    else:
        state.input_top.extend([None] * len(rows))
    if req.token_ids_logprob:
        wanted = torch.tensor(req.token_ids_logprob, dtype=torch.int64)
        state.input_ids_logprobs.extend(lp[:, wanted].tolist())
    else:
        state.input_ids_logprobs.extend([None] * len(rows))


def record_output_logprob(req: Req, sample, row: int, token_id: int) -> None:
    state = req.logprobs
    state.output_token_val.append(float(sample.next_token_logprobs[row]))
    state.output_token_idx.append(token_id)
    top = sample.top_logprobs[row] if sample.top_logprobs is not None else None
    state.output_top.append(top)
    ids_lp = sample.token_ids_logprobs[row] if sample.token_ids_logprobs is not None else None
    state.output_ids_logprobs.append(ids_lp)


def logprob_increment(req: Req) -> Optional[dict]:
    """Logprob entries not yet sent to the detokenizer."""
    state = req.logprobs
    if state is None:
        return None
    sent = req.sent_logprobs
    n_in, n_out = len(state.input_token_idx), len(state.output_token_idx)
    inc = {
        "input_token_val": state.input_token_val[sent[0]:],
        "input_token_idx": state.input_token_idx[sent[0]:],
        "input_top": state.input_top[sent[0]:],
        "input_ids_logprobs": state.input_ids_logprobs[sent[0]:],
        "output_token_val": state.output_token_val[sent[1]:],
        "output_token_idx": state.output_token_idx[sent[1]:],
        "output_top": state.output_top[sent[1]:],
        "output_ids_logprobs": state.output_ids_logprobs[sent[1]:],
        "top_logprobs_num": req.top_logprobs_num,
        "token_ids_logprob": req.token_ids_logprob,
    }
    req.sent_logprobs = (n_in, n_out)
    return inc


def build_output_message(reqs: list[Req]) -> BatchTokenIDOutput:
    msg = BatchTokenIDOutput(
        rids=[], finished_reasons=[], new_output_ids=[], output_lens=[], prompt_tokens=[], cached_tokens=[],
        retractions=[], skip_special_tokens=[], spaces_between_special_tokens=[], no_stop_trim=[], stop_strs=[],
        logprobs=[], trim_last_token=[],
    )
    for req in reqs:
        params = req.sampling_params
        msg.rids.append(req.rid)
        msg.finished_reasons.append(req.finished_reason)
        msg.new_output_ids.append(req.output_ids[req.sent_output_len:])
        req.sent_output_len = len(req.output_ids)
        msg.output_lens.append(len(req.output_ids))
        msg.prompt_tokens.append(len(req.origin_input_ids))
        msg.cached_tokens.append(req.cached_tokens)
        msg.retractions.append(req.retractions)
        msg.skip_special_tokens.append(params.skip_special_tokens)
        msg.spaces_between_special_tokens.append(params.spaces_between_special_tokens)
        msg.no_stop_trim.append(params.no_stop_trim)
        msg.stop_strs.append(list(params.stop) if params.stop else None)
        msg.logprobs.append(logprob_increment(req))
        msg.spec_verify_ct.append(req.spec_verify_ct)
        msg.spec_accepted_drafts.append(req.spec_accepted_drafts)
        reason = req.finished_reason
        # A stop token is not part of the text; the last token of a grammar that ended by itself is.
        msg.trim_last_token.append(
            isinstance(reason, FinishMatched) and isinstance(reason.matched, int)
            and reason.matched in req.stop_token_ids and not params.no_stop_trim
        )
    return msg
