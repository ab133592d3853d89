"""The scheduler process: receive requests, pick prefill or decode batches, run them, emit token ids."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Optional

import torch
import zmq

from sglang.srt.constrained.base_grammar_backend import create_grammar_backend
from sglang.srt.layers.small_batch_rows import resolve_small_batch_rows
from sglang.srt.lora.manager import LoraManager
from sglang.srt.managers.finish_reason import ABORT_BEFORE_PREFILL, FinishAbort, bad_request
from sglang.srt.managers.io_struct import (
    AbortReq,
    ExpertDistributionReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    SchedulerInfo,
    SchedulerStartupError,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.scheduler.embedding import embedding_req, run_embedding_batch
from sglang.srt.managers.scheduler.expert_record import ExpertRecordControl
from sglang.srt.managers.scheduler.grammar import GrammarQueue
from sglang.srt.managers.scheduler.lora import LORA_MESSAGES, LoraControl
from sglang.srt.managers.scheduler.output import (
    build_output_message,
)
from sglang.srt.managers.scheduler.policy import SchedulePolicy
from sglang.srt.managers.scheduler.prefill_adder import PrefillAdder
from sglang.srt.managers.scheduler.priority import PriorityGate, by_priority
from sglang.srt.managers.scheduler.results import fail_batch, process_result
from sglang.srt.managers.scheduler.speculative import create_speculator
from sglang.srt.managers.scheduler.stats import check_memory, internal_state, log_prefill
from sglang.srt.managers.scheduler.watchdog import ForwardWatchdog
from sglang.srt.managers.scheduler.weight_update import WEIGHT_MESSAGES, WeightControl
from sglang.srt.managers.scheduler.window_memory import hybrid_window_spec
from sglang.srt.mem_cache.memory_pools import build_memory_pools
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_loader.model_info import ModelInfo
from sglang.srt.sampling.custom_logit_batch import check_custom_logit_processor
from sglang.srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
# Requests whose first tokens (this many) match another request admitted in the same prefill batch, with
# nothing of them cached yet, are deferred a round so the shared prefix is computed once.
IN_BATCH_PREFIX_LEN = 32


class Scheduler:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, model_info: ModelInfo, tokenizer) -> None:
        self.args = server_args
        self.tokenizer = tokenizer
        if server_args.enable_custom_logit_processor:
            logger.warning("--enable-custom-logit-processor is set: requests may send custom logit processors, "
                           "which are unpickled and run here. This executes code sent by clients; enable it only "
                           "for clients you trust.")
        ctx = zmq.Context(2)
        self.recv_from_tokenizer = ctx.socket(zmq.PULL)
        self.recv_from_tokenizer.bind(port_args.scheduler_input_ipc_name)
        self.dp_rank = port_args.dp_rank
        self.send_to_detokenizer = ctx.socket(zmq.PUSH)
        self.send_to_detokenizer.connect(port_args.detokenizer_ipc_name)

        self.runner = ModelRunner(
            model_dir=model_info.model_dir,
            hf_config=model_info.hf_config,
            dtype=model_info.dtype,
            device=server_args.device,
            gguf_path=model_info.gguf_path,
            gguf_kernel_max_rows=resolve_small_batch_rows(server_args.gguf_kernel_max_rows, model_info.arithmetic),
            arithmetic=model_info.arithmetic,
        )
        self.lora = LoraControl(self, LoraManager.for_server(server_args, self.runner.model, self.runner.dtype))
        self.is_embedding = server_args.is_embedding
        if self.runner.pooling_output is not None and not self.is_embedding:
            raise ValueError(
                f"{type(self.runner.model).__name__} is an embedding, reward or cross-encoder model; launch the "
                "server with --is-embedding"
            )
        # Pooled requests need their whole sequence in one forward: no prefix reuse (an encoder's states depend
        # on the tokens after them) and no chunking.
        self.mem = build_memory_pools(
            self.runner.kv_cache_spec(), self.runner.device, model_info.context_len, server_args.max_total_tokens,
            server_args.mem_fraction_static, server_args.max_running_requests,
            server_args.disable_radix_cache or self.is_embedding,
            hybrid_window_spec(server_args, self.runner.model, model_info.hf_config, self.is_embedding),
        )
        self.runner.bind_kv_pool(self.mem.kv_pool)
        self.context_len = model_info.context_len
        self.max_total_num_tokens = self.mem.max_total_num_tokens
        self.max_running_requests = self.mem.max_running_requests
        self.max_req_len = min(self.context_len - 1, self.mem.max_request_tokens - 1)
        self.max_req_input_len = self.max_req_len - 5
        self.eos_token_ids = set(model_info.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.policy = SchedulePolicy(server_args.schedule_policy, self.mem.tree_cache, server_args.random_seed)
        self.rng = random.Random(server_args.random_seed)
        backend = create_grammar_backend(  # pooled requests are never constrained
            "none" if self.is_embedding else server_args.grammar_backend, tokenizer, self.runner.vocab_size,
            sorted(self.eos_token_ids),
        )
        self.grammar_queue = GrammarQueue(backend, server_args.grammar_compile_timeout)
        # Jump-forward re-prefills the forced tokens through the prefix cache, so it needs the cache.
        self.enable_jump_forward = (
            backend is not None and server_args.use_jump_forward() and not server_args.disable_radix_cache
        )
        self.num_jump_forward_tokens = 0

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Optional[Req] = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.forward_ct = 0
        self.num_generated_tokens = 0
        self.last_log_time = time.monotonic()
        self.last_gen_throughput = 0.0
        self.total_prompt_tokens = 0
        self.total_cached_tokens = 0
        self.invariant_error: Optional[str] = None
        self.expert_record = ExpertRecordControl.for_server(server_args, model_info.hf_config)
        self.weight_control = WeightControl(self)
        self.watchdog = ForwardWatchdog(server_args.watchdog_timeout)
        self.speculator = create_speculator(self)
        # Runs before each receive (block or not); tensor-parallel rank 0 heartbeats its other ranks (tp_worker.py)
        self.idle_wait: Optional[Callable[[zmq.Socket, bool], None]] = None

    def info(self) -> SchedulerInfo:
        return SchedulerInfo(
            max_total_num_tokens=self.max_total_num_tokens,
            max_req_input_len=self.max_req_input_len,
            max_running_requests=self.max_running_requests,
            context_len=self.context_len,
            weight_bytes=self.runner.weight_bytes,
            kv_bytes=self.mem.kv_bytes,
            kv_pools=self.mem.pool_report(),
            # the effective row limit: --gguf-kernel-max-rows where given, else the plan's
            arithmetic=({**self.runner.arithmetic.to_dict(), "small_batch_max_rows": self.runner.gguf_kernel_max_rows}
                        if self.runner.arithmetic is not None else {}),
            dp_rank=self.dp_rank,
            weights=dict(self.runner.weights_by_format),
            decode_path=self.runner.decode_plan.description if self.runner.decode_plan is not None else "",
        )

    # ---- main loop ------------------------------------------------------------------------------------
    def event_loop(self) -> None:
        while True:
            self.weight_control.run_pending()
            self.lora.run_pending()
            self.recv_requests(block=self.is_idle() and not self.grammar_queue)
            if self.grammar_queue:
                self.admit_compiled_grammars()
            self.process_aborts()
            batch = self.get_next_batch()
            if batch is None:
                if self.is_idle():
                    if self.grammar_queue:
                        self.recv_from_tokenizer.poll(timeout=5)  # wait for a message or a compile
                    else:
                        check_memory(self)
                continue
            if self.is_embedding:
                with self.watchdog.guard("embedding"):
                    self.send_to_detokenizer.send_pyobj(run_embedding_batch(self, batch))
                continue
            if batch.spec_verify is not None:
                forward_batch, sampling = batch.spec_verify.forward_batch, batch.spec_verify.sampling
            else:
                forward_batch, sampling = batch.forward_inputs(self.mem, self.runner.vocab_size, self.runner.device)
            self.expert_record.begin_pass(self.forward_ct, batch, forward_batch)
            try:
                with self.watchdog.guard(forward_batch.forward_mode.name.lower()):
                    result = self.runner.forward(forward_batch, sampling)
            except Exception as e:  # noqa: BLE001 - the batch's requests fail, the server keeps serving
                finished_or_streamed = fail_batch(self, batch, e)
            else:
                finished_or_streamed = process_result(self, batch, result)
            finally:
                self.expert_record.end_pass()
            if finished_or_streamed:
                self.send_to_detokenizer.send_pyobj(build_output_message(finished_or_streamed))

    def is_idle(self) -> bool:
        """Nothing to run (requests waiting for a grammar compile run nothing yet)."""
        return not self.waiting and not self.running and self.chunked_req is None

    def recv_requests(self, block: bool) -> None:
        flags = 0 if block else zmq.NOBLOCK
        if self.idle_wait is not None:
            self.idle_wait(self.recv_from_tokenizer, block)
        while True:
            try:
                msg = self.recv_from_tokenizer.recv_pyobj(flags)
            except zmq.ZMQError:
                return
            self.handle_message(msg)
            flags = zmq.NOBLOCK

    def handle_message(self, msg) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            self.add_request(msg)
        elif isinstance(msg, TokenizedEmbeddingReqInput):
            self.waiting.append(embedding_req(msg))
        elif isinstance(msg, AbortReq):
            self.abort(msg)
        elif isinstance(msg, FlushCacheReq):
            self.send_to_detokenizer.send_pyobj(FlushCacheReqOutput(self.flush_cache()))
        elif isinstance(msg, ExpertDistributionReq):
            self.send_to_detokenizer.send_pyobj(self.expert_record.handle(msg))
        elif isinstance(msg, GetInternalStateReq):
            self.send_to_detokenizer.send_pyobj(GetInternalStateReqOutput(internal_state(self)))
        elif isinstance(msg, WEIGHT_MESSAGES):
            self.weight_control.handle(msg)
        elif isinstance(msg, LORA_MESSAGES):
            reply = self.lora.handle(msg)
            if reply is not None:  # an unload in use answers once its requests finished (lora.run_pending)
                self.send_to_detokenizer.send_pyobj(reply)
        else:
            logger.error("Unknown message: %r", type(msg))

    def add_request(self, msg: TokenizedGenerateReqInput) -> None:
        params = msg.sampling_params
        seed = params.sampling_seed if params.sampling_seed is not None else self.rng.randrange(1 << 62)
        stop_ids = set(self.eos_token_ids) | set(params.stop_token_ids or ())
        req = Req(
            rid=msg.rid,
            origin_input_ids=list(msg.input_ids),
            sampling_params=params,
            stop_token_ids=stop_ids,
            sampling_seed=seed,
            return_logprob=msg.return_logprob,
            logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num,
            token_ids_logprob=msg.token_ids_logprob,
            stream=msg.stream,
            priority=msg.priority,
            mm_inputs=msg.mm_inputs,
            custom_logit_processor=msg.custom_logit_processor,
            lora_path=msg.lora_path,
        )
        params = req.sampling_params  # the request's own copy when it has custom_params
        cap = self.max_req_len - len(req.origin_input_ids) - 1
        if params.max_new_tokens is None or params.max_new_tokens > cap:
            params.max_new_tokens = max(cap, 0)
        lora_refusal = self.lora.check_request(req)
        if lora_refusal is not None:
            req.finished_reason = bad_request(lora_refusal)
            self._enqueue(req)
            return
        if msg.custom_logit_processor is not None:
            refusal = check_custom_logit_processor(msg.custom_logit_processor, self.args.enable_custom_logit_processor)
            if refusal is not None:
                req.finished_reason = bad_request(refusal)
                self._enqueue(req)
                return
        if self.grammar_queue.submit(req) is not None:
            self._enqueue(req)

    def _enqueue(self, req: Req) -> None:
        if req.finished():
            self.send_to_detokenizer.send_pyobj(build_output_message([req]))
        else:
            self.waiting.append(req)

    def admit_compiled_grammars(self) -> None:
        for req in self.grammar_queue.pop_ready():
            self._enqueue(req)

    # ---- aborts ---------------------------------------------------------------------------------------
    def abort(self, msg: AbortReq) -> None:
        def match(req: Req) -> bool:
            return msg.abort_all or req.rid.startswith(msg.rid)

        for req in [r for r in self.waiting if match(r)] + self.grammar_queue.remove_matching(match):
            if req in self.waiting:
                self.waiting.remove(req)
            logger.debug("Abort queued request %s", req.rid)
            req.finished_reason = FinishAbort(ABORT_BEFORE_PREFILL)
            self.send_to_detokenizer.send_pyobj(build_output_message([req]))
        for req in self.running + ([self.chunked_req] if self.chunked_req else []):
            if match(req) and req.to_abort is None:
                logger.debug("Abort running request %s", req.rid)
                req.to_abort = FinishAbort("Abort in waiting queue" if req.is_chunked else "Aborted by request")

    def process_aborts(self) -> None:
        aborted = [r for r in self.running if r.to_abort is not None]
        if self.chunked_req is not None and self.chunked_req.to_abort is not None:
            aborted.append(self.chunked_req)
            self.chunked_req = None
        if not aborted:
            return
        self.running = [r for r in self.running if r.to_abort is None]
        for req in aborted:
            req.finished_reason = req.to_abort
            self.release(req)
        self.send_to_detokenizer.send_pyobj(build_output_message(aborted))

    def release(self, req: Req) -> None:
        """Hand a request's KV to the prefix cache (or free it) and free its row."""
        if req.req_pool_idx is not None:
            self.mem.tree_cache.cache_finished_req(req)
            req.req_pool_idx = None
        if self.speculator is not None:
            self.speculator.on_release(req)

    # ---- batch selection ------------------------------------------------------------------------------
    def get_next_batch(self) -> Optional[ScheduleBatch]:
        self.mem.release_out_of_window(self.running + ([self.chunked_req] if self.chunked_req is not None else []))
        if self.waiting or self.chunked_req is not None:
            batch = self.get_prefill_batch()
            if batch is not None:
                return batch
        if self.running:
            return self.get_decode_batch()
        return None

    def get_prefill_batch(self) -> Optional[ScheduleBatch]:
        adder = PrefillAdder(
            self.mem, self.running, self.new_token_ratio, self.args.max_prefill_tokens,
            None if self.is_embedding else self.args.chunked_prefill_size, self.max_running_requests,
        )
        if self.chunked_req is not None:
            if not adder.add_chunked(self.chunked_req):
                return None
        prefixes_in_batch: set[tuple[int, ...]] = set()
        gate = PriorityGate()
        for req in by_priority(self.policy.order(self.waiting)):
            head = tuple(req.fill_ids[:IN_BATCH_PREFIX_LEN])
            if len(head) == IN_BATCH_PREFIX_LEN and len(req.prefix_indices) < IN_BATCH_PREFIX_LEN:
                # Another request of this batch computes the same uncached prefix: wait one round and take
                # it from the cache instead of computing it twice.
                if head in prefixes_in_batch:
                    continue
                prefixes_in_batch.add(head)
            if not self.lora.admits(req, adder.selected):
                continue  # its adapter would exceed --max-loras-per-batch: a later batch takes it
            if not gate.admits(req, adder.selected) or not adder.add(req):
                break
        if not adder.selected:
            return None
        chosen = {id(r) for r in adder.selected}
        self.waiting = [r for r in self.waiting if id(r) not in chosen]
        self.chunked_req = adder.new_chunked_req
        batch = ScheduleBatch(adder.selected, is_decode=False)
        batch.prepare_for_extend(self.mem)
        cached = 0
        for req, prefix_len in zip(batch.reqs, batch.prefix_lens):
            if prefix_len > req.already_computed:
                req.cached_tokens += prefix_len - req.already_computed
                cached += prefix_len - req.already_computed
            req.already_computed = len(req.fill_ids)
        self.total_cached_tokens += cached
        self.total_prompt_tokens += sum(batch.extend_lens) + cached
        log_prefill(self, batch, cached)
        return batch

    def get_decode_batch(self) -> ScheduleBatch:
        while self.mem.available_tokens() < len(self.running) and len(self.running) > 1:
            self.retract_one()
        self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
        if self.speculator is not None:
            verify = self.speculator.verify_batch(self)
            if verify is not None:
                return verify
        batch = ScheduleBatch(list(self.running), is_decode=True)
        batch.prepare_for_decode(self.mem)
        return batch

    def retract_one(self) -> None:
        """Free the KV of the request with the least progress; it re-runs later from its tokens so far."""
        victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        self.running.remove(victim)
        self.release(victim)
        victim.reset_for_retract()
        self.waiting.insert(0, victim)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
        logger.info("Retract request %s (#running-req: %d)", victim.rid, len(self.running))

    # ---- cache control (invariants, state and logs: stats.py) ------------------------------------------
    def flush_cache(self) -> bool:
        if not self.is_idle():
            return False
        self.mem.clear()
        if self.speculator is not None:
            self.speculator.flush()
        logger.info("Cache flushed successfully!")
        return True

def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, model_info: ModelInfo, pipe_writer
                          ) -> None:
    """Entry point of the scheduler process."""
    from sglang.srt.managers.process_utils import configure_child_process, load_tokenizer_for

    configure_child_process(server_args, "scheduler")
    if server_args.num_threads:
        torch.set_num_threads(server_args.num_threads)
    try:
        tokenizer = load_tokenizer_for(server_args)
        scheduler = Scheduler(server_args, port_args, model_info, tokenizer)
    except Exception as e:  # report the failure to the parent instead of dying silently
        logger.exception("Scheduler failed to start")
        pipe_writer.send(SchedulerStartupError(f"{type(e).__name__}: {e}"))
        return
    pipe_writer.send(scheduler.info())
    scheduler.event_loop()
