"""The draft model of STANDALONE speculative decoding (--speculative-draft-model-path).

A second model, with the served model's vocabulary, runs in the scheduler process through its own ModelRunner (the
same forward path, attention backend and decode strategy as the served model) with its own KV memory: request rows,
slots and K/V buffers, and no prefix cache. A request that drafts holds a row there; each decode step it

- catches up: runs the tokens whose draft K/V is missing (its prompt the first time, then the tokens verification
  kept), the last of them being the request's last token, whose logits give the first draft token;
- proposes the rest of its chain greedily, one decode forward per token;
- after verification keeps the K/V of the draft tokens the served model accepted and returns the slots of the
  rejected ones to the draft's pool (`settle`).

With --speculative-eagle-topk above 1 it proposes a tree instead (speculative/draft_search.py), from the draft's
top-k tokens at each step; the draft tokens' K/V is dropped once the tree is made, and the catch-up of the next step
runs the accepted tokens.

A request releases its row and slots when it leaves the running batch (finished, aborted or retracted).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from sglang.srt.forward_batch import ForwardBatch, ForwardMode, build_positions
from sglang.srt.mem_cache.memory_pools import MemoryPools, build_memory_pools
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.draft_search import (
    SearchBudget,
    StepFn,
    rows_and_slots_needed,
    search_trees,
    top_candidates,
)
from sglang.srt.speculative.draft_tree import DraftTree

logger = logging.getLogger(__name__)

FLAG = "--speculative-draft-model-path"
# Flags that describe the served model's weights: the draft takes their defaults.
DRAFT_OWN_FLAGS = ("dtype", "quantization", "json_model_override_args", "context_length", "gguf_kernel_max_rows",
                   "gguf_activations", "small_batch_quantization", "large_batch_weights")
# The draft's KV cache holds at most this many tokens (fewer when the served model's holds fewer): the requests in
# speculation (at most SPEC_MAX_BATCH) share it, and a request it cannot hold decodes without drafts.
MAX_DRAFT_KV_TOKENS = 32768
# Catch-ups of at most this many tokens per request run as decode rows (rows_share_sequences, as a verify step
# runs), which the fused CPU decode step serves; longer ones (a prompt) run as an extend.
MAX_DECODE_ROWS_PER_SEQ = 8


@dataclass
class DraftSeq:
    """A request's place in the draft's memory: its row, and positions 0..computed-1 hold the draft's K/V of its
    tokens (slots beyond are not held). While a proposal awaits verification (`pending`), `base` is the request's
    length when it drafted and `steps` the draft tokens proposed: positions up to base-1 hold its tokens' K/V and
    base..base+steps-2 the draft tokens' (the last draft token is never run)."""

    row: int
    computed: int = 0
    base: int = 0
    steps: int = 0
    pending: bool = False


def _as_draft(req: Any) -> Optional[DraftSeq]:
    return req.spec_state if isinstance(req.spec_state, DraftSeq) else None


def draft_rows(max_requests: int, topk: int) -> int:
    """Request rows of the draft's memory: one per request, and the rows a tree search lends its beams."""
    return max_requests * (1 + rows_and_slots_needed(topk, 2)[0])


