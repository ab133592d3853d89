"""Speculative decoding in the scheduler (--speculative-algorithm NGRAM, STANDALONE, EAGLE or EAGLE3): draft, verify,
accept.

A decode step where some running request has a draft runs as one verify forward (speculative/verify.py): a decode
forward, layer by layer, with one row per verified position; requests without a draft take their usual single row.
Steps where no request has a draft run the plain decode step (the fused CPU step where it applies). Drafts come from
n-grams of earlier text (NgramSpeculator), from a draft model (StandaloneSpeculator, speculative/draft_model.py) or
from an EAGLE head reading the served model's hidden states (EagleSpeculator, speculative/eagle_draft.py).

Which requests draft: those without penalties, custom logit processors, grammars or a pending min_new_tokens (their
next-token distribution at a draft position would depend on draft tokens the sampling state has not seen). Each
position's token is chosen as plain decoding chooses it at that step (verify.py): a request keeps the draft prefix
that equals those choices plus the choice after it. The tokens are applied one at a time exactly as plain decoding
applies its one token, so stop tokens, stop strings and max_new_tokens cut at the same token, and logprobs are those
of plain decoding.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional

from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.scheduler.results import _process_req, fail_request, inject_fault
from sglang.srt.managers.scheduler.stats import maybe_log_decode
from sglang.srt.model_executor.model_runner import StepOutput
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.args import EAGLE_ALGORITHMS
from sglang.srt.speculative.draft_model import DraftModel
from sglang.srt.speculative.draft_tree import DraftTree
from sglang.srt.speculative.eagle_draft import EagleDraft
from sglang.srt.speculative.ngram_cache import NgramCache, TokenIndex, propose_draft
from sglang.srt.speculative.ngram_tree import TreeShape
from sglang.srt.speculative.verify import (
    VerifyInputs,
    allocate_verify_slots,
    fit_trees,
    slots_for_draft_sizes,
    verify_inputs,
    verify_slots_needed,
)

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler.loop import Scheduler

logger = logging.getLogger(__name__)

# Speculation is off for steps with more running sequences than this: verifying k tokens per sequence costs about k
# times the compute of a decode step, which is free while a step is bound by reading the weights (small batches on
# CPU) and a loss once it is bound by the matrix products. 8 sequences of 8 verified tokens also fill the fused CPU
# step's default 64 rows. A drafted row pays when its token is accepted with a probability above b*c / (a + b*c)
# for b running sequences, a step costing a + c per row: on a 2-core Zen 4, SmolLM2-135M (c ~ a / 3) needs 0.57 at 4
# sequences and 0.72 at 8; the 1.7B shape less per row but its verify rows keep both activation terms where a plain
# step of 8 rows takes one.
SPEC_MAX_BATCH = 8
# NGRAM's drafts are accepted less often (~0.65 of drafted tokens on copy-heavy answers, ~0.45 on free chat; a draft
# model's ~0.95): measured with a mix of both, 2 / 4 / 8 concurrent requests ran 1.18-1.19x / 0.97-1.05x / 0.92-0.99x
# the plain server's tok/s (benchmarks/RESULTS.md, "Speculative decoding on the Zen 4 class"), so NGRAM stops above 4.
NGRAM_MAX_BATCH = 4


# After a verify step in which a request kept none of its draft, it drafts again only after this many plain steps,
# doubling with each further miss up to MAX_BACKOFF: a verify step costs more than a plain step (one row per
# verified position), which free text, whose drafts mostly miss, would pay for nothing.
MAX_BACKOFF = 16


class DraftState:
    """A request's drafting state: the n-gram index of its tokens, how many tokens it drafts next (at most 2 x kept + 1
    after a partial match, twice as many after a full one, within 1..max_draft) and the back-off after misses."""

    def __init__(self, index: TokenIndex, budget: int) -> None:
        self.index = index
        self.budget = budget
        self.skip = 0
        self.backoff = 0

    def update(self, accepted: int, drafted: int, max_draft: int) -> None:
        if accepted == drafted:
            self.budget = min(max_draft, self.budget * 2)
        else:
            self.budget = max(1, min(self.budget, 2 * accepted + 1))
        if accepted == 0:
            self.backoff = min(MAX_BACKOFF, max(1, 2 * self.backoff))
            self.skip = self.backoff
        else:
            self.backoff = 0


class Speculator:
    """What every algorithm shares: the verify step, applying its result, and the accept-length statistics. A
    subclass proposes the drafts and hears what became of them."""

    name = ""

    def __init__(self, max_draft: int, max_batch: int = SPEC_MAX_BATCH) -> None:
        self.max_draft = max_draft
        self.max_batch = max_batch  # speculation pauses while more requests than this run
        self.logged_large_batch = False
        # Accept length (tokens a request gains per verify, the bonus token included) since the last decode log,
        # and the last logged value (for /metrics).
        self.window_tokens = 0
        self.window_steps = 0
        self.accept_length = 0.0

    # ---- what an algorithm provides ------------------------------------------------------------------
    def propose(self, sched: Scheduler, reqs: list[Req]) -> list[DraftTree]:
        """Each request's draft (empty: it decodes one token this step)."""
        raise NotImplementedError

    def after_verify(self, req: Req, accepted: int, draft: DraftTree) -> None:
        """`req` kept `accepted` tokens of `draft` (a path from its root; it may have finished and been released
        meanwhile)."""

    def adopt_branches(self, reqs: list[Req], spec: VerifyInputs, paths: list[list[int]]) -> None:
        """Before the accepted nodes' slots move into their requests' rows: whatever else the algorithm keeps per
        request row and position of a verified node off its tree's main path (it ran in a spare row)."""

    def discard(self, req: Req, draft: DraftTree) -> None:
        """A proposed draft is not verified (the step runs as a plain decode step)."""

    def on_release(self, req: Req) -> None:
        """`req` left the running batch (finished, aborted or retracted) and freed its KV."""

    def idle_error(self) -> Optional[str]:
        """With no request running: what the algorithm still holds that it should not, or None."""
        return None

    def flush(self) -> None:
        """/flush_cache with no request running: forget what earlier requests left (as the prefix cache does)."""

    def draft_used_tokens(self) -> int:
        return 0

    # ---- drafting -------------------------------------------------------------------------------------
    @staticmethod
    def can_draft(req: Req) -> bool:
        params = req.sampling_params
        if params.has_penalties() or req.custom_logit_processor is not None or req.grammar is not None:
            return False
        return len(req.output_ids) >= params.min_new_tokens

    def room(self, req: Req, row_width: int) -> int:
        """The longest draft `req` may take this step (0: none)."""
        if not self.can_draft(req):
            return 0
        return max(0, min(self.max_draft, req.sampling_params.max_new_tokens - len(req.output_ids) - 1,
                          row_width - req.seqlen - 1))

    def verify_batch(self, sched: Scheduler) -> Optional[ScheduleBatch]:
        """The verify step for the running requests, or None when no request has a draft (plain decode runs)."""
        reqs = list(sched.running)
        # Image requests (M-RoPE positions) and adapter requests (the verify forward carries no LoRA ids) decode
        # one token at a time, and so does the step they are in.
        if any(req.mm_inputs is not None or req.lora_path is not None for req in reqs):
            return None
        if len(reqs) > self.max_batch:
            if not self.logged_large_batch:
                logger.info("Speculative decoding pauses while more than %d requests run", self.max_batch)
                self.logged_large_batch = True
            return None
        drafts = fit_trees(sched.mem, self.propose(sched, reqs))
        if not any(drafts) or verify_slots_needed(reqs, drafts) > sched.mem.available_tokens():
            for req, draft in zip(reqs, drafts):
                if draft:
                    self.discard(req, draft)
            return None
        allocate_verify_slots(sched.mem, reqs, drafts)
        batch = ScheduleBatch(reqs, is_decode=True)  # its results are decode results (one or more tokens each)
        batch.spec_verify = verify_inputs(sched.mem, reqs, drafts, sched.runner.vocab_size, sched.runner.device)
        return batch

    # ---- results --------------------------------------------------------------------------------------
    def process_verify(self, sched: Scheduler, batch: ScheduleBatch, result: StepOutput) -> list[Req]:
        """Apply a verify step: each request appends the tokens of its accepted path and the bonus token, one at a
        time as plain decoding appends its token; the requests to report (finished or streaming)."""
        sched.forward_ct += 1
        spec: VerifyInputs = batch.spec_verify
        assert result.sample is not None
        predicted = result.sample.next_token_ids.tolist()
        paths = [draft.accepted_path(predicted[first : first + 1 + len(draft)])
                 for first, draft in zip(spec.first_rows, spec.drafts)]
        self.adopt_branches(batch.reqs, spec, paths)
        spec.settle(sched.mem, batch.reqs, paths)
        outputs: list[Req] = []
        now = time.monotonic()
        for i, req in enumerate(batch.reqs):
            first, draft, path = spec.first_rows[i], spec.drafts[i], paths[i]
            try:
                inject_fault(req)
                before = len(req.output_ids)
                report = False
                for row in [first] + [first + 1 + node for node in path]:
                    report = _process_req(sched, batch, i, req, result, first, row, predicted, now)
                    if req.finished():
                        break
                req.spec_verify_ct += 1
                if draft:
                    self.after_verify(req, len(path), draft)
                gained = len(req.output_ids) - before
                req.spec_accepted_drafts += max(0, gained - 1)
                self.window_tokens += gained
                self.window_steps += 1
            except Exception as e:  # noqa: BLE001 - isolate the failure to this request
                report = fail_request(sched, req, e)
            if report:
                outputs.append(req)
        maybe_log_decode(sched)
        return outputs

    def on_plain_decode(self, batch: ScheduleBatch) -> None:
        """A decode step without drafts: one token per request (accept length 1)."""
        for req in batch.reqs:
            req.spec_verify_ct += 1
        self.window_tokens += len(batch.reqs)
        self.window_steps += len(batch.reqs)

    def take_accept_length(self) -> float:
        """The mean accept length since the last call (the decode log line's), kept for /metrics."""
        if self.window_steps:
            self.accept_length = self.window_tokens / self.window_steps
            self.window_tokens = self.window_steps = 0
        return self.accept_length


