"""Logit adjustments that depend on each request's history: penalties, logit_bias, the min_new_tokens mask.

All of them touch only the few token ids involved (the tokens a request has seen, the biased ids, the stop
ids), so they are applied as gathers and scatters over those ids, never as passes over [batch, vocab].

Per-request token statistics live on `req.penalty_state` (a `RequestPenaltyState`). They are built the first
time a penalized request is sampled and then advanced by the tokens appended to `req.output_ids` since the
last step, so the per-step bookkeeping grows with the new tokens, not with the sequence. The scheduler sets
`req.penalty_state = None` when a request is retracted; the next step rebuilds it from scratch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch

# A repetition penalty of exactly 0 would divide positive logits by zero; this floor keeps them finite.
_MIN_REPETITION_PENALTY = 1e-6


@dataclass
class RequestPenaltyState:
    # Distinct penalized token ids (the output's, plus the prompt's when the repetition penalty is on) and
    # how often each occurs in output_ids[:counted_len]; `slot` maps a token id to its position in both.
    ids: torch.Tensor  # int64 [L]
    output_counts: torch.Tensor  # float32 [L]
    slot: dict[int, int]
    counted_len: int
    includes_prompt: bool

    @classmethod
    def build(
        cls, prompt_ids: list[int], output_ids: list[int], includes_prompt: bool, device
    ) -> RequestPenaltyState:
        counts = Counter(output_ids)
        order = list(dict.fromkeys((prompt_ids if includes_prompt else []) + output_ids))
        return cls(
            ids=torch.tensor(order, dtype=torch.int64, device=device),
            output_counts=torch.tensor([float(counts.get(t, 0)) for t in order], dtype=torch.float32, device=device),
            slot={t: i for i, t in enumerate(order)},
            counted_len=len(output_ids),
            includes_prompt=includes_prompt,
        )

    def advance(self, new_ids: list[int], device) -> None:
        appended: list[int] = []
        for token in new_ids:
            pos = self.slot.get(token)
            if pos is None:
                self.slot[token] = len(self.slot)
                appended.append(token)
            elif pos < self.output_counts.shape[0]:
                self.output_counts[pos] += 1.0
            else:  # appended earlier in this same call
                appended.append(token)
        if appended:
            fresh = list(dict.fromkeys(appended))
            tally = Counter(appended)
            self.ids = torch.cat([self.ids, torch.tensor(fresh, dtype=torch.int64, device=device)])
            extra = torch.tensor([float(tally[t]) for t in fresh], dtype=torch.float32, device=device)
            self.output_counts = torch.cat([self.output_counts, extra])
        self.counted_len += len(new_ids)


def sync_penalty_state(req, device) -> RequestPenaltyState:
    """Return req.penalty_state, (re)built or advanced so that it covers all of req.output_ids."""
    needs_prompt = req.sampling_params.repetition_penalty != 1.0
    state: Optional[RequestPenaltyState] = req.penalty_state
    output_ids = req.output_ids
    if state is None or state.counted_len > len(output_ids) or state.includes_prompt != needs_prompt:
        state = RequestPenaltyState.build(req.origin_input_ids, output_ids, needs_prompt, device)
        req.penalty_state = state
    elif state.counted_len < len(output_ids):
        state.advance(output_ids[state.counted_len:], device)
    return state


@dataclass
class BatchedPenalties:
    """The penalized (row, token) pairs of a batch, flattened, with each pair's penalty values."""

    rows: torch.Tensor  # int64 [N]
    ids: torch.Tensor  # int64 [N]; distinct within a row
    output_counts: torch.Tensor  # float32 [N]
    frequency: torch.Tensor  # float32 [N]
    presence: torch.Tensor  # float32 [N]
    repetition: Optional[torch.Tensor]  # float32 [N]; None when no row sets a repetition penalty

    @classmethod
    def from_reqs(cls, reqs: list, rows: list[int], device: torch.device) -> Optional[BatchedPenalties]:
        """`rows`: the indices of the requests with a penalty set."""
        if not rows:
            return None
        states = [sync_penalty_state(reqs[i], device) for i in rows]
        params = [reqs[i].sampling_params for i in rows]
        lengths = torch.tensor([s.ids.shape[0] for s in states], dtype=torch.int64, device=device)

        def per_pair(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device).repeat_interleave(lengths)

        repetition = None
        if any(p.repetition_penalty != 1.0 for p in params):
            repetition = per_pair([max(p.repetition_penalty, _MIN_REPETITION_PENALTY) for p in params])
        return cls(
            rows=torch.tensor(rows, dtype=torch.int64, device=device).repeat_interleave(lengths),
            ids=torch.cat([s.ids for s in states]),
            output_counts=torch.cat([s.output_counts for s in states]),
            frequency=per_pair([p.frequency_penalty for p in params]),
            presence=per_pair([p.presence_penalty for p in params]),
            repetition=repetition,
        )

    def apply(self, logits: torch.Tensor) -> None:
        """Adjust logits [B, V] in place: repetition first, then frequency and presence."""
        values = logits[self.rows, self.ids]
        if self.repetition is not None:
            # Positive logits shrink and negative ones grow more negative, so a penalty > 1 always discourages.
            values = torch.where(values > 0, values / self.repetition, values * self.repetition)
        values = values - self.frequency * self.output_counts - self.presence * (self.output_counts > 0)
        logits[self.rows, self.ids] = values


