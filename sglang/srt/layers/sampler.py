"""The sampler: processed logits -> next token ids, plus the logprobs a request asked for.

Pipeline per step (batched over rows): float32 logits -> logit_bias -> repetition penalty -> frequency and
presence penalties -> min_new_tokens mask -> grammar vocab mask -> custom logit processors -> logprobs (taken here,
before temperature)
-> greedy rows: argmax; other rows: temperature, top-k / top-p / min-p, then one draw per row.

The draw is inverse-CDF sampling with one uniform number per row, and that number is a hash of
(request seed, decoding step) computed on the host. A row's token therefore depends only on its own logits,
seed and step: a seeded request samples the same tokens whatever else is in the batch and wherever its row
sits, the global RNG is never touched, and no per-row generator has to fill a vocabulary-sized noise buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.layers import cpu_ops
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

_MASK64 = (1 << 64) - 1
# Rows asking for top-p look at this many of their most likely tokens first, then at more; only a row whose
# nucleus is wider than the last probe (a very flat distribution) pays for a full sort of the vocabulary.
_TOP_P_PROBES = (256, 4096)


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # int64 [B]
    next_token_logprobs: Optional[torch.Tensor] = None  # float32 [B]: logprob of the chosen token
    top_logprobs: Optional[list[Optional[tuple[list[float], list[int]]]]] = None
    token_ids_logprobs: Optional[list[Optional[list[float]]]] = None
    # Rows whose custom logit processor failed, with why (their tokens must not be used).
    failed_rows: Optional[dict[int, str]] = None


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """argmax of each row of float32 logits [B, V]; on CPU in one compiled pass (cpu_ops.argmax_rows, the same
    index as torch.argmax)."""
    if logits.device.type == "cpu" and logits.dim() == 2 and cpu_ops.available():
        return cpu_ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def get_top_logprobs(logprobs: torch.Tensor, k: list[int]) -> list[Optional[tuple[list[float], list[int]]]]:
    """Per row i: (values, token ids) of the k[i] largest logprobs, descending; None where k[i] <= 0."""
    out: list[Optional[tuple[list[float], list[int]]]] = [None] * len(k)
    rows = [i for i, n in enumerate(k) if n and n > 0]
    if not rows:
        return out
    k_max = min(max(k[i] for i in rows), logprobs.shape[-1])
    source = logprobs if len(rows) == logprobs.shape[0] else logprobs[rows]
    top_values, top_ids = source.topk(k_max, dim=-1)
    values, ids = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        out[i] = (values[j][: k[i]], ids[j][: k[i]])
    return out


def get_token_ids_logprobs(
    logprobs: torch.Tensor, token_ids: list[Optional[list[int]]]
) -> list[Optional[list[float]]]:
    """Per row i: the logprobs of token_ids[i], in the given order; None where no ids were asked for."""
    out: list[Optional[list[float]]] = [None] * len(token_ids)
    for i, ids in enumerate(token_ids):
        if ids:
            index = torch.tensor(ids, dtype=torch.int64, device=logprobs.device)
            out[i] = logprobs[i].index_select(0, index).tolist()
    return out


def row_uniform(seed: int, step: int) -> float:
    """A uniform number in [0, 1 - 2**-52] from (seed, step), mixed with the splitmix64 finalizer.

    52 bits (not 53) keep u * total strictly below total in float64, so the draw never runs off the CDF."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return (x >> 12) / float(1 << 52)


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_nums: Optional[list[int]] = None,
        token_ids_logprobs: Optional[list[Optional[list[int]]]] = None,
    ) -> SampleOutput:
        if logits.shape[-1] != info.vocab_size:
            raise ValueError(f"logits have {logits.shape[-1]} columns but the batch expects {info.vocab_size}")
        if info.modifies_logits():
            # Copy: the caller's logits must stay untouched (they may be reused for prompt logprobs).
            logits = logits.to(torch.float32, copy=True)
            info.apply_logit_processing(logits)
        elif logits.dtype != torch.float32:
            logits = logits.float()

        if info.is_all_greedy:
            next_ids = greedy_ids(logits)
        elif info.sampled_rows is None:
            next_ids = self._sample(logits, info)
        else:
            next_ids = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
            next_ids[info.greedy_rows] = greedy_ids(logits[info.greedy_rows])
            next_ids[info.sampled_rows] = self._sample(logits[info.sampled_rows], info)

        out = SampleOutput(next_token_ids=next_ids)
        if info.custom_logit_processors is not None and info.custom_logit_processors.failures:
            out.failed_rows = info.custom_logit_processors.failures
        if return_logprob:
            logprobs = torch.log_softmax(logits, dim=-1)
            out.next_token_logprobs = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
            if top_logprobs_nums is not None and any(n and n > 0 for n in top_logprobs_nums):
                out.top_logprobs = get_top_logprobs(logprobs, top_logprobs_nums)
            if token_ids_logprobs is not None and any(token_ids_logprobs):
                out.token_ids_logprobs = get_token_ids_logprobs(logprobs, token_ids_logprobs)
        return out

    # ---- non-greedy rows -------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Sample one token for each of the info.sampled_row_ids rows, whose logits are given [b, V]."""
        rows = info.sampled_row_ids
        index = info.sampled_rows
        pick = (lambda t: t) if index is None else (lambda t: t[index])
        # Unnormalized probabilities, each row scaled so that its largest entry is exactly 1. One buffer,
        # updated in place: on CPU every fresh [b, V] allocation costs page faults.
        weights = logits / pick(info.temperatures)
        weights.sub_(weights.amax(dim=-1, keepdim=True)).exp_()

        if info.need_top_k or info.need_top_p or info.need_min_p:
            threshold = torch.zeros(len(rows), 1, dtype=weights.dtype, device=weights.device)
            if info.need_top_k or info.need_top_p:
                ks = [info.top_k_values[i] for i in rows]
                ps = [info.top_p_values[i] for i in rows]
                threshold = _top_k_top_p_thresholds(weights, ks, ps, pick(info.top_ks), pick(info.top_ps))
            if info.need_min_p:
                # min_p is relative to the most likely token, whose weight is 1 here.
                threshold = torch.maximum(threshold, pick(info.min_ps).unsqueeze(1))
            weights.masked_fill_(weights < threshold, 0.0)

        uniforms = [row_uniform(info.seeds[i], info.steps[i]) for i in rows]
        u = torch.tensor(uniforms, dtype=torch.float64, device=weights.device).unsqueeze(1)
        cdf = weights.cumsum(dim=-1)
        total = cdf[:, -1:]
        # Strictly below the total, so that some CDF entry exceeds the target.
        target = torch.minimum((u * total.double()).to(cdf.dtype), torch.nextafter(total, torch.zeros_like(total)))
        # A zero-weight token adds a flat step to the CDF, so it is never the first entry above the target.
        choice = torch.searchsorted(cdf, target, right=True).squeeze(1)
        # A row with no mass left (every token masked, or NaN logits) falls back to token 0, which is
        # what argmax returns for an all -inf row.
        return torch.where(total.squeeze(1) > 0, choice.clamp_(max=weights.shape[-1] - 1), 0)


