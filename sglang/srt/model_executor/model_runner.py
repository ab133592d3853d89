"""Loads the model and runs one forward (+ sampling) for the ForwardBatch it is given.

The runner is a pure executor: the scheduler owns requests and memory (mem_cache/memory_pools.py), builds the
ForwardBatch and the sampling inputs, and calls `forward`. Nothing here imports the managers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from sglang import huge_pages
from sglang.srt.distributed.parallel_state import get_tp_group
from sglang.srt.distributed.partition import head_partition
from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers import cpu_ops
from sglang.srt.layers.arithmetic import ArithmeticPlan
from sglang.srt.layers.attention.torch_sdpa_backend import TorchSDPABackend
from sglang.srt.layers.cpu_buffers import reuse_large_buffers
from sglang.srt.layers.linear import held_parameter
from sglang.srt.layers.pooler import Pooler
from sglang.srt.layers.quantization.gguf_linear import rows_alone, set_gguf_activations
from sglang.srt.layers.sampler import SampleOutput, Sampler, compute_logprobs
from sglang.srt.lora.layers import LoraBatchState, lora_rows
from sglang.srt.mem_cache.kv_pool import KVPool
from sglang.srt.mem_cache.memory_pools import KVCacheSpec
from sglang.srt.model_executor.decode_strategy import DecodePlan, plan_decode
from sglang.srt.model_loader.checkpoint_blocks import linears_released_for_checkpoint_blocks, release_made_blocks
from sglang.srt.model_loader.dtype import checkpoint_dtype
from sglang.srt.model_loader.gemm_methods import attach_large_batch_gemm, blocks_large_method
from sglang.srt.model_loader.gguf_experts import experts_read_from_file
from sglang.srt.model_loader.gguf_quant import attach_gguf_quant_weights, linears_read_from_file
from sglang.srt.model_loader.gguf_tables import tables_read_from_file
from sglang.srt.model_loader.int_blocks import checkpoint_block_reason
from sglang.srt.model_loader.loader import load_model
from sglang.srt.model_loader.moe_blocks import (
    attach_expert_blocks,
    experts_released_for_checkpoint_blocks,
    has_experts,
    keep_experts_in,
    moe_linears,
)
from sglang.srt.model_loader.pooling_config import read_pooling_config
from sglang.srt.model_loader.q8_blocks import attach_q8_0_blocks, decoder_linears, keep_linears_in
from sglang.srt.model_loader.quant_config import resolve_quantization
from sglang.srt.model_loader.weight_report import describe_weights, weight_bytes_by_format
from sglang.srt.model_loader.weights import weight_files
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

logger = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What one forward produced: logits for `forward_batch.logits_indices`, and the sampled tokens."""

    logits: Optional[torch.Tensor]
    sample: Optional[SampleOutput]
    # logprobs [num_logit_rows, vocab] when the batch asked for input logprobs
    input_logprobs: Optional[torch.Tensor]


def blocks_only(gguf_kernel_max_rows: int, arithmetic: Optional[ArithmeticPlan], device: torch.device) -> bool:
    """Whether the plan serves every batch of this checkpoint from blocks (the GGUF file's, or made at load:
    model_loader/q8_blocks.py), one copy of the weights, so that its linear weights may load in the checkpoint's
    own dtype and are released once their blocks are attached."""
    # Tensor-parallel ranks keep their shards dense: the ranks after the first run no blocks (tp_worker.py).
    return (arithmetic is not None and arithmetic.large_batch_weights == "blocks" and gguf_kernel_max_rows > 0
            and device.type == "cpu" and arithmetic.weight_dtype == torch.float32 and get_tp_group().size == 1)


