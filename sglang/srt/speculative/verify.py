"""Verifying drafts in one forward.

Each request runs its last token and its draft's tokens (speculative/draft_tree.py: a chain or a tree) as decode
rows of one decode forward: the node at depth d feeds the token at position pos + d (pos: the last token's
position), reads a KV row holding the request's slots up to pos followed by the slots of its ancestors, and stores
its K/V in its own slot. A row must see the K/V of the rows it follows, as a causal extend would: the layer-by-layer
decode path stores every row's K/V of a layer before any row attends, and so does the fused CPU step when the batch
says its rows share sequences (ForwardBatch.rows_share_sequences). Each position is computed as a decode row, not as
part of an extend (whose attention and large-batch matmuls round differently), so its logits match plain decoding's
and near ties break the same way. A request keeps the path from the root along which every draft token equals the
token chosen after its parent (argmax, or the sampler's seeded draw), plus the choice after its last node (the bonus
token): its output is plain decoding's.

Where the KV goes: the draft's main path (to its first deepest node) runs in the request's own row, at the positions
decode would use. Every other node gets a slot of its own, and each leaf off the main path a spare request row for
this step: a copy of the request's row up to pos, then the slots of the leaf's path (a tree attention mask written
as KV rows). After the step the accepted nodes' slots take their positions in the request's row (the main path's
slots they displace are freed), and the other spare slots and rows are freed. Where too few spare rows are free, a
tree is verified as its main path alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang.srt.forward_batch import ForwardBatch, ForwardMode
from sglang.srt.managers.schedule_batch import decode_run_len
from sglang.srt.mem_cache.memory_pools import MemoryPools
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.speculative.draft_tree import DraftTree


@dataclass
class VerifyInputs:
    """A verify step: the draft of each request (empty: it decodes one token), where its rows start, the forward and
    sampling inputs (one sampling row per forward row: the request at each of its positions), and the spare KV
    slots and request rows lent to the nodes off each draft's main path."""

    drafts: list[DraftTree]
    first_rows: list[int]
    forward_batch: ForwardBatch
    sampling: SamplingBatchInfo
    spare_slots: list[dict[int, int]] = field(default_factory=list)  # per request: node -> its own slot
    spare_rows: list[int] = field(default_factory=list)

    def settle(self, mem: MemoryPools, reqs: list, paths: list[list[int]]) -> None:
        """Before the accepted tokens are applied: move each request's accepted nodes off the main path (`paths`)
        into its row, freeing the slots they displace, then free every other spare slot and the spare rows."""
        table = mem.req_to_token_pool.req_to_token
        free: list[int] = []
        for req, draft, spare, path in zip(reqs, self.drafts, self.spare_slots, paths):
            if not spare:
                continue
            moved = [node for node in path if node in spare]
            if moved:
                depths = draft.depths()
                where = torch.tensor([req.seqlen - 1 + depths[n] for n in moved], dtype=torch.int64)
                row = table[req.req_pool_idx]
                free += row[where.to(table.device)].tolist()
                row[where.to(table.device)] = torch.tensor([spare[n] for n in moved], dtype=table.dtype,
                                                           device=table.device)
            free += [slot for node, slot in spare.items() if node not in moved]
        self._free(mem, free)

    def release(self, mem: MemoryPools) -> None:
        """The forward failed: free every spare slot and row."""
        self._free(mem, [slot for spare in self.spare_slots for slot in spare.values()])

    def _free(self, mem: MemoryPools, slots: list[int]) -> None:
        if slots:
            mem.allocator.free(torch.tensor(slots, dtype=torch.int64, device=mem.req_to_token_pool.device))
        for row in self.spare_rows:
            mem.req_to_token_pool.free(row)
        self.spare_slots, self.spare_rows = [], []


def fit_trees(mem: MemoryPools, drafts: list[DraftTree]) -> list[DraftTree]:
    """The drafts the free request rows allow: a tree takes one spare row per leaf off its main path; a tree that
    would take more than are left is cut to its main path."""
    free_rows = mem.req_to_token_pool.available_size()
    out = []
    for draft in drafts:
        extra = len(draft.leaves()) - 1 if draft else 0
        if extra > free_rows:
            draft, extra = draft.pruned(draft.main_path()), 0
        free_rows -= extra
        out.append(draft)
    return out


def verify_slots_needed(reqs: list, drafts: list[DraftTree]) -> int:
    """KV slots a verify step must allocate for `drafts` (see slots_for_draft_sizes)."""
    return slots_for_draft_sizes(reqs, [(len(draft), draft.depth()) for draft in drafts])


def slots_for_draft_sizes(reqs: list, sizes: list[tuple[int, int]]) -> int:
    """KV slots a verify step must allocate for drafts of (nodes, depth) `sizes`: positions seqlen-1 ..
    seqlen-1+depth not yet allocated in the requests' rows, and one slot per node off a draft's main path."""
    total = 0
    for req, (nodes, depth) in zip(reqs, sizes):
        total += max(0, req.seqlen + depth - req.kv_allocated_len) + nodes - depth
    return total