class NgramSpeculator(Speculator):
    name = "NGRAM"

    def __init__(self, args: ServerArgs) -> None:
        assert args.speculative_num_draft_tokens is not None
        super().__init__(args.speculative_num_draft_tokens - 1, NGRAM_MAX_BATCH)
        self.min_window = args.speculative_ngram_min_match_window_size
        self.max_window = args.speculative_ngram_max_match_window_size
        self.shared = NgramCache(self.min_window, self.max_window, args.speculative_ngram_capacity)
        self.shape = TreeShape(args.speculative_ngram_match_type, args.speculative_ngram_min_bfs_breadth,
                               args.speculative_ngram_max_bfs_breadth, self.min_window, self.max_window,
                               args.speculative_ngram_branch_length)
        logger.info("Speculative decoding: NGRAM, up to %d tokens verified per step (a %s tree of breadth %d-%d, "
                    "branches of up to %d tokens), match window %d-%d, cache of %d tokens, off above %d running "
                    "requests", args.speculative_num_draft_tokens, self.shape.match_type, self.shape.min_breadth,
                    self.shape.max_breadth, self.shape.branch_length, self.min_window, self.max_window,
                    args.speculative_ngram_capacity, self.max_batch)

    def propose(self, sched: Scheduler, reqs: list[Req]) -> list[DraftTree]:
        table = sched.mem.req_to_token_pool.req_to_token
        return [self.draft(req, table.shape[1]) for req in reqs]

    def draft(self, req: Req, row_width: int) -> DraftTree:
        room = self.room(req, row_width)
        if room <= 0:
            return DraftTree()
        state = req.spec_state
        if state is None:
            state = req.spec_state = DraftState(TokenIndex(self.min_window, self.max_window), self.max_draft)
            state.index.extend(req.all_ids())
        else:
            state.index.extend(req.output_ids[len(state.index.tokens) - len(req.origin_input_ids):])
        if state.skip > 0:
            state.skip -= 1
            return DraftTree()
        return propose_draft(state.index, self.shared, min(room, state.budget), self.shape)

    def after_verify(self, req: Req, accepted: int, draft: DraftTree) -> None:
        req.spec_state.update(accepted, draft.depth(), self.max_draft)

    def on_release(self, req: Req) -> None:
        """A finished request's tokens join the shared n-gram cache."""
        if req.finished():
            self.shared.add(req.all_ids())

    def flush(self) -> None:
        """The shared n-gram cache emptied (SGLang's NGRAM worker clears its cache on /flush_cache too)."""
        self.shared.clear()