def load_for_plan(model_dir: str, dtype: torch.dtype, device: torch.device, gguf_path: Optional[str],
                  gguf_kernel_max_rows: int, arithmetic: Optional[ArithmeticPlan], config: Any = None) -> Any:
    """The model of `model_dir` loaded as the plan serves it: where blocks serve every batch, the linear weights
    of a plain checkpoint are read in its dtype (bf16 / fp16), never widened to float32 in full, and those of a GGUF
    file in bf16 (its blocks serve, and are checked against them)."""
    prepare = None
    if blocks_only(gguf_kernel_max_rows, arithmetic, device):
        # A GGUF file's converted weights are float32 (its values exactly); its blocks are checked against their bf16
        # rounding, which halves what the load holds before the linear weights are released.
        stored = torch.bfloat16 if gguf_path else checkpoint_dtype(config if config is not None else model_dir)
        scheme = None if gguf_path else resolve_quantization(model_dir, None)
        block_source = scheme is not None and checkpoint_block_reason(scheme) is None
        if stored in (torch.bfloat16, torch.float16):
            def prepare(meta_model: Any) -> Optional[Callable[[Any], None]]:
                experts = has_experts(meta_model)
                reason = (keep_experts_in(meta_model, stored, from_gguf=bool(gguf_path)) if experts
                          else keep_linears_in(meta_model, stored, keep_table=not gguf_path))
                if reason is not None:
                    logger.info("Linear weights load as %s: %s", dtype, reason)
                if not gguf_path:  # a quantized checkpoint's experts or linears: the blocks of its integers alone
                    if not block_source or scheme is None:
                        return None
                    linears = linears_released_for_checkpoint_blocks(meta_model, weight_files(model_dir), scheme,
                                                                     moe_linears if experts else decoder_linears)
                    return both(experts_released_for_checkpoint_blocks(meta_model) if experts else None, linears)
                # a GGUF file's blocks are read from the file alone: those weights never exist as floats
                releases = [linears_read_from_file(meta_model, gguf_path),
                            experts_read_from_file(meta_model, gguf_path) if experts else None]
                read = [name for name, one in zip(("linear layers", "experts"), releases) if one is not None]
                if releases[0] is not None:  # the vocabulary-sized tables too, where the file's blocks serve them
                    tables, names = tables_read_from_file(meta_model, gguf_path)
                    releases.append(tables)
                    read += names
                if read:
                    logger.info("GGUF %s read from the file's blocks alone (never loaded as floats)",
                                " and ".join([", ".join(read[:-1]), read[-1]] if len(read) > 1 else read))
                return both(*releases)
    return load_model(model_dir, dtype, device, config=config, prepare=prepare)


def both(*releases: Optional[Callable[[Any], None]]) -> Optional[Callable[[Any], None]]:
    """One function running each of `releases` that is given (None where none is)."""
    given = [one for one in releases if one is not None]
    if not given:
        return None

    def release(allocated: Any) -> None:
        for one in given:
            one(allocated)

    return release