def allocate_verify_slots(mem: MemoryPools, reqs: list, drafts: list[DraftTree]) -> None:
    """Give each request slots for its last position and its draft's main path, in runs as decode takes them
    (the positions of rejected draft tokens stay the request's, are rewritten by later steps and are freed with it)."""
    table = mem.req_to_token_pool.req_to_token
    depths = [draft.depth() for draft in drafts]
    need = [(req, req.kv_allocated_len, req.seqlen + d - req.kv_allocated_len)
            for req, d in zip(reqs, depths) if req.seqlen + d > req.kv_allocated_len]
    if not need:
        return
    width = table.shape[1]
    runs = [max(n, decode_run_len(req, start, width)) for req, start, n in need]
    off_path = sum(len(draft) - depth for draft, depth in zip(drafts, depths))  # verify_inputs takes these next
    counts = runs if mem.allocator.available_size() >= sum(runs) + off_path else [n for _, _, n in need]
    slots = mem.alloc_slots(sum(counts))
    offset = 0
    for (req, start, _), count in zip(need, counts):
        table[req.req_pool_idx, start : start + count] = slots[offset : offset + count]
        req.kv_allocated_len = start + count
        offset += count


def _lend_branches(mem: MemoryPools, req: object, draft: DraftTree, slots: list[int], spare_rows: list[int]
                   ) -> tuple[list[int], dict[int, int]]:
    """The request row each node reads in the verify step (its own row on the main path, a spare row per other
    leaf), and the slots of the nodes off the main path (taken from `slots`)."""
    row: int = req.req_pool_idx  # type: ignore[attr-defined]
    main = set(draft.main_path())
    rows = [row if n in main else -1 for n in range(len(draft))]
    spare = {n: slots.pop() for n in range(len(draft)) if n not in main}
    if not spare:
        return rows, spare
    table = mem.req_to_token_pool.req_to_token
    pos = req.seqlen - 1  # type: ignore[attr-defined]
    depths = draft.depths()
    for leaf in draft.leaves():
        if leaf in main:
            continue
        lent = mem.req_to_token_pool.alloc()
        assert lent is not None  # fit_trees left a row for every such leaf
        spare_rows.append(lent)
        path = draft.path_to(leaf)
        table[lent, : pos + 1 + len(path)] = table[row, : pos + 1 + len(path)]
        off = [n for n in path if n in spare]
        where = torch.tensor([pos + depths[n] for n in off], dtype=torch.int64, device=table.device)
        table[lent, where] = torch.tensor([spare[n] for n in off], dtype=table.dtype, device=table.device)
        for n in path:
            if rows[n] < 0:
                rows[n] = lent
    return rows, spare


def verify_inputs(mem: MemoryPools, reqs: list, drafts: list[DraftTree], vocab_size: int, device: torch.device
                  ) -> VerifyInputs:
    """The decode forward of a verify step (one row per position of each request: its last token, then its draft's
    nodes in order) and its sampling inputs. Allocates the spare slots and rows (VerifyInputs.settle frees them)."""
    table = mem.req_to_token_pool.req_to_token
    off_count = sum(len(d) - d.depth() for d in drafts)
    slots = mem.alloc_slots(off_count).tolist()[::-1] if off_count else []
    input_ids: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    steps: list[int] = []
    first_rows: list[int] = []
    spare_rows: list[int] = []
    spare_slots: list[dict[int, int]] = []
    for req, draft in zip(reqs, drafts):
        pos = req.seqlen - 1
        first_rows.append(len(input_ids))
        node_rows, spare = _lend_branches(mem, req, draft, slots, spare_rows)
        spare_slots.append(spare)
        depths = draft.depths()
        input_ids += [req.output_ids[-1], *draft.tokens]
        positions += [pos] + [pos + d for d in depths]
        rows += [req.req_pool_idx, *node_rows]
        steps += [len(req.output_ids)] + [len(req.output_ids) + d for d in depths]
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
    return VerifyInputs(drafts, first_rows, forward_batch, verify_sampling(reqs, drafts, steps, vocab_size, device),
                        spare_slots, spare_rows)


def verify_sampling(reqs: list, drafts: list[DraftTree], steps: list[int], vocab_size: int, device: torch.device
                    ) -> SamplingBatchInfo:
    """Sampling inputs with one row per forward row: each request at each of its positions, with the decoding step
    of that position (`steps`). The sampler's draw is a function of (seed, step) and the row's logits, so a sampled
    request's token at each position is the one plain decoding would sample there: a draft token is kept exactly
    when the draw picks it (probability p(x), as speculative sampling with a point-mass proposal accepts it), and
    otherwise the drawn token follows p with x removed, renormalized; among siblings, the one the draw picks is kept.
    Output distribution and seeded outputs are plain decoding's."""
    rows = [req for req, d in zip(reqs, drafts) for _ in range(1 + len(d))]
    sampling = SamplingBatchInfo.from_reqs(rows, vocab_size, device)
    sampling.steps = steps
    sampling.fill_grammar_bitmask(rows)
    return sampling