@dataclass
class SparseLogitBias:
    rows: torch.Tensor  # int64 [N]
    ids: torch.Tensor  # int64 [N]
    values: torch.Tensor  # float32 [N]

    @classmethod
    def from_reqs(cls, reqs: list, rows: list[int], device: torch.device) -> Optional[SparseLogitBias]:
        """`rows`: the indices of the requests with a logit_bias set."""
        pair_rows: list[int] = []
        ids: list[int] = []
        values: list[float] = []
        for i in rows:
            for token_id, bias in (reqs[i].sampling_params.logit_bias or {}).items():
                pair_rows.append(i)
                ids.append(int(token_id))
                values.append(float(bias))
        if not pair_rows:
            return None
        return cls(
            rows=torch.tensor(pair_rows, dtype=torch.int64, device=device),
            ids=torch.tensor(ids, dtype=torch.int64, device=device),
            values=torch.tensor(values, dtype=torch.float32, device=device),
        )

    def apply(self, logits: torch.Tensor) -> None:
        logits.index_put_((self.rows, self.ids), self.values, accumulate=True)

    def to_dense(self, batch_size: int, vocab_size: int) -> torch.Tensor:
        dense = torch.zeros(batch_size, vocab_size, dtype=torch.float32, device=self.values.device)
        self.apply(dense)
        return dense


@dataclass
class MinNewTokensMask:
    """The (row, stop id) pairs whose logits are -inf because the request is still below min_new_tokens."""

    rows: torch.Tensor  # int64 [N]
    ids: torch.Tensor  # int64 [N]

    @classmethod
    def from_reqs(
        cls, reqs: list, rows: list[int], vocab_size: int, device: torch.device
    ) -> Optional[MinNewTokensMask]:
        """`rows`: the indices of the requests that have not yet reached their min_new_tokens."""
        pair_rows: list[int] = []
        ids: list[int] = []
        for i in rows:
            # A stop id outside the vocabulary can never be sampled, so it needs no mask.
            stop_ids = sorted(t for t in reqs[i].stop_token_ids or () if 0 <= t < vocab_size)
            pair_rows.extend([i] * len(stop_ids))
            ids.extend(stop_ids)
        if not pair_rows:
            return None
        return cls(
            rows=torch.tensor(pair_rows, dtype=torch.int64, device=device),
            ids=torch.tensor(ids, dtype=torch.int64, device=device),
        )

    def apply(self, logits: torch.Tensor) -> None:
        logits[self.rows, self.ids] = float("-inf")
