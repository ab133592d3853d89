"""Per-step sampling tensors built from the requests that sample a token in this forward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from sglang.srt.constrained.base_grammar_backend import allocate_bitmask, apply_bitmask
from sglang.srt.sampling.custom_logit_batch import CustomLogitProcessors
from sglang.srt.sampling.penalties import BatchedPenalties, MinNewTokensMask, SparseLogitBias


@dataclass
class SamplingBatchInfo:
    vocab_size: int
    device: torch.device
    # Per-row knobs. None when every row is greedy: the argmax path needs none of them, and skipping them
    # keeps a greedy decode step free of host-to-device copies.
    temperatures: Optional[torch.Tensor]  # float32 [B, 1]
    top_ps: Optional[torch.Tensor]  # float32 [B]
    top_ks: Optional[torch.Tensor]  # int64 [B], clamped to vocab_size (so "whole vocabulary" == vocab_size)
    min_ps: Optional[torch.Tensor]  # float32 [B]
    # Flags that let the sampler skip work. They describe the non-greedy rows only: a greedy row's top_k=1
    # never forces the sort.
    is_all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    # Rows that are sampled rather than argmax-ed, as a list and as an index tensor (None when every row is),
    # and the index tensor of the argmax-ed rows (None when every row or no row is argmax-ed).
    sampled_row_ids: list[int]
    sampled_rows: Optional[torch.Tensor]
    greedy_rows: Optional[torch.Tensor]
    # Host copies of top_ks / top_ps: the sampler sizes its partial sort from them without a device sync.
    top_k_values: list[int]
    top_p_values: list[float]
    # Per-row randomness: a row's draw depends only on (seed, step), never on the rest of the batch.
    seeds: list[int]
    steps: list[int]
    # History-dependent adjustments, kept sparse: (row, token id) pairs only.
    penalties: Optional[BatchedPenalties]
    logit_bias: Optional[SparseLogitBias]
    min_tokens_mask: Optional[MinNewTokensMask]
    # Grammar constraints: an int32 token bitmask [B, ceil(V / 32)] and the rows it applies to, filled by
    # fill_grammar_bitmask (rows of requests without a grammar are left out).
    grammar_bitmask: Optional[torch.Tensor] = None
    grammar_rows: Optional[list[int]] = None
    # Row i samples from row logit_rows[i] of the forward's logits.
    logit_rows: list[int] = field(default_factory=list)
    # Logprobs of the chosen tokens, with per-row top-k and chosen-id extras (None when no row wants them).
    return_logprob: bool = False
    top_logprobs_nums: Optional[list[int]] = None
    token_ids_logprobs: Optional[list[Optional[list[int]]]] = None
    # Client-sent processors (--enable-custom-logit-processor), applied last, each to its own rows.
    custom_logit_processors: Optional[CustomLogitProcessors] = None

    @classmethod
    def from_reqs(cls, reqs: list, vocab_size: int, device, logit_rows: Optional[list[int]] = None
                  ) -> SamplingBatchInfo:
        device = torch.device(device)
        seeds: list[int] = []
        steps: list[int] = []
        sampled: list[int] = []
        greedy: list[int] = []
        penalized: list[int] = []
        biased: list[int] = []
        below_min: list[int] = []
        # One pass over the requests: this runs for every decode step.
        for i, req in enumerate(reqs):
            params = req.sampling_params
            seeds.append(int(req.sampling_seed))
            steps.append(len(req.output_ids))
            (greedy if params.is_greedy() else sampled).append(i)
            if params.has_penalties():
                penalized.append(i)
            if params.logit_bias:
                biased.append(i)
            if steps[-1] < params.min_new_tokens:
                below_min.append(i)

        want_logprob = any(r.return_logprob for r in reqs)
        temperatures = top_ps = top_ks = min_ps = None
        sampled_rows = greedy_rows = None
        top_k_values: list[int] = []
        top_p_values: list[float] = []
        need_top_p = need_top_k = need_min_p = False
        if sampled:
            params_list = [r.sampling_params for r in reqs]
            top_k_values = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params_list]
            top_p_values = [p.top_p for p in params_list]
            knobs = torch.tensor([(p.temperature, p.top_p, p.min_p) for p in params_list], dtype=torch.float32)
            knobs = knobs.to(device)
            temperatures, top_ps, min_ps = knobs[:, 0:1], knobs[:, 1], knobs[:, 2]
            top_ks = torch.tensor(top_k_values, dtype=torch.int64, device=device)
            need_top_p = any(top_p_values[i] < 1.0 for i in sampled)
            need_top_k = any(top_k_values[i] < vocab_size for i in sampled)
            need_min_p = any(params_list[i].min_p > 0.0 for i in sampled)
            if greedy:
                sampled_rows = torch.tensor(sampled, dtype=torch.int64, device=device)
                greedy_rows = torch.tensor(greedy, dtype=torch.int64, device=device)

        return cls(
            vocab_size=vocab_size,
            device=device,
            temperatures=temperatures,
            top_ps=top_ps,
            top_ks=top_ks,
            min_ps=min_ps,
            is_all_greedy=not sampled,
            need_top_p=need_top_p,
            need_top_k=need_top_k,
            need_min_p=need_min_p,
            sampled_row_ids=sampled,
            sampled_rows=sampled_rows,
            greedy_rows=greedy_rows,
            top_k_values=top_k_values,
            top_p_values=top_p_values,
            seeds=seeds,
            steps=steps,
            penalties=BatchedPenalties.from_reqs(reqs, penalized, device),
            logit_bias=SparseLogitBias.from_reqs(reqs, biased, device),
            min_tokens_mask=MinNewTokensMask.from_reqs(reqs, below_min, vocab_size, device),
            logit_rows=list(range(len(reqs))) if logit_rows is None else logit_rows,
            return_logprob=want_logprob,
            top_logprobs_nums=[r.top_logprobs_num if r.return_logprob else 0 for r in reqs] if want_logprob else None,
            token_ids_logprobs=[r.token_ids_logprob if r.return_logprob else None for r in reqs]
            if want_logprob else None,
            custom_logit_processors=CustomLogitProcessors.from_reqs(reqs),
        )

    @property
    def batch_size(self) -> int:
        return len(self.seeds)

    def modifies_logits(self) -> bool:
        return (
            self.logit_bias is not None
            or self.penalties is not None
            or self.min_tokens_mask is not None
            or self.grammar_bitmask is not None
            or self.custom_logit_processors is not None
        )

    def apply_logit_processing(self, logits: torch.Tensor) -> None:
        """In place on float32 logits [B, V]: bias, penalties, min_new_tokens mask, grammar mask, then the custom
        logit processors (after the grammar mask, as SGLang orders them)."""
        if self.logit_bias is not None:
            self.logit_bias.apply(logits)
        if self.penalties is not None:
            self.penalties.apply(logits)
        if self.min_tokens_mask is not None:
            self.min_tokens_mask.apply(logits)
        if self.grammar_bitmask is not None:
            apply_bitmask(logits, self.grammar_bitmask, self.grammar_rows)
        if self.custom_logit_processors is not None:
            self.custom_logit_processors.apply(logits)

    def fill_grammar_bitmask(self, reqs: list) -> None:
        """Ask each constrained request's matcher which tokens may come next."""
        rows = [i for i, req in enumerate(reqs) if req.grammar is not None and not req.grammar.is_terminated()]
        if not rows:
            return
        bitmask = allocate_bitmask(len(reqs), self.vocab_size)
        for i in rows:
            reqs[i].grammar.fill_bitmask(bitmask, i)
        self.grammar_bitmask, self.grammar_rows = bitmask, rows
