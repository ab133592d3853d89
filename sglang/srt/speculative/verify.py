"""Verifying drafts in one forward.

Each request runs its last token and its draft tokens as decode rows of one decode forward: row j of a request
feeds the token at position pos + j (pos: its last token's position), reads the request's own KV row up to that
position and stores its K/V there. Row j must see the K/V of the rows before it, as a causal extend would: the
layer-by-layer decode path stores every row's K/V of a layer before any row attends, and so does the fused CPU step
when the batch says its rows share sequences (ForwardBatch.rows_share_sequences). Each position is computed as a
decode row, not as part of an extend (whose attention and large-batch matmuls round differently), so its logits
match plain decoding's and near ties break the same way. A request keeps the longest draft prefix that equals the
token chosen at each position (argmax, or the sampler's seeded draw), plus the choice after it (the bonus token): its
output is plain decoding's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.forward_batch import ForwardBatch, ForwardMode
from sglang.srt.managers.schedule_batch import decode_run_len
from sglang.srt.mem_cache.memory_pools import MemoryPools
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo


@dataclass
class VerifyInputs:
    """A verify step: the draft of each request (empty: it decodes one token), where its rows start, and the forward
    and sampling inputs (one sampling row per forward row: the request at each of its positions)."""

    drafts: list[list[int]]
    first_rows: list[int]
    forward_batch: ForwardBatch
    sampling: SamplingBatchInfo


def verify_slots_needed(reqs: list, drafts: list[list[int]]) -> int:
    """KV slots a verify step must allocate: positions seqlen-1 .. seqlen-1+len(draft) not yet allocated."""
    return sum(max(0, req.seqlen + len(d) - req.kv_allocated_len) for req, d in zip(reqs, drafts))


def allocate_verify_slots(mem: MemoryPools, reqs: list, drafts: list[list[int]]) -> None:
    """Give each request slots for its last position and its draft positions, in runs as decode takes them
    (the positions of rejected draft tokens stay the request's, are rewritten by later steps and are freed with it)."""
    table = mem.req_to_token_pool.req_to_token
    need = [(req, req.kv_allocated_len, req.seqlen + len(d) - req.kv_allocated_len)
            for req, d in zip(reqs, drafts) if req.seqlen + len(d) > req.kv_allocated_len]
    if not need:
        return
    width = table.shape[1]
    runs = [max(n, decode_run_len(req, start, width)) for req, start, n in need]
    counts = runs if mem.allocator.available_size() >= sum(runs) else [n for _, _, n in need]
    slots = mem.alloc_slots(sum(counts))
    offset = 0
    for (req, start, _), count in zip(need, counts):
        table[req.req_pool_idx, start : start + count] = slots[offset : offset + count]
        req.kv_allocated_len = start + count
        offset += count


def verify_forward_batch(mem: MemoryPools, reqs: list, drafts: list[list[int]], device: torch.device
                         ) -> tuple[ForwardBatch, list[int]]:
    """The decode forward of a verify step (one row per position of each request), and each request's first row."""
    table = mem.req_to_token_pool.req_to_token
    input_ids: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    first_rows: list[int] = []
    for req, draft in zip(reqs, drafts):
        pos = req.seqlen - 1
        first_rows.append(len(input_ids))
        input_ids += [req.output_ids[-1], *draft]
        positions += range(pos, pos + 1 + len(draft))
        rows += [req.req_pool_idx] * (1 + len(draft))
    seq_lens = [p + 1 for p in positions]
    ids_t, pos_t, rows_t, lens_t = torch.tensor([input_ids, positions, rows, seq_lens], dtype=torch.int64,
                                                device=table.device).unbind(0)
    out_cache_loc = table[rows_t, pos_t]
    forward_batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=len(input_ids), input_ids=ids_t.to(device),
        positions=pos_t.to(device), req_pool_indices=rows_t.to(device), seq_lens=lens_t.to(device),
        out_cache_loc=out_cache_loc.to(device), seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=positions,
        extend_seq_lens_cpu=[1] * len(input_ids), req_to_token_pool=mem.req_to_token_pool,
        token_to_kv_pool=mem.kv_pool, rows_share_sequences=True,
    )
    return forward_batch, first_rows


def accepted_length(draft: list[int], predicted: list[int]) -> int:
    """How many draft tokens a greedy request keeps: the longest prefix where the draft equals the argmax of the
    position before it (predicted[j] is the argmax after the j-th input token of the step)."""
    n = 0
    while n < len(draft) and draft[n] == predicted[n]:
        n += 1
    return n


def verify_sampling(reqs: list, drafts: list[list[int]], vocab_size: int, device: torch.device
                    ) -> SamplingBatchInfo:
    """Sampling inputs with one row per forward row: each request at each of its positions, with the decoding step
    of that position. The sampler's draw is a function of (seed, step) and the row's logits, so a sampled request's
    token at each position is the one plain decoding would sample there: the draft token is kept exactly when the
    draw picks it (probability p(x), as speculative sampling with a point-mass proposal accepts it), and otherwise
    the drawn token follows p with x removed, renormalized. Output distribution and seeded outputs are plain
    decoding's."""
    rows = [req for req, d in zip(reqs, drafts) for _ in range(1 + len(d))]
    sampling = SamplingBatchInfo.from_reqs(rows, vocab_size, device)
    sampling.steps = [len(req.output_ids) + j for req, d in zip(reqs, drafts) for j in range(1 + len(d))]
    sampling.fill_grammar_bitmask(rows)
    return sampling