def attach_fast_paths(model: Any, gguf_path: Optional[str], hf_config: Any, gguf_kernel_max_rows: int,
                      arithmetic: Optional[ArithmeticPlan]) -> int:
    """Give a freshly loaded model its derived weight copies (GGUF blocks for small batches, the large-batch GEMM
    copies) and, on CPU, moves its weights into huge pages (sglang/huge_pages.py); returns the copies' bytes. Every
    loaded model goes through here, at startup and after a weight update."""
    param = held_parameter(model)
    only_blocks = blocks_only(gguf_kernel_max_rows, arithmetic, param.device)
    large = (blocks_large_method(arithmetic.large_batch_gemm, arithmetic.block_gemm)
             if only_blocks and arithmetic is not None else None)
    # the experts' large batches multiply their blocks (no int8 copy of every expert)
    expert_large = (blocks_large_method(arithmetic.block_gemm, arithmetic.block_gemm)
                    if large is not None and arithmetic is not None else None)
    int8_experts = arithmetic is not None and arithmetic.gguf_activations == "int8"
    quant_bytes = 0
    if gguf_path and gguf_kernel_max_rows > 0 and param.device.type == "cpu":
        quant_bytes = attach_gguf_quant_weights(model, gguf_path, hf_config, gguf_kernel_max_rows, large,
                                                expert_large, int8_experts)
    if arithmetic is not None and arithmetic.small_batch_quantization != "none":
        qtype = arithmetic.small_batch_quantization.upper()
        if has_experts(model):  # whatever the file's blocks do not serve (layers/experts that did not match)
            quant_bytes += attach_expert_blocks(model, gguf_kernel_max_rows, large, qtype, arithmetic.gguf_activations,
                                               expert_large)
        elif quant_bytes == 0:
            quant_bytes = attach_q8_0_blocks(model, gguf_kernel_max_rows, large, qtype)
    only_blocks = only_blocks and quant_bytes > 0
    if (arithmetic is not None and not only_blocks and param.device.type == "cpu"
            and param.dtype == torch.float32):
        quant_bytes += attach_large_batch_gemm(model, arithmetic.large_batch_gemm)
    if arithmetic is not None:
        set_gguf_activations(model, arithmetic.gguf_activations, arithmetic.int8_one_term_rows)
    release_made_blocks(model)  # blocks a quantized checkpoint's reading made that no layer took (none attached)
    if param.device.type == "cpu":  # the weights are final; the fused decode step takes their addresses later
        logger.info("Memory pages: %s", huge_pages.move_weights(model))
    return quant_bytes


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        hf_config: Any,
        dtype: torch.dtype,
        device: str,
        gguf_path: Optional[str] = None,
        gguf_kernel_max_rows: int = 0,
        arithmetic: Optional[ArithmeticPlan] = None,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.hf_config = hf_config
        self.gguf_kernel_max_rows = gguf_kernel_max_rows
        # Built from the served config (--json-model-override-args applied), the one the KV pool is sized from.
        self.model = load_for_plan(model_dir, dtype, self.device, gguf_path, gguf_kernel_max_rows, arithmetic,
                                   config=hf_config)
        self.arithmetic = arithmetic
        self.quant_bytes = attach_fast_paths(self.model, gguf_path, hf_config, gguf_kernel_max_rows, arithmetic)
        self.vocab_size = hf_config.get_text_config().vocab_size
        self.weights_by_format: dict[str, int] = {}
        self.weight_bytes = 0
        self.account_weights()
        if self.device.type == "cpu":  # after the load: weights and their load-time copies never pass through it
            logger.info("Activation buffers: %s", reuse_large_buffers())
        self.attn_backend = TorchSDPABackend()
        if arithmetic is not None and self.device.type == "cpu" and cpu_ops.available():
            cpu_ops.set_extend_attention_bf16(arithmetic.prefill_attention == "bfloat16")
        self.sampler = Sampler()
        self.decode_plan: Optional[DecodePlan] = None
        # Embedding / reward / cross-encoder models produce one row per sequence instead of logits.
        self.pooling_output: Optional[str] = getattr(self.model, "pooling_output", None)
        self.is_encoder = bool(getattr(self.model, "is_encoder", False))
        self.pooler = Pooler(read_pooling_config(model_dir, self.is_encoder))
        # The LoRA segments every adapted layer reads (lora/layers.py); set when the server serves LoRA.
        self.lora_state: Optional[LoraBatchState] = None
        # Called with every forward's final (normed) hidden states when set: EAGLE speculative decoding drafts from
        # the served model's hidden states (speculative/hidden_log.py).
        self.hidden_sink: Optional[Callable[[ForwardBatch, torch.Tensor], None]] = None

    def account_weights(self) -> None:
        """Count the served model's weights by format (every form held: parameters, blocks, GEMM copies) and log
        them in the one `Weights:` line."""
        self.weights_by_format = weight_bytes_by_format(self.model)
        self.weight_bytes = sum(self.weights_by_format.values())
        logger.info(describe_weights(self.model))

    def kv_cache_spec(self) -> KVCacheSpec:
        config = self.hf_config.get_text_config()  # the decoder's settings, also for vision-language configs
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_dtype = self.arithmetic.kv_dtype if self.arithmetic is not None else self.dtype
        latent_dim = getattr(self.model, "kv_latent_dim", None)
        if latent_dim:  # multi-head latent attention caches one latent row per token and layer
            return KVCacheSpec(config.num_hidden_layers, 1, latent_dim, kv_dtype, latent=True)
        # Each tensor-parallel rank caches its own K/V heads (distributed/partition.py, as the model splits them).
        tp = get_tp_group()
        local_kv_heads = head_partition(config.num_attention_heads, num_kv_heads, tp.size, tp.rank).num_kv_heads
        return KVCacheSpec(config.num_hidden_layers, local_kv_heads, head_dim, kv_dtype)

    def bind_kv_pool(self, kv_pool: KVPool) -> None:
        """Choose the decode path for the K/V buffers every forward will use, and log the choice."""
        self.decode_plan = plan_decode(self.model, kv_pool, self.attn_backend, self.gguf_kernel_max_rows,
                                       self.device)
        if self.arithmetic is not None:
            logger.info(self.arithmetic.describe())
        logger.info(self.decode_plan.description)

    # ---- one step ---------------------------------------------------------------------------------------
    def forward(self, forward_batch: ForwardBatch, sampling: Optional[SamplingBatchInfo]) -> StepOutput:
        """Run `forward_batch`; sample one token for each row of `sampling.logit_rows` when sampling is given."""
        logits = self._forward_logits(forward_batch)
        if logits is None:
            return StepOutput(None, None, None)
        input_logprobs = compute_logprobs(logits) if forward_batch.return_input_logprobs else None
        sample = None
        if sampling is not None:
            rows = sampling.logit_rows
            sample_logits = logits if len(rows) == logits.shape[0] else logits[rows]
            sample = self.sampler(
                sample_logits,
                sampling,
                return_logprob=sampling.return_logprob,
                top_logprobs_nums=sampling.top_logprobs_nums,
                token_ids_logprobs=sampling.token_ids_logprobs,
            )
        return StepOutput(logits, sample, input_logprobs)

    @torch.inference_mode()
    def pool(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """float32 [batch, dim]: each sequence's pooled embedding, or its classification scores."""
        forward_batch.attn_backend = self.attn_backend
        if not self.is_encoder:  # encoders attend without the KV cache
            self.attn_backend.init_forward_metadata(forward_batch)
        model: Any = self.model
        if self.pooling_output == "scores":
            return model.forward_scores(forward_batch.input_ids, forward_batch.positions, forward_batch)
        hidden = model.forward_hidden(forward_batch.input_ids, forward_batch.positions, forward_batch)
        return self.pooler(hidden, forward_batch.extend_seq_lens_cpu)

    @torch.inference_mode()
    def _forward_logits(self, forward_batch: ForwardBatch) -> Optional[torch.Tensor]:
        # A verify step's rows (several positions of a sequence) are each computed as plain decoding computes them.
        with rows_alone(forward_batch.rows_share_sequences):
            return self._forward_rows(forward_batch)

    def _forward_rows(self, forward_batch: ForwardBatch) -> Optional[torch.Tensor]:
        fused = self.decode_plan.fused if self.decode_plan is not None else None
        sink = self.hidden_sink
        # The fused decode step adds the LoRA deltas of adapter rows itself; prefills and batches it does not accept
        # (more rows than its max, several rows per sequence) add them layer by layer (lora_rows below).
        # With a sink the step also hands back the hidden states (and the layers the backbone captures).
        if fused is not None and fused.accepts(forward_batch, self.lora_state):
            if sink is None:
                return fused.forward(self.model, forward_batch, self.lora_state)
            logits, hidden = fused.forward_with_hidden(self.model, forward_batch, self.lora_state)
            sink(forward_batch, hidden)
            return logits
        forward_batch.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(forward_batch)
        with lora_rows(self.lora_state, forward_batch.lora_ids, forward_batch.extend_seq_lens_cpu):
            if sink is None:
                logits = self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)
            else:
                hidden = self.model.forward_hidden(forward_batch.input_ids, forward_batch.positions, forward_batch)
                sink(forward_batch, hidden)
                logits = self.model.compute_logits(hidden, forward_batch)
        # A prompt chunk without logprobs only fills the KV cache.
        return logits if logits.shape[0] else None