class DraftModel:
    def __init__(self, runner: Any, mem: MemoryPools, context_len: int, chunk: int, description: str,
                 topk: int = 1, tree_size: int = 0) -> None:
        # "draft <path> (<architecture>, <weight size>)", for the startup line
        self.description = description
        self.runner = runner
        self.mem = mem
        self.context_len = context_len
        self.chunk = chunk
        # --speculative-eagle-topk and the tree's nodes (--speculative-num-draft-tokens - 1) where it is above 1
        self.topk = topk
        self.tree_size = tree_size

    @classmethod
    def load(cls, server_args: ServerArgs, target_vocab_size: int, target_tokenizer: Any, target_tokens: int,
             max_requests: int) -> DraftModel:
        """Load the draft model as the served model is loaded, check its vocabulary and build its KV memory:
        `max_requests` rows and at most `target_tokens` slots (the running requests never hold more), at most
        MAX_DRAFT_KV_TOKENS."""
        from sglang.srt.layers.small_batch_rows import resolve_small_batch_rows
        from sglang.srt.model_loader.model_info import load_model_info

        path = server_args.speculative_draft_model_path
        assert path is not None
        # The served model's weight flags (dtype, GGUF blocks, quantization, overrides) are its own: the draft loads
        # as its checkpoint and this machine's plan choose.
        defaults = {name: getattr(ServerArgs, name) for name in DRAFT_OWN_FLAGS}
        draft_args = dataclasses.replace(server_args, model_path=path, tokenizer_path=path, served_model_name=path,
                                         **defaults)
        logger.info("Speculative decoding: loading the draft model %s; the Weights, KV cache, Arithmetic and "
                    "Decode path lines up to the `Speculative decoding: STANDALONE` line describe the draft", path)
        try:
            info = load_model_info(draft_args)
        except Exception as e:  # noqa: BLE001 - any failure to read the draft is the flag's error
            raise ValueError(f"{FLAG} {path}: cannot load the draft model: {type(e).__name__}: {e}") from e
        if info.vocab_size != target_vocab_size:
            raise ValueError(f"{FLAG} {path}: the draft model's vocabulary ({info.vocab_size} tokens) differs from "
                             f"the served model's ({target_vocab_size} tokens); the draft must share its tokenizer")
        check_same_tokenizer(path, target_tokenizer, server_args.trust_remote_code)
        runner = ModelRunner(
            model_dir=info.model_dir, hf_config=info.hf_config, dtype=info.dtype, device=server_args.device,
            gguf_path=info.gguf_path, arithmetic=info.arithmetic,
            gguf_kernel_max_rows=resolve_small_batch_rows(draft_args.gguf_kernel_max_rows, info.arithmetic),
        )
        if runner.pooling_output is not None:
            raise ValueError(f"{FLAG} {path}: an embedding, reward or cross-encoder model cannot draft tokens")
        width = info.context_len + 8
        topk = server_args.speculative_eagle_topk or 1
        mem = build_memory_pools(runner.kv_cache_spec(), runner.device, info.context_len,
                                 max(16, min(target_tokens, max_requests * width, MAX_DRAFT_KV_TOKENS)),
                                 server_args.mem_fraction_static,
                                 draft_rows(max_requests, topk), disable_radix_cache=True)
        runner.bind_kv_pool(mem.kv_pool)  # logs the draft's arithmetic and its `Decode path:` line
        arch = (getattr(info.hf_config, "architectures", None) or [type(runner.model).__name__])[0]
        return cls(runner, mem, info.context_len, server_args.chunked_prefill_size or 4096,
                   f"draft {path} ({arch}, {runner.weight_bytes / 2**20:.1f} MB)", topk,
                   (server_args.speculative_num_draft_tokens or 2) - 1)

    # ---- memory ---------------------------------------------------------------------------------------
    def used_tokens(self) -> int:
        return self.mem.allocator.size - self.mem.allocator.available_size()

    def idle_error(self) -> Optional[str]:
        """With no request running, every slot and row of the draft's memory is free."""
        rows_free = self.mem.req_to_token_pool.available_size()
        if self.used_tokens() or rows_free != self.mem.req_to_token_pool.size:
            return (f"draft memory leak: used={self.used_tokens()} total={self.mem.allocator.size} "
                    f"free_rows={rows_free}/{self.mem.req_to_token_pool.size}")
        return None

    def _truncate(self, seq: DraftSeq, keep: int, held: int) -> None:
        """Free the slots of positions keep..held-1 of the request's row."""
        if held > keep:
            self.mem.allocator.free(self.mem.req_to_token_pool.req_to_token[seq.row, keep:held].clone())
        seq.computed = min(seq.computed, keep)

    def settle(self, req: Any, accepted: int) -> None:
        """After verification: keep the draft's K/V of the accepted draft tokens, free the rest."""
        seq = _as_draft(req)
        if seq is None or not seq.pending:
            return
        held = seq.base + seq.steps - 1
        keep = seq.base + min(accepted, seq.steps - 1)
        seq.pending = False
        seq.computed = held
        self._truncate(seq, keep, held)

    def release(self, req: Any) -> None:
        seq = _as_draft(req)
        if seq is None:
            return
        self.settle(req, 0)
        self._truncate(seq, 0, seq.computed)
        self.mem.req_to_token_pool.free(seq.row)
        req.spec_state = None

    def max_steps(self, req: Any) -> int:
        """How many draft tokens the draft model can propose for `req`: its positions must stay in its context."""
        return self.context_len - req.seqlen

    # ---- proposing ------------------------------------------------------------------------------------
    def propose(self, reqs: list, steps: list[int]) -> list[list[int]]:
        """Up to steps[i] greedy draft tokens for each request; none for those the draft's memory cannot hold."""
        table = self.mem.req_to_token_pool.req_to_token
        free = self.mem.allocator.available_size()
        chosen: list[tuple[int, Any, DraftSeq, int]] = []
        for i, (req, k) in enumerate(zip(reqs, steps)):
            if k <= 0:
                continue
            self.settle(req, 0)  # an unverified proposal (none is left unless a step failed) is discarded
            seq = _as_draft(req)
            need = req.seqlen - (seq.computed if seq is not None else 0) + k - 1
            if need > free:
                continue
            if seq is None:
                row = self.mem.req_to_token_pool.alloc()
                if row is None:
                    continue
                seq = req.spec_state = DraftSeq(row)
            table[seq.row, seq.computed : req.seqlen + k - 1] = self.mem.alloc_slots(need)
            seq.base, seq.steps, seq.pending = req.seqlen, k, True
            free -= need
            chosen.append((i, req, seq, k))
        drafts: list[list[int]] = [[] for _ in reqs]
        if not chosen:
            return drafts
        try:
            first = self._catch_up([(req, seq) for _, req, seq, _ in chosen])
            for (i, *_), token in zip(chosen, first):
                drafts[i].append(token)
            for j in range(1, max(k for *_, k in chosen)):
                active = [(i, req, seq) for i, req, seq, k in chosen if k > j]
                parts = [(seq.row, req.seqlen - 1 + j, [drafts[i][-1]]) for i, req, seq in active]
                for (i, *_), token in zip(active, self._forward(parts)):
                    drafts[i].append(token)
        except Exception:  # noqa: BLE001 - the draft failing costs speculation for this step, not the requests
            logger.exception("The draft model failed; these requests decode this step without a draft")
            for _, req, _, _ in chosen:
                self.release(req)
            return [[] for _ in reqs]
        return drafts

    def propose_trees(self, reqs: list, steps: list[int]) -> list[DraftTree]:
        """With --speculative-eagle-topk above 1: a tree of at most tree_size nodes and steps[i] levels per request
        (speculative/draft_search.py); none for those the draft's memory cannot hold, one level where no rows are
        free for the search."""
        table = self.mem.req_to_token_pool.req_to_token
        budget = SearchBudget(self.mem)
        chosen: list[tuple[int, Any, DraftSeq, int]] = []
        for i, (req, k) in enumerate(zip(reqs, steps)):
            if k <= 0:
                continue
            self.settle(req, 0)
            seq = _as_draft(req)
            if seq is None:
                row = budget.take_row()
                if row is None:
                    continue
                seq = req.spec_state = DraftSeq(row)
            need = req.seqlen - seq.computed
            k = budget.admit(need, self.topk, k) if need > 0 else 0
            if k == 0:
                continue
            table[seq.row, seq.computed : req.seqlen] = self.mem.alloc_slots(need)
            chosen.append((i, req, seq, k))

        def start() -> tuple[list[tuple[list[int], list[float], Any]], list[int]]:
            logits = self._catch_up_logits([(req, seq) for _, req, seq, _ in chosen])
            for _, req, seq, _ in chosen:
                seq.computed = req.seqlen
            ids, lps = top_candidates(logits, self.topk)
            return [(a, b, None) for a, b in zip(ids, lps)], [req.seqlen for _, req, _, _ in chosen]

        def step(parts: list[tuple[int, int, int]], _: list[Any]) -> tuple[list[Any], list[list[int]],
                                                                           list[list[float]]]:
            logits = self._forward_logits([(row, pos, [token]) for row, pos, token in parts])
            return [None] * len(parts), *top_candidates(logits, self.topk)

        return self._search(len(reqs), chosen, start, step, "The draft model")

    def _search(self, count: int, chosen: list[tuple[int, Any, Any, int]],
                start: Callable[[], tuple[list[tuple[list[int], list[float], Any]], list[int]]], step: StepFn,
                what: str) -> list[DraftTree]:
        """The trees of the `count` requests of a proposal (empty but for `chosen`: index, request, its draft state
        with a row, levels): `start` runs their catch-ups and returns each one's top-k after its last token (ids,
        log-probabilities, the context its children go with) and the positions its row holds. A failure of the
        draft costs these requests their drafts for this step, not the requests."""
        trees = [DraftTree() for _ in range(count)]
        if not chosen:
            return trees
        try:
            first, bases = start()
            found = search_trees(self.mem, [(seq.row, base) for (_, _, seq, _), base in zip(chosen, bases)], first,
                                 [k for *_, k in chosen], self.topk,
                                 [min(self.tree_size, self.topk * k) for *_, k in chosen], step)
        except Exception:  # noqa: BLE001 - see the docstring
            logger.exception("%s failed; these requests decode this step without a draft", what)
            for _, req, _, _ in chosen:
                self.release(req)
            return trees
        for (i, *_), tree in zip(chosen, found):
            trees[i] = tree
        return trees

    def _catch_up(self, items: list[tuple[Any, DraftSeq]]) -> list[int]:
        """Run each request's tokens from its first position without draft K/V to its last token, in forwards of
        at most `chunk` tokens; the draft's argmax after each request's last token."""
        return self._catch_up_logits(items).argmax(dim=-1).tolist()

    def _catch_up_logits(self, items: list[tuple[Any, DraftSeq]]) -> torch.Tensor:
        """As _catch_up: the draft's logits after each request's last token."""
        pos = [seq.computed for _, seq in items]
        first: list[Optional[torch.Tensor]] = [None] * len(items)
        while True:
            budget = self.chunk
            parts, owners = [], []
            for n, (req, seq) in enumerate(items):
                ids = req.all_ids()
                take = min(len(ids) - pos[n], budget)
                if take <= 0:
                    continue
                parts.append((seq.row, pos[n], ids[pos[n] : pos[n] + take]))
                owners.append(n)
                pos[n] += take
                budget -= take
            if not parts:
                return torch.stack([row for row in first if row is not None])
            for n, row in zip(owners, self._forward_logits(parts)):
                first[n] = row

    def _forward(self, parts: list[tuple[int, int, list[int]]]) -> list[int]:
        """One forward of the draft model over `parts` (row, first position, tokens), whose slots are allocated;
        the argmax of each part's last token."""
        return self._forward_logits(parts).argmax(dim=-1).tolist()

    def _forward_logits(self, parts: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """As _forward: the logits of each part's last token."""
        forward_batch, last = self._forward_batch(parts)
        logits = self.runner.forward(forward_batch, None).logits
        assert logits is not None
        return logits[last.to(logits.device)]

    def _forward_batch(self, parts: list[tuple[int, int, list[int]]]) -> tuple[ForwardBatch, torch.Tensor]:
        """The forward over `parts` (row, first position, tokens) in the draft's memory, and the index of each
        part's last token among the rows the runner returns logits for (every row in decode mode, each part's last
        row in extend mode)."""
        table = self.mem.req_to_token_pool.req_to_token
        device = self.runner.device
        rows = [row for row, _, _ in parts]
        starts = [start for _, start, _ in parts]
        lens = [len(tokens) for _, _, tokens in parts]
        input_ids = torch.tensor([t for _, _, tokens in parts for t in tokens], dtype=torch.int64)
        if max(lens) <= MAX_DECODE_ROWS_PER_SEQ:
            # One decode row per token; a row sees the K/V the earlier rows of its sequence store in each layer.
            row_of = [row for row, n in zip(rows, lens) for _ in range(n)]
            positions = [start + j for start, n in zip(starts, lens) for j in range(n)]
            rows_t, pos_t = torch.tensor(row_of, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64)
            seq_lens = [p + 1 for p in positions]
            forward_batch = ForwardBatch(
                forward_mode=ForwardMode.DECODE, batch_size=len(positions), input_ids=input_ids.to(device),
                positions=pos_t.to(device), req_pool_indices=rows_t.to(device),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
                out_cache_loc=table[rows_t.to(table.device), pos_t.to(table.device)].to(device),
                seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=positions, extend_seq_lens_cpu=[1] * len(positions),
                req_to_token_pool=self.mem.req_to_token_pool, token_to_kv_pool=self.mem.kv_pool,
                rows_share_sequences=max(lens) > 1,
            )
            last = torch.tensor(lens, dtype=torch.int64).cumsum(0) - 1
        else:
            seq_lens = [s + n for s, n in zip(starts, lens)]
            out_cache_loc = torch.cat([table[row, s : s + n] for row, s, n in zip(rows, starts, lens)])
            forward_batch = ForwardBatch(
                forward_mode=ForwardMode.EXTEND, batch_size=len(parts), input_ids=input_ids.to(device),
                positions=build_positions(starts, lens, device),
                req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
                out_cache_loc=out_cache_loc.to(device),
                seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=starts, extend_seq_lens_cpu=lens,
                req_to_token_pool=self.mem.req_to_token_pool, token_to_kv_pool=self.mem.kv_pool,
            )
            last = torch.arange(len(parts))
        return forward_batch, last


def check_same_tokenizer(path: str, target_tokenizer: Any, trust_remote_code: bool) -> None:
    """The draft's tokenizer, where it has one, must map the same strings to the same ids as the served model's."""
    if target_tokenizer is None:
        return
    from sglang.srt.tokenizer_utils import get_tokenizer

    try:
        draft_tokenizer = get_tokenizer(path, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - a checkpoint without tokenizer files: its vocabulary size was checked
        logger.info("%s %s has no tokenizer of its own; only its vocabulary size was checked", FLAG, path)
        return
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"{FLAG} {path}: the draft model's tokenizer maps tokens to other ids than the served "
                         "model's; the draft must share its tokenizer")