class StandaloneSpeculator(Speculator):
    """A draft model proposes --speculative-num-steps tokens per step, greedily, for every request that may draft."""

    name = "STANDALONE"

    def __init__(self, args: ServerArgs, draft: DraftModel) -> None:
        assert args.speculative_num_steps is not None and args.speculative_num_draft_tokens is not None
        super().__init__(args.speculative_num_steps)
        self.draft = draft
        shape = ("chain draft" if draft.topk == 1 else
                 f"a tree of up to {args.speculative_num_draft_tokens - 1} nodes from the top {draft.topk} per step")
        logger.info("Speculative decoding: %s, %s, %d steps (%d tokens verified per step, %s), "
                    "draft KV cache of %d tokens, off above %d running requests", self.name, draft.description,
                    args.speculative_num_steps, args.speculative_num_draft_tokens, shape,
                    draft.mem.max_total_num_tokens, self.max_batch)

    def propose(self, sched: Scheduler, reqs: list[Req]) -> list[DraftTree]:
        table = sched.mem.req_to_token_pool.req_to_token
        steps = [min(self.room(req, table.shape[1]), self.draft.max_steps(req)) for req in reqs]
        # Run the draft only when the verify step will find its KV slots (the largest drafts it can make: a main path
        # of k tokens, plus the tree's other nodes).
        extra = max(0, self.draft.tree_size - 1) if self.draft.topk > 1 else 0
        largest = [(k + extra, k) if k else (0, 0) for k in steps]
        if not any(steps) or slots_for_draft_sizes(reqs, largest) > sched.mem.available_tokens():
            return [DraftTree() for _ in reqs]
        if self.draft.topk > 1:
            return self.draft.propose_trees(reqs, steps)
        return [DraftTree.chain(tokens) for tokens in self.draft.propose(reqs, steps)]

    def after_verify(self, req: Req, accepted: int, draft: DraftTree) -> None:
        self.draft.settle(req, accepted)

    def discard(self, req: Req, draft: DraftTree) -> None:
        self.draft.settle(req, 0)

    def on_release(self, req: Req) -> None:
        self.draft.release(req)

    def idle_error(self) -> Optional[str]:
        return self.draft.idle_error()

    def draft_used_tokens(self) -> int:
        return self.draft.used_tokens()


