"""Prefill-only requests of an --is-embedding server: admit, run one pooled forward, answer, free the KV.

Pooling requests go through the same admission as any prefill (token budget, request rows) but are never
chunked, because mean pooling and bidirectional attention need the whole sequence in one forward, and they
never decode: every request of a batch finishes in the step that runs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang.srt.managers.finish_reason import FinishLength
from sglang.srt.managers.io_struct import BatchEmbeddingOutput, TokenizedEmbeddingReqInput
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler.loop import Scheduler


def embedding_req(msg: TokenizedEmbeddingReqInput) -> Req:
    params = SamplingParams(max_new_tokens=0)
    return Req(rid=msg.rid, origin_input_ids=list(msg.input_ids), sampling_params=params, stop_token_ids=set(),
               sampling_seed=0, token_type_ids=msg.token_type_ids)


def run_embedding_batch(sched: Scheduler, batch: ScheduleBatch) -> BatchEmbeddingOutput:
    """Pool every request of `batch` (all whole prompts), finish them and free their KV."""
    # Pooled requests sample nothing: only the forward's inputs are built.
    pooled = sched.runner.pool(batch.forward_batch(sched.mem, sched.runner.device)).cpu()
    sched.forward_ct += 1
    out = BatchEmbeddingOutput(rids=[], embeddings=pooled.tolist(), prompt_tokens=[], cached_tokens=[],
                               finished_reasons=[])
    for req in batch.reqs:
        req.kv_committed_len = len(req.fill_ids)
        req.finished_reason = FinishLength(0)
        sched.release(req)
        out.rids.append(req.rid)
        out.prompt_tokens.append(len(req.origin_input_ids))
        out.cached_tokens.append(req.cached_tokens)
        out.finished_reasons.append(req.finished_reason)
    return out
