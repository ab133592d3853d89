"""EAGLE drafting (--speculative-algorithm EAGLE or EAGLE3): an EAGLE-1 head (speculative/eagle_head.py) or an
EAGLE-3 head (speculative/eagle3_head.py) proposes a chain of --speculative-num-steps tokens from the served model's
hidden states (EAGLE-1: its final ones; EAGLE-3: the concatenated inputs of three of its layers).

The head's row at position i is the pair (token i+1, served model's hidden state at i) and predicts token i+2. A
request's rows start at the first position whose hidden state the served model computed in this request (a prefix
served from the radix cache was not computed: the head's context starts after it). Each decode step a request that
drafts

- catches up: runs the rows whose head K/V is missing, up to the pair (its last token, the hidden state before it),
  from the hidden states the served model recorded (speculative/hidden_log.py); that last row gives the first draft
  token and the head's own hidden state;
- proposes the rest of its chain greedily, each step reading the head's previous hidden state;
- after verification drops the K/V of every draft row: those rows read the head's hidden states, and the accepted
  positions are run again from the served model's at the next catch-up, as SGLang's draft extend after decode does.

With --speculative-eagle-topk above 1 the head grows a tree instead (speculative/draft_search.py): each beam carries
the head's hidden state of the row that proposed it.

Memory (rows, slots, release, idle check) is the STANDALONE draft's (speculative/draft_model.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from sglang.srt.mem_cache.memory_pools import KVCacheSpec, build_memory_pools
from sglang.srt.models.llama import head_dim_of
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.draft_model import MAX_DRAFT_KV_TOKENS, DraftModel, DraftSeq, draft_rows
from sglang.srt.speculative.draft_search import SearchBudget, top_candidates
from sglang.srt.speculative.draft_tree import DraftTree
from sglang.srt.speculative.eagle3_head import Eagle3Runner, TargetCapture, load_eagle3_runner
from sglang.srt.speculative.eagle_head import EagleRunner, load_eagle_runner
from sglang.srt.speculative.hidden_log import HiddenLog, describe_decode_path

logger = logging.getLogger(__name__)


@dataclass
class EagleSeq(DraftSeq):
    """A DraftSeq whose head position q is the served model's position start + q."""

    start: int = 0
    pool_row: int = -1  # the request's row in the served model's memory (its hidden states are recorded under it)


def _as_eagle(req: Any) -> Optional[EagleSeq]:
    return req.spec_state if isinstance(req.spec_state, EagleSeq) else None


