"""Request state in the scheduler (`Req`) and the set of requests run in one step (`ScheduleBatch`)."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject
from sglang.srt.forward_batch import ForwardBatch, ForwardMode, build_positions
from sglang.srt.managers.finish_reason import FinishAbort, FinishReason
from sglang.srt.mem_cache.memory_pools import DECODE_SLOT_RUN, MemoryPools, OutOfKVMemory
from sglang.srt.multimodal.forward_inputs import build_multimodal_forward
from sglang.srt.sampling.penalties import RequestPenaltyState
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams


@dataclass
class LogprobState:
    """Logprob entries gathered so far; each value list is aligned with its token id list."""

    input_token_val: list[Optional[float]] = field(default_factory=list)
    input_token_idx: list[int] = field(default_factory=list)
    input_top: list[Any] = field(default_factory=list)
    input_ids_logprobs: list[Any] = field(default_factory=list)
    output_token_val: list[float] = field(default_factory=list)
    output_token_idx: list[int] = field(default_factory=list)
    output_top: list[Any] = field(default_factory=list)
    output_ids_logprobs: list[Any] = field(default_factory=list)


class Req:
    def __init__(
        self,
        rid: str,
        origin_input_ids: list[int],
        sampling_params: SamplingParams,
        stop_token_ids: set[int],
        sampling_seed: int,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        token_ids_logprob: Optional[list[int]] = None,
        stream: bool = False,
        priority: int = 0,
        token_type_ids: Optional[list[int]] = None,
        mm_inputs: Optional[Any] = None,
        custom_logit_processor: Optional[str] = None,
        lora_path: Optional[str] = None,
    ) -> None:
        self.rid = rid
        # The LoRA adapter this request runs with (None: the base model), and the id the prefix cache keys its
        # KV by (lora/manager.py; 0 for the base model).
        self.lora_path = lora_path
        self.lora_uid = 0
        self.origin_input_ids = origin_input_ids
        if isinstance(sampling_params.custom_params, dict):
            # A custom logit processor reads the request through its params, as in SGLang; the dict lives as long
            # as the request, so a processor may keep per-request state in it.
            sampling_params = copy.copy(sampling_params)
            sampling_params.custom_params = {**sampling_params.custom_params, "__req__": self}
        self.sampling_params = sampling_params
        # The serialized CustomLogitProcessor this request runs (sampling/custom_logit_processor.py), or None.
        self.custom_logit_processor = custom_logit_processor
        self.stop_token_ids = stop_token_ids
        self.sampling_seed = sampling_seed
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.token_ids_logprob = token_ids_logprob
        self.stream = stream
        # Larger is admitted first; batch-file lines run below online requests (scheduler/priority.py).
        self.priority = priority
        # Segment ids of a sentence pair for encoders that read them (BERT cross-encoders); None otherwise.
        self.token_type_ids = token_type_ids
        # Images of the prompt and its M-RoPE positions (multimodal/processor.py); None for text prompts.
        self.mm_inputs = mm_inputs

        self.output_ids: list[int] = []
        self.finished_reason: Optional[FinishReason] = None
        self.to_abort: Optional[FinishAbort] = None

        # Memory: row in req_to_token, prefix from the radix tree, slots this request allocated.
        self.req_pool_idx: Optional[int] = None
        self.prefix_indices: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.last_node: Any = None
        self.cache_protected_len = 0
        self.kv_allocated_len = 0
        # Tokens whose K/V should exist after the current prefill (input + outputs, maybe a chunk of it).
        self.fill_ids: list[int] = []
        self.extend_input_len = 0
        self.kv_committed_len = 0  # tokens of the row whose K/V are computed
        # Positions of the row before this gave their window slots back (MemoryPools.release_out_of_window).
        self.window_released_len = 0
        self.is_chunked = False
        self.penalty_state: Optional[RequestPenaltyState] = None
        self.grammar: Optional[BaseGrammarObject] = None

        # Accounting.
        self.cached_tokens = 0
        self.already_computed = 0
        self.retractions = 0
        self.logprobs = LogprobState() if return_logprob else None
        # How much of output_ids / of the (input, output) logprob entries was sent to the detokenizer.
        self.sent_output_len = 0
        self.sent_logprobs: tuple[int, int] = (0, 0)
        self.created_time = time.monotonic()
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        # Speculative decoding (managers/scheduler/speculative.py): its drafting state (n-gram index of its tokens,
        # draft budget), its decode forwards (verify or plain) and the draft tokens it accepted.
        self.spec_state: Any = None
        self.spec_verify_ct = 0
        self.spec_accepted_drafts = 0

    # ---- state helpers -------------------------------------------------------------------------------
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def init_next_round_input(self) -> None:
        self.fill_ids = self.origin_input_ids + self.output_ids

    def input_logprob_start(self) -> int:
        """First prompt position whose token gets an `input_token_logprobs` entry."""
        n = len(self.origin_input_ids)
        if self.logprob_start_len is None or self.logprob_start_len < 0:
            return n - 1
        return min(self.logprob_start_len, n - 1)

    def max_prefix_len(self) -> int:
        """How much of fill_ids may come from the cache: one token must run; input logprobs must be computed."""
        limit = len(self.fill_ids) - 1
        if self.return_logprob and not self.output_ids:
            limit = min(limit, self.input_logprob_start())
        return max(limit, 0)

    def reset_for_retract(self) -> None:
        self.reset_for_reprefill()
        self.already_computed = 0
        self.retractions += 1

    def reset_for_reprefill(self) -> None:
        """Forget the KV placement; the next prefill takes what it can from the prefix cache."""
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.cache_protected_len = 0
        self.kv_allocated_len = 0
        self.kv_committed_len = 0
        self.req_pool_idx = None
        self.extend_input_len = 0
        self.is_chunked = False
        self.penalty_state = None

    def __repr__(self) -> str:
        return f"Req(rid={self.rid}, input={len(self.origin_input_ids)}, output={len(self.output_ids)})"


def decode_run_len(req: Req, pos: int, row_width: int) -> int:
    """How many decode slots a request takes from position `pos` on: a run of DECODE_SLOT_RUN, no more than its
    max_new_tokens can still use or its request-to-token row can hold, and at least the one it needs now."""
    left = row_width - pos
    if req.sampling_params.max_new_tokens is not None:
        left = min(left, req.sampling_params.max_new_tokens - len(req.output_ids))
    return max(1, min(DECODE_SLOT_RUN, left))


class ScheduleBatch:
    """The requests of one forward step and the CPU-side inputs built for it."""

    def __init__(self, reqs: list[Req], is_decode: bool) -> None:
        self.reqs = reqs
        self.is_decode = is_decode
        self.input_ids: list[int] = []
        self.prefix_lens: list[int] = []
        self.extend_lens: list[int] = []
        self.seq_lens: list[int] = []
        self.out_cache_loc: Optional[torch.Tensor] = None
        # Per request: flat token offsets (into input_ids) whose logits are needed, and which of them is the
        # position that samples the next token (None for a chunk that does not finish the prompt).
        self.logit_positions: list[list[int]] = []
        self.sample_row: list[Optional[int]] = []
        # A decode step's int64 inputs (input ids, positions, request rows, sequence lengths), the rows of one tensor
        # built by prepare_for_decode. At batch 1 a step's small tensor ops cost more than its bookkeeping: right
        # after a forward has streamed the weights through the caches each op costs several times its warm cost.
        self.decode_inputs: Optional[tuple[torch.Tensor, ...]] = None
        # A speculative verify step's drafts and inputs (speculative/verify.py VerifyInputs); None otherwise.
        self.spec_verify: Any = None

    def __len__(self) -> int:
        return len(self.reqs)

    def prepare_for_extend(self, mem: MemoryPools) -> None:
        """Allocate rows and slots for each request's fill_ids beyond its cached prefix."""
        table = mem.req_to_token_pool.req_to_token
        total = 0
        for req in self.reqs:
            if req.req_pool_idx is None:
                row = mem.req_to_token_pool.alloc()
                if row is None:
                    raise OutOfKVMemory("no free request row")
                req.req_pool_idx = row
                prefix_len = len(req.prefix_indices)
                if prefix_len:
                    table[row, :prefix_len] = req.prefix_indices
                req.kv_allocated_len = prefix_len
                req.kv_committed_len = prefix_len
                req.window_released_len = 0
            prefix_len = req.kv_committed_len
            ext = len(req.fill_ids) - prefix_len
            req.extend_input_len = ext
            self.prefix_lens.append(prefix_len)
            self.extend_lens.append(ext)
            self.seq_lens.append(prefix_len + ext)
            self.input_ids.extend(req.fill_ids[prefix_len:])
            total += ext
        self.out_cache_loc = mem.alloc_slots(total)
        offset = 0
        for req, prefix_len, ext in zip(self.reqs, self.prefix_lens, self.extend_lens):
            table[req.req_pool_idx, prefix_len : prefix_len + ext] = self.out_cache_loc[offset : offset + ext]
            req.kv_allocated_len = prefix_len + ext
            offset += ext
        self._plan_extend_logits()

    def _plan_extend_logits(self) -> None:
        offset = 0
        for req, prefix_len, ext in zip(self.reqs, self.prefix_lens, self.extend_lens):
            end = prefix_len + ext
            finishes_prompt = end == len(req.origin_input_ids) + len(req.output_ids)
            positions: list[int] = []
            if req.return_logprob and not req.output_ids:
                # Input logprobs: logits at position p score token p+1 of the prompt.
                first = max(prefix_len, req.input_logprob_start())
                positions = list(range(first, min(end, len(req.origin_input_ids) - 1)))
            sample = None
            if finishes_prompt:
                sample = len(positions)
                positions.append(end - 1)
            self.logit_positions.append([offset + p - prefix_len for p in positions])
            self.sample_row.append(sample)
            offset += ext

    def prepare_for_decode(self, mem: MemoryPools) -> None:
        n = len(self.reqs)
        table = mem.req_to_token_pool.req_to_token
        positions = [req.seqlen - 1 for req in self.reqs]
        # Requests whose slots end before this position get a new run of them (MemoryPools.alloc_decode_runs).
        need = [(req, pos) for req, pos in zip(self.reqs, positions) if req.kv_allocated_len <= pos]
        if need:
            wanted = [decode_run_len(req, pos, table.shape[1]) for req, pos in need]
            counts = mem.alloc_decode_runs([req.req_pool_idx for req, _ in need], [pos for _, pos in need], wanted)
            for (req, pos), count in zip(need, counts):
                req.kv_allocated_len = pos + count
        self.input_ids = [req.output_ids[-1] for req in self.reqs]
        self.prefix_lens = positions
        self.extend_lens = [1] * n
        self.seq_lens = [pos + 1 for pos in positions]
        self.logit_positions = [[i] for i in range(n)]
        self.sample_row = [0] * n
        self.decode_inputs = torch.tensor([self.input_ids, positions, [req.req_pool_idx for req in self.reqs],
                                           self.seq_lens], dtype=torch.int64, device=table.device).unbind(0)
        # One indexed read for the batch: an item access per request costs microseconds each.
        self.out_cache_loc = table[self.decode_inputs[2], self.decode_inputs[1]]

    # ---- what the model runner receives -------------------------------------------------------------------
    def forward_inputs(self, mem: MemoryPools, vocab_size: int, device: torch.device
                       ) -> tuple[ForwardBatch, Optional[SamplingBatchInfo]]:
        """The ForwardBatch of this step and the sampling inputs of its sampling rows (None when none samples)."""
        return self.forward_batch(mem, device), self.sampling_inputs(vocab_size, device)

    def forward_batch(self, mem: MemoryPools, device: torch.device) -> ForwardBatch:
        token_type_ids = logits_indices = None
        return_input_logprobs = False
        if self.decode_inputs is not None:
            # A decode step wants every row's logits (logits_indices None), none of them for input logprobs.
            input_ids, positions, req_pool_indices, seq_lens = (
                t if t.device == device else t.to(device) for t in self.decode_inputs)
        else:
            input_ids = torch.tensor(self.input_ids, dtype=torch.int64, device=device)
            positions = build_positions(self.prefix_lens, self.extend_lens, device)
            req_pool_indices = torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64, device=device)
            seq_lens = torch.tensor(self.seq_lens, dtype=torch.int64, device=device)
            flat_positions = [p for rows in self.logit_positions for p in rows]
            logits_indices = torch.tensor(flat_positions, dtype=torch.int64, device=device)
            return_input_logprobs = any(r.return_logprob and len(rows) > (s is not None) for r, rows, s in
                                        zip(self.reqs, self.logit_positions, self.sample_row))
            if any(req.token_type_ids is not None for req in self.reqs):
                types = [t for req in self.reqs for t in (req.token_type_ids or [0] * len(req.origin_input_ids))]
                token_type_ids = torch.tensor(types, dtype=torch.int64, device=device)
        assert self.out_cache_loc is not None
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE if self.is_decode else ForwardMode.EXTEND,
            batch_size=len(self.reqs),
            input_ids=input_ids,
            positions=positions,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            out_cache_loc=self.out_cache_loc.to(device),
            seq_lens_cpu=self.seq_lens,
            extend_prefix_lens_cpu=self.prefix_lens,
            extend_seq_lens_cpu=self.extend_lens,
            req_to_token_pool=mem.req_to_token_pool,
            token_to_kv_pool=mem.kv_pool,
            logits_indices=logits_indices,
            return_input_logprobs=return_input_logprobs,
            token_type_ids=token_type_ids,
            multimodal=build_multimodal_forward([r.mm_inputs for r in self.reqs], self.prefix_lens, self.extend_lens),
            lora_ids=([r.lora_path for r in self.reqs] if any(r.lora_path is not None for r in self.reqs)
                      else None),
        )

    def sampling_inputs(self, vocab_size: int, device: torch.device) -> Optional[SamplingBatchInfo]:
        """Sampling tensors for the requests that sample a token this step (None when none does)."""
        sample_rows, sample_reqs, offset = [], [], 0
        for req, rows, s in zip(self.reqs, self.logit_positions, self.sample_row):
            if s is not None:
                sample_rows.append(offset + s)
                sample_reqs.append(req)
            offset += len(rows)
        if not sample_reqs:
            return None
        sampling = SamplingBatchInfo.from_reqs(sample_reqs, vocab_size, device, logit_rows=sample_rows)
        sampling.fill_grammar_bitmask(sample_reqs)
        return sampling
