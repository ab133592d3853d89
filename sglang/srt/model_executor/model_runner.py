"""Loads the model, owns the KV memory, and runs one forward + sampling step for a ScheduleBatch."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import psutil
import torch

from sglang.srt.forward_batch import ForwardBatch, ForwardMode, build_positions
from sglang.srt.layers.attention.torch_sdpa_backend import TorchSDPABackend
from sglang.srt.layers.fused_decode import build_fused_decode
from sglang.srt.layers.sampler import SampleOutput, Sampler, compute_logprobs
from sglang.srt.managers.schedule_batch import MemoryPools, ScheduleBatch
from sglang.srt.mem_cache.allocator import TokenSlotAllocator
from sglang.srt.mem_cache.kv_pool import KVPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.req_to_token import ReqToTokenPool
from sglang.srt.model_loader.gguf_quant import attach_gguf_quant_weights
from sglang.srt.model_loader.loader import load_model
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

logger = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What one forward produced: logits rows per ScheduleBatch.logit_positions, and samples for sample rows."""

    logits: Optional[torch.Tensor]
    sample: Optional[SampleOutput]
    sample_reqs: list
    # logprobs [num_logit_rows, vocab] when any request asked for input logprobs
    input_logprobs: Optional[torch.Tensor]


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        hf_config,
        dtype: torch.dtype,
        device: str,
        context_len: int,
        max_total_tokens: Optional[int],
        mem_fraction_static: float,
        max_running_requests: Optional[int],
        disable_radix_cache: bool,
        gguf_path: Optional[str] = None,
        gguf_kernel_max_rows: int = 0,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.hf_config = hf_config
        self.context_len = context_len
        self.model = load_model(model_dir, dtype, self.device)
        self.quant_bytes = 0
        if gguf_path and gguf_kernel_max_rows > 0 and self.device.type == "cpu":
            self.quant_bytes = attach_gguf_quant_weights(self.model, gguf_path, hf_config, gguf_kernel_max_rows)
        self.vocab_size = hf_config.vocab_size
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

        num_layers = hf_config.num_hidden_layers
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        per_token = KVPool.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
        self.max_total_num_tokens = max_total_tokens or self._profile_kv_tokens(per_token, mem_fraction_static)
        if max_running_requests is None:
            max_running_requests = max(1, min(self.max_total_num_tokens // 2, 256))
        self.max_running_requests = max_running_requests
        self.kv_bytes = per_token * self.max_total_num_tokens

        req_to_token_pool = ReqToTokenPool(max_running_requests + 1, context_len + 8, device=self.device)
        allocator = TokenSlotAllocator(self.max_total_num_tokens, device=self.device)
        kv_pool = KVPool(self.max_total_num_tokens, num_layers, num_kv_heads, head_dim, dtype, self.device)
        tree_cache = RadixCache(req_to_token_pool, allocator, disable=disable_radix_cache)
        self.mem = MemoryPools(req_to_token_pool, allocator, kv_pool, tree_cache)
        # None unless the model has GGUF blocks on every linear layer and the compiled step is available.
        self.fused_decode = build_fused_decode(self.model, kv_pool.k_buffer, kv_pool.v_buffer,
                                               gguf_kernel_max_rows) if self.quant_bytes else None
        if self.fused_decode is not None:
            self.model.model.fused_decode = self.fused_decode
        self.attn_backend = TorchSDPABackend()
        self.sampler = Sampler()

    def _profile_kv_tokens(self, per_token: int, mem_fraction_static: float) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * mem_fraction_static - (total - free)
        else:
            budget = psutil.virtual_memory().available * mem_fraction_static
        tokens = int(budget // per_token)
        if tokens < 256:
            raise RuntimeError(
                f"Not enough memory for the KV cache ({tokens} tokens); raise --mem-fraction-static "
                "or set --max-total-tokens"
            )
        return tokens

    # ---- one step ---------------------------------------------------------------------------------------
    def forward(self, batch: ScheduleBatch) -> StepOutput:
        flat_positions = [p for rows in batch.logit_positions for p in rows]
        if not flat_positions:
            self._forward_logits(batch, [])
            return StepOutput(None, None, [], None)
        logits = self._forward_logits(batch, flat_positions)
        sample_rows, sample_reqs, offset = [], [], 0
        for req, rows, s in zip(batch.reqs, batch.logit_positions, batch.sample_row):
            if s is not None:
                sample_rows.append(offset + s)
                sample_reqs.append(req)
            offset += len(rows)

        input_logprobs = None
        if any(r.return_logprob and len(rows) > (s is not None) for r, rows, s in
               zip(batch.reqs, batch.logit_positions, batch.sample_row)):
            input_logprobs = compute_logprobs(logits)

        sample = None
        if sample_reqs:
            sample_logits = logits if len(sample_rows) == logits.shape[0] else logits[sample_rows]
            info = SamplingBatchInfo.from_reqs(sample_reqs, self.vocab_size, self.device)
            info.fill_grammar_bitmask(sample_reqs)
            want_logprob = any(r.return_logprob for r in sample_reqs)
            sample = self.sampler(
                sample_logits,
                info,
                return_logprob=want_logprob,
                top_logprobs_nums=[r.top_logprobs_num if r.return_logprob else 0 for r in sample_reqs]
                if want_logprob else None,
                token_ids_logprobs=[r.token_ids_logprob if r.return_logprob else None for r in sample_reqs]
                if want_logprob else None,
            )
        return StepOutput(logits, sample, sample_reqs, input_logprobs)

    @torch.inference_mode()
    def _forward_logits(self, batch: ScheduleBatch, flat_positions: list[int]) -> torch.Tensor:
        mode = ForwardMode.DECODE if batch.is_decode else ForwardMode.EXTEND
        dev = self.device
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(batch.reqs),
            input_ids=torch.tensor(batch.input_ids, dtype=torch.int64, device=dev),
            positions=build_positions(batch.prefix_lens, batch.extend_lens, dev),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in batch.reqs], dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int64, device=dev),
            out_cache_loc=batch.out_cache_loc.to(dev),
            seq_lens_cpu=batch.seq_lens,
            extend_prefix_lens_cpu=batch.prefix_lens,
            extend_seq_lens_cpu=batch.extend_lens,
            req_to_token_pool=self.mem.req_to_token_pool,
            token_to_kv_pool=self.mem.kv_pool,
            attn_backend=self.attn_backend,
            logits_indices=torch.tensor(flat_positions, dtype=torch.int64, device=dev),
        )
        self.attn_backend.init_forward_metadata(fb)
        return self.model(fb.input_ids, fb.positions, fb)