def _top_k_top_p_thresholds(
    weights: torch.Tensor, ks: list[int], ps: list[float], top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """Per row, the smallest weight that survives its top-k and top-p cuts, as a [b, 1] tensor.

    `weights` are unnormalized probabilities [b, V]. Comparing against a value (instead of keeping ranks)
    keeps every token tied at the cut, which makes the result independent of how a sort orders ties, and so
    of how many columns were sorted."""
    vocab = weights.shape[-1]
    thresholds = torch.zeros(len(ks), 1, dtype=weights.dtype, device=weights.device)
    pending = [j for j in range(len(ks)) if ks[j] < vocab or ps[j] < 1.0]
    for probe in _TOP_P_PROBES + (vocab,):
        if not pending:
            break
        width = min(vocab, max(min(ks[j], probe) if ps[j] < 1.0 else ks[j] for j in pending))
        if len(pending) == len(ks):
            index: slice | torch.Tensor = slice(None)
            sub, sub_ks, sub_ps = weights, top_ks, top_ps
        else:
            index = torch.tensor(pending, dtype=torch.int64, device=weights.device)
            sub, sub_ks, sub_ps = weights[index], top_ks[index], top_ps[index]
        # The top-p mass is relative to the row's total weight (a float32 sum is precise enough for a cut).
        totals = sub.sum(dim=-1, keepdim=True).double() if any(ps[j] < 1.0 for j in pending) else None
        top = sub.topk(width, dim=-1).values if width < vocab else sub.sort(dim=-1, descending=True).values
        values, covered = _thresholds_from_sorted(top, totals, sub_ks, sub_ps, vocab)
        thresholds[index] = values
        # Rows whose nucleus reaches past `width` columns try again with a wider probe.
        pending = [j for j, ok in zip(pending, covered.tolist()) if not ok]
    return thresholds


def _thresholds_from_sorted(
    top: torch.Tensor, totals: Optional[torch.Tensor], top_ks: torch.Tensor, top_ps: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """From each row's `width` largest weights (descending) and its total weight (None when no row uses
    top-p): the cut value [n, 1], and whether the cut is certain to fall inside those `width` columns [n]."""
    width = top.shape[-1]
    kth = top.gather(1, (top_ks.clamp(max=width) - 1).unsqueeze(1))
    cut = torch.where((top_ks < vocab).unsqueeze(1), kth, torch.zeros_like(kth))
    covered = (top_ks <= width) | (width >= vocab)
    if totals is not None:
        # The token at rank r is in the nucleus while the mass ranked before it is <= top_p of the total.
        mass_before = top.cumsum(dim=-1, dtype=torch.float64) - top.double()
        in_nucleus = (mass_before <= top_ps.double().unsqueeze(1) * totals).sum(dim=-1)
        last = top.gather(1, (in_nucleus - 1).clamp(min=0).unsqueeze(1))
        cut = torch.maximum(cut, torch.where((top_ps < 1.0).unsqueeze(1), last, torch.zeros_like(last)))
        covered |= in_nucleus < width
    return cut, covered