class EagleDraft(DraftModel):
    runner: EagleRunner | Eagle3Runner

    def __init__(self, runner: EagleRunner | Eagle3Runner, mem: Any, context_len: int, chunk: int,
                 description: str, topk: int = 1, tree_size: int = 0) -> None:
        super().__init__(runner, mem, context_len, chunk, description, topk, tree_size)
        self.hidden = HiddenLog()

    @classmethod
    def load_eagle(cls, server_args: ServerArgs, target_runner: Any, context_len: int, target_tokens: int,
                   max_requests: int) -> EagleDraft:
        """Load the head (EAGLE-1 or, with --speculative-algorithm EAGLE3, EAGLE-3) for the served model of
        `target_runner`, build its KV memory (as the STANDALONE draft's) and have the served model record its hidden
        states (EAGLE3: those entering the captured layers)."""
        path = server_args.speculative_draft_model_path
        assert path is not None
        runner: EagleRunner | Eagle3Runner
        capture: tuple[int, ...] = ()
        if server_args.speculative_algorithm == "EAGLE3":
            runner, config, capture = load_eagle3_runner(path, target_runner, server_args.speculative_token_map)
        else:
            runner, config = load_eagle_runner(path, target_runner)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        kv_dtype = (target_runner.arithmetic.kv_dtype if target_runner.arithmetic is not None
                    else target_runner.dtype)
        spec = KVCacheSpec(config.num_hidden_layers, num_kv_heads, head_dim_of(config), kv_dtype)
        width = context_len + 8
        topk = server_args.speculative_eagle_topk or 1
        mem = build_memory_pools(spec, runner.device, context_len,
                                 max(16, min(target_tokens, max_requests * width, MAX_DRAFT_KV_TOKENS)),
                                 server_args.mem_fraction_static, draft_rows(max_requests, topk),
                                 disable_radix_cache=True)
        params = sum(p.numel() * p.element_size() for p in runner.head.parameters())
        shared = ("own embedding" if runner.own_embed is not None else "served model's embedding") + \
            (", own LM head" if runner.own_lm_head is not None else ", served model's LM head")
        if isinstance(runner, Eagle3Runner):
            shared += f" over {len(runner.hot_ids)} draft tokens, reads the inputs of layers {list(capture)}"
        draft = cls(runner, mem, context_len, server_args.chunked_prefill_size or 4096,
                    f"head {path} ({config.architectures[0]}, {config.num_hidden_layers} layer, "
                    f"{params / 2**20:.2f} MB, {shared})", topk, (server_args.speculative_num_draft_tokens or 2) - 1)
        if capture:
            sink = TargetCapture(target_runner, capture, draft.hidden.record)
            sink.arm()
            target_runner.hidden_sink = sink
            return draft
        target_runner.hidden_sink = draft.hidden.record
        describe_decode_path(target_runner, "EAGLE", "the final hidden states")
        return draft

    # ---- memory ---------------------------------------------------------------------------------------
    def settle(self, req: Any, accepted: int) -> None:
        """After verification: free every draft row (the accepted ones run again from the served model's states)."""
        seq = _as_eagle(req)
        if seq is None or not seq.pending:
            return
        seq.pending = False
        seq.computed = seq.base + seq.steps - 1
        self._truncate(seq, seq.base, seq.computed)

    def release(self, req: Any) -> None:
        seq = _as_eagle(req)
        super().release(req)
        if seq is not None and req.req_pool_idx is None:  # the request left the served model's memory
            self.hidden.drop(seq.pool_row)

    # ---- proposing ------------------------------------------------------------------------------------
    def propose(self, reqs: list, steps: list[int]) -> list[list[int]]:
        """Up to steps[i] greedy draft tokens per request; none for a request whose hidden states are missing or
        which the head's memory cannot hold."""
        table = self.mem.req_to_token_pool.req_to_token
        free = self.mem.allocator.available_size()
        chosen: list[tuple[int, Any, EagleSeq, int]] = []
        for i, (req, k) in enumerate(zip(reqs, steps)):
            if k <= 0:
                continue
            self.settle(req, 0)
            seq = self._place(req)
            if seq is None:
                continue
            base = req.seqlen - 1 - seq.start  # head rows for the served model's positions start .. seqlen-2
            need = base - seq.computed + k - 1
            if need > free:
                continue
            table[seq.row, seq.computed : base + k - 1] = self.mem.alloc_slots(need)
            seq.base, seq.steps, seq.pending = base, k, True
            free -= need
            chosen.append((i, req, seq, k))
        drafts: list[list[int]] = [[] for _ in reqs]
        if not chosen:
            return drafts
        try:
            hidden, logits = self._catch_up_hidden([(req, seq) for _, req, seq, _ in chosen])
            for (i, *_), token in zip(chosen, self._greedy(logits)):
                drafts[i].append(token)
            state = {i: hidden[n : n + 1] for n, (i, *_) in enumerate(chosen)}
            for j in range(1, max(k for *_, k in chosen)):
                active = [(i, seq) for i, _, seq, k in chosen if k > j]
                parts = [(seq.row, seq.base + j - 1, [drafts[i][-1]]) for i, seq in active]
                out, logits = self._run(parts, torch.cat([state[i] for i, _ in active]), [s.start for _, s in active])
                for n, ((i, _), token) in enumerate(zip(active, self._greedy(logits))):
                    drafts[i].append(token)
                    state[i] = out[n : n + 1]
        except Exception:  # noqa: BLE001 - the head failing costs speculation for this step, not the requests
            logger.exception("The EAGLE head failed; these requests decode this step without a draft")
            for _, req, _, _ in chosen:
                self.release(req)
            return [[] for _ in reqs]
        return drafts

    def propose_trees(self, reqs: list, steps: list[int]) -> list[DraftTree]:
        """With --speculative-eagle-topk above 1: a tree of at most tree_size nodes and steps[i] levels per request
        (speculative/draft_search.py); none for a request whose hidden states are missing or which the head's memory
        cannot hold, one level where no rows are free for the search."""
        table = self.mem.req_to_token_pool.req_to_token
        budget = SearchBudget(self.mem)
        chosen: list[tuple[int, Any, EagleSeq, int]] = []
        for i, (req, k) in enumerate(zip(reqs, steps)):
            if k <= 0:
                continue
            self.settle(req, 0)
            seq = self._place(req, budget.take_row)
            if seq is None:
                continue
            base = req.seqlen - 1 - seq.start
            k = budget.admit(base - seq.computed, self.topk, k) if base > seq.computed else 0
            if k == 0:
                continue
            table[seq.row, seq.computed : base] = self.mem.alloc_slots(base - seq.computed)
            seq.base, seq.steps, seq.pending = base, k, False
            chosen.append((i, req, seq, k))
        ids = self.runner.token_ids

        def start() -> tuple[list[tuple[list[int], list[float], Any]], list[int]]:
            hidden, logits = self._catch_up_hidden([(req, seq) for _, req, seq, _ in chosen])
            for _, _, seq, _ in chosen:
                seq.computed = seq.base
            top, lps = top_candidates(logits, self.topk, ids)
            return ([(top[n], lps[n], (hidden[n : n + 1], seq.start)) for n, (_, _, seq, _) in enumerate(chosen)],
                    [seq.base for _, _, seq, _ in chosen])

        def step(parts: list[tuple[int, int, int]], ctxs: list[Any]) -> tuple[list[Any], list[list[int]],
                                                                              list[list[float]]]:
            starts = [start for _, start in ctxs]
            out, logits = self._run([(row, pos, [token]) for row, pos, token in parts],
                                    torch.cat([h for h, _ in ctxs]), starts)
            return [(out[n : n + 1], s) for n, s in enumerate(starts)], *top_candidates(logits, self.topk, ids)

        return self._search(len(reqs), chosen, start, step, "The EAGLE head")

    def _greedy(self, logits: torch.Tensor) -> list[int]:
        """Each row's greedy token, as a served-model id."""
        ids = self.runner.token_ids
        best = logits.argmax(dim=-1)
        return (ids[best.cpu()] if ids is not None else best).tolist()

    def _place(self, req: Any, take_row: Optional[Any] = None) -> Optional[EagleSeq]:
        """The request's head state, (re)started where the served model's recorded hidden states begin; None when
        they do not reach its last position or no head row is free (`take_row`: where a new one comes from)."""
        pool_row = req.req_pool_idx
        first = self.hidden.first(pool_row, req.seqlen - 1)
        seq = _as_eagle(req)
        if seq is not None and (first is None or first > seq.start + seq.computed):
            self.release(req)  # the recorded states restarted after a gap: so does the head's context
            seq = None
        if first is None or req.seqlen - 1 - first < 1:
            return None
        if seq is None:
            row = take_row() if take_row is not None else self.mem.req_to_token_pool.alloc()
            if row is None:
                return None
            seq = req.spec_state = EagleSeq(row, start=first, pool_row=pool_row)
        return seq

    def _catch_up_hidden(self, items: list[tuple[Any, EagleSeq]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run each request's missing rows up to the pair (last token, hidden state before it), in forwards of at
        most `chunk` rows; the head's hidden state and logits after each request's last row."""
        pos = [seq.computed for _, seq in items]
        first: list[Optional[torch.Tensor]] = [None] * len(items)
        last_hidden: list[Optional[torch.Tensor]] = [None] * len(items)
        while True:
            budget = self.chunk
            parts, hiddens, owners, starts = [], [], [], []
            for n, (req, seq) in enumerate(items):
                take = min(seq.base - pos[n], budget)
                if take <= 0:
                    continue
                ids = req.all_ids()
                lo = seq.start + pos[n]  # the served model's position of the first row
                parts.append((seq.row, pos[n], ids[lo + 1 : lo + 1 + take]))
                hiddens.append(self.hidden.get(req.req_pool_idx, lo, lo + take))
                owners.append(n)
                starts.append(seq.start)
                pos[n] += take
                budget -= take
            if not parts:
                break
            out, logits = self._run(parts, torch.cat(hiddens), starts)
            for m, n in enumerate(owners):
                first[n] = logits[m]
                last_hidden[n] = out[m]
        for req, seq in items:
            self.hidden.consumed(req.req_pool_idx, seq.start + seq.base)
        return (torch.stack([h for h in last_hidden if h is not None]),
                torch.stack([row for row in first if row is not None]))

    def _run(self, parts: list[tuple[int, int, list[int]]], hidden_in: torch.Tensor, starts: list[int]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of the head over `parts` (head row, first head position, tokens), the hidden state of each
        token in `hidden_in`; `starts`: each part's offset from head positions to the served model's positions,
        at which the rotary embedding turns (the head's K/V row for position q is at index q - start). The head's
        hidden state and logits at each part's last row."""
        forward_batch, _ = self._forward_batch(parts)
        lens = torch.tensor([len(tokens) for _, _, tokens in parts], dtype=torch.int64)
        last = lens.cumsum(0) - 1  # each part's last row (the head returns every row, in either mode)
        offsets = torch.tensor([s for s, (_, _, tokens) in zip(starts, parts) for _ in tokens], dtype=torch.int64)
        forward_batch.positions = forward_batch.positions + offsets.to(forward_batch.positions.device)
        return self.runner.forward_logits(forward_batch, hidden_in, last)