class EagleSpeculator(StandaloneSpeculator):
    """An EAGLE or EAGLE3 head proposes the draft from the served model's hidden states (speculative/eagle_draft.py)."""

    name = "EAGLE"

    def __init__(self, args: ServerArgs, draft: EagleDraft) -> None:
        self.name = args.speculative_algorithm or self.name
        super().__init__(args, draft)
        self.hidden = draft.hidden

    def adopt_branches(self, reqs: list[Req], spec: VerifyInputs, paths: list[list[int]]) -> None:
        """The served model's hidden states of the accepted nodes that ran in spare rows become their requests' rows'
        (the head's next catch-up reads them there); the spare rows' states are dropped."""
        if not any(spec.spare_slots):
            return
        rows = spec.forward_batch.req_pool_indices.tolist()
        spare: set[int] = set()
        try:
            for req, draft, first, path in zip(reqs, spec.drafts, spec.first_rows, paths):
                node_rows = rows[first + 1 : first + 1 + len(draft)]
                spare.update(r for r in node_rows if r != req.req_pool_idx)
                moved = [n for n in path if node_rows[n] != req.req_pool_idx]
                if moved:
                    depths = draft.depths()
                    self.hidden.adopt(req.req_pool_idx, [req.seqlen - 1 + depths[n] for n in moved],
                                      [node_rows[n] for n in moved])
        except Exception:  # noqa: BLE001 - the head's next drafts may be worse; the outputs are the served model's
            logger.exception("The hidden states of a draft tree's accepted branch were not moved")
        for row in spare:
            self.hidden.drop(row)


def create_speculator(sched: Scheduler) -> Optional[Speculator]:
    """The server's speculator (None when speculative decoding is off); STANDALONE loads its draft model here, EAGLE
    its head."""
    args = sched.args
    if args.speculative_algorithm is None or args.is_embedding:
        return None
    if args.speculative_algorithm in EAGLE_ALGORITHMS:
        head = EagleDraft.load_eagle(args, sched.runner, sched.context_len, sched.max_total_num_tokens,
                                     SPEC_MAX_BATCH)
        return EagleSpeculator(args, head)
    if args.speculative_algorithm == "STANDALONE":
        draft = DraftModel.load(args, sched.runner.vocab_size, sched.tokenizer, sched.max_total_num_tokens,
                                SPEC_MAX_BATCH)
        return StandaloneSpeculator(args, draft)
    return NgramSpeculator(args)
