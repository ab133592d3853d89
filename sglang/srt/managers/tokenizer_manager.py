"""Tokenizer manager: validates and tokenizes requests, sends them to the scheduler, gathers outputs."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Optional

import zmq
import zmq.asyncio

from sglang.srt.lora.adapter import parse_lora_paths
from sglang.srt.lora.request import check_lora_path
from sglang.srt.managers.control_channel import ControlChannel
from sglang.srt.managers.data_parallel.dispatcher import check_data_parallel_rank
from sglang.srt.managers.embedding_manager import NOT_GENERATION_MODEL, handle_embedding_output
from sglang.srt.managers.finish_reason import ABORT_BEFORE_PREFILL, FinishAbort, FinishReason
from sglang.srt.managers.generate_input import GenerateItem, GenerateReqInput
from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    SchedulerInfo,
    SchedulerState,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.logprob_format import LogprobFormatter
from sglang.srt.managers.prompt_limits import allowed_input_len, check_output_limits, check_token_ids
from sglang.srt.managers.request_errors import (
    InternalRequestError,
    RequestRefused,
    check_queue_capacity,
    wait_until,
)
from sglang.srt.managers.rw_lock import RWLock
from sglang.srt.metrics import ServerMetrics, is_structured_output
from sglang.srt.model_loader.model_info import ModelInfo
from sglang.srt.multimodal.request_images import RequestImages, check_image_request
from sglang.srt.sampling.custom_logit_batch import CUSTOM_LOGIT_PROCESSOR_DISABLED
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)


@dataclass
class ReqState:
    """Outputs of one request gathered so far, and an event set whenever more arrive."""

    rid: str
    created: float
    event: asyncio.Event = field(default_factory=asyncio.Event)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: Optional[FinishReason] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    retractions: int = 0
    spec_verify_ct: int = 0  # speculative decoding: decode forwards of the request, and draft tokens it accepted
    spec_accepted_drafts: int = 0
    sent_output_ids: int = 0  # output ids streamed so far (--stream-output sends only the ones after them)
    log_metrics: bool = True  # counted in /metrics (health probes are not)
    has_grammar: bool = False
    logprobs: Optional[LogprobFormatter] = None
    first_output_time: Optional[float] = None
    last_output_time: Optional[float] = None
    # The pooled row of an --is-embedding request.
    embedding: Optional[list[float]] = None
    # Event-loop time after which the request is aborted (--request-timeout); None: no limit.
    deadline: Optional[float] = None
    # Set when the request cannot finish (a worker died): raised to its waiter.
    error: Optional[RequestRefused] = None


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, tokenizer, model_info: ModelInfo,
                 scheduler_info: SchedulerInfo) -> None:
        self.server_args = server_args
        # LoRA adapter name -> path, as served (--lora-paths, then /load_lora_adapter and /unload_lora_adapter).
        self.lora_adapters: dict[str, str] = parse_lora_paths(server_args.lora_paths or [])
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.scheduler_info = scheduler_info
        self.context_len = model_info.context_len
        # The KV cache bounds a prompt below the context length: the scheduler reports the bound at startup.
        self.max_req_input_len = scheduler_info.max_req_input_len
        self.vocab_size = model_info.vocab_size
        self.images = RequestImages(model_info, server_args)
        self.preferred_sampling_params = (
            json.loads(server_args.preferred_sampling_params) if server_args.preferred_sampling_params else {}
        )
        self.ctx = zmq.asyncio.Context(2)
        self.send_to_scheduler = self.ctx.socket(zmq.PUSH)
        self.send_to_scheduler.connect(port_args.scheduler_input_ipc_name)
        self.recv_from_detokenizer = self.ctx.socket(zmq.PULL)
        self.recv_from_detokenizer.bind(port_args.tokenizer_ipc_name)
        self.rid_to_state: dict[str, ReqState] = {}
        # Looked up at each send: data parallelism replaces the socket by its dispatcher after construction.
        self.control = ControlChannel(lambda msg: self.send_to_scheduler.send_pyobj(msg), server_args.dp_size,
                                      self._ensure_recv_loop)
        # Generation reads, a weight update (managers/weight_update_client.py) writes.
        self.model_update_lock = RWLock()
        self.recv_task: Optional[asyncio.Task] = None
        self.recv_loop_owner: Optional[asyncio.AbstractEventLoop] = None
        self.metrics: Optional[ServerMetrics] = (
            ServerMetrics(server_args.served_model_name) if server_args.enable_metrics else None
        )

    # ---- request path ---------------------------------------------------------------------------------
    def tokenize_item(self, item: GenerateItem) -> TokenizedGenerateReqInput:
        """Validate one expanded item (see GenerateReqInput.expand) and tokenize it. Raises ValueError."""
        if item.text is not None:
            if self.tokenizer is None:
                raise ValueError(
                    "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. Please "
                    "provide input_ids or re-initialize the engine with skip_tokenizer_init=False."
                )
            input_text = item.text
            input_ids = self.tokenizer.encode(input_text)
        else:
            input_text = None
            input_ids = list(item.input_ids or [])
            check_token_ids(input_ids, self.vocab_size)
        input_ids, mm_inputs = self.images.prepare(input_ids, item.image_data)
        n = len(input_ids)
        if n == 0:
            raise ValueError("The input is empty after tokenization; provide a non-empty prompt.")
        if n >= self.context_len:
            raise ValueError(
                f"The input ({n} tokens) is longer than the model's context length ({self.context_len} tokens)."
            )
        n = allowed_input_len(n, self.max_req_input_len, self.server_args.allow_auto_truncate)
        if mm_inputs is not None and n < len(input_ids):
            raise ValueError(f"The input with its image tokens ({len(input_ids)} tokens) is longer than the "
                             f"maximum allowed length ({self.max_req_input_len} tokens).")
        input_ids = input_ids[:n]
        start = item.logprob_start_len
        if item.return_logprob and start is not None and start >= n:
            raise ValueError(
                f"logprob_start_len ({start}) is superior or equal to the length of the input ({n} tokens)."
            )
        params = SamplingParams.from_dict({**self.preferred_sampling_params, **item.sampling_params})
        params.normalize(self.tokenizer)
        params.verify(self.vocab_size)
        check_image_request(mm_inputs, params, item.return_logprob, item.logprob_start_len)
        if params.max_new_tokens is not None and params.max_new_tokens + n >= self.context_len:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens. "
                f"You requested a total of {params.max_new_tokens + n} tokens: {n} tokens from the input messages "
                f"and {params.max_new_tokens} tokens for the completion. Please reduce the number of tokens in "
                "the input messages or the completion to fit within the limit."
            )
        tids = item.token_ids_logprob
        if tids is not None and any(not isinstance(t, int) or t < 0 or t >= self.vocab_size for t in tids):
            raise ValueError(f"token_ids_logprob must hold token ids in [0, {self.vocab_size}).")
        top = item.top_logprobs_num
        if not isinstance(top, int) or top < 0:
            raise ValueError(f"top_logprobs_num must be a non-negative integer, got {top}.")
        check_output_limits(top, params.stop)
        return TokenizedGenerateReqInput(
            rid=item.rid, input_text=input_text, input_ids=input_ids, sampling_params=params,
            return_logprob=item.return_logprob, logprob_start_len=item.logprob_start_len,
            top_logprobs_num=top, token_ids_logprob=tids, mm_inputs=mm_inputs,
            custom_logit_processor=item.custom_logit_processor,
            lora_path=check_lora_path(item.lora_path),
        )

    async def generate_request(self, obj: GenerateReqInput) -> AsyncGenerator[Any, None]:
        """Yield output dicts: for a single request, one per stream event (or one at the end); for a batch,
        each yielded dict carries "index", and without streaming one final list is yielded instead."""
        await self.model_update_lock.acquire_reader()  # no generation starts while weights load
        gen = self._generate_request(obj)
        try:
            async for out in gen:
                yield out
        finally:
            try:
                await gen.aclose()
            finally:
                self.model_update_lock.release_reader()

    async def _generate_request(self, obj: GenerateReqInput) -> AsyncGenerator[Any, None]:
        if self.server_args.is_embedding:
            raise ValueError(NOT_GENERATION_MODEL)
        self._ensure_recv_loop()
        if obj.custom_logit_processor is not None and not self.server_args.enable_custom_logit_processor:
            raise ValueError(CUSTOM_LOGIT_PROCESSOR_DISABLED)
        items = obj.expand()
        tokenized = [self.tokenize_item(it) for it in items]
        if obj.priority is not None and (not isinstance(obj.priority, int) or isinstance(obj.priority, bool)):
            raise ValueError(f"priority must be an integer, got {obj.priority!r}.")
        check_data_parallel_rank(obj.data_parallel_rank, self.server_args.dp_size)
        single = obj.is_single() and len(items) == 1
        for t in tokenized:
            if t.rid in self.rid_to_state:
                raise ValueError(f"Duplicate request id: {t.rid}")
        self.check_capacity(len(tokenized))
        states = []
        for t in tokenized:
            t.stream = obj.stream
            t.priority = obj.priority or 0
            t.data_parallel_rank = obj.data_parallel_rank
            state = self.new_state(t.rid)
            state.log_metrics = obj.log_metrics
            state.has_grammar = is_structured_output(t.sampling_params)
            if t.return_logprob:
                state.logprobs = LogprobFormatter(
                    self.tokenizer if obj.return_text_in_logprobs else None, t.top_logprobs_num > 0,
                    t.token_ids_logprob is not None,
                )
            self.rid_to_state[t.rid] = state
            states.append(state)
        for t in tokenized:
            self.send_to_scheduler.send_pyobj(t)
        try:
            if single:
                async for out in self._wait_one(states[0], obj.stream):
                    yield out
            elif obj.stream:
                async for out in self._wait_many_stream(states):
                    yield out
            else:
                outs = []
                for s in states:
                    async for out in self._wait_one(s, False):
                        outs.append(out)
                yield outs
        finally:
            for s in states:
                if not s.finished:
                    self.abort_request(s.rid)
                self.rid_to_state.pop(s.rid, None)

    def check_capacity(self, new: int) -> None:
        """ServerBusyError (a 503) when `new` more requests would overflow --max-queued-requests."""
        check_queue_capacity(len(self.rid_to_state), new, self.scheduler_info.max_running_requests,
                             self.server_args.max_queued_requests)

    def new_state(self, rid: str) -> ReqState:
        timeout = self.server_args.request_timeout
        deadline = asyncio.get_running_loop().time() + timeout if timeout else None
        return ReqState(rid=rid, created=time.monotonic(), deadline=deadline)

    async def wait_for_output(self, state: ReqState) -> None:
        """Until the scheduler reports more of `state`; RequestTimeoutError past its deadline."""
        await wait_until(state.event, state.deadline, self.server_args.request_timeout)
        state.event.clear()
        if state.error is not None:
            raise state.error

    def fail_all(self, error: RequestRefused) -> None:
        """End every request in flight with `error` (call on the event loop)."""
        for state in list(self.rid_to_state.values()):
            state.error = error
            state.event.set()

    async def _wait_one(self, state: ReqState, stream: bool) -> AsyncIterator[dict]:
        while True:
            await self.wait_for_output(state)
            out = self._make_output(state, stream)
            if state.finished:
                self._raise_if_error(state)
                yield out
                return
            if stream:
                yield out

    async def _wait_many_stream(self, states: list[ReqState]) -> AsyncIterator[dict]:
        pending = {i: s for i, s in enumerate(states)}
        while pending:
            waiters = {asyncio.ensure_future(self.wait_for_output(s)): i for i, s in pending.items()}
            done, rest = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for f in rest:
                f.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
            for f in done:
                f.result()  # a RequestTimeoutError ends the whole stream
                i = waiters[f]
                state = pending[i]
                out = self._make_output(state, True)
                out["index"] = i
                if state.finished:
                    self._raise_if_error(state)
                    del pending[i]
                yield out

    def _raise_if_error(self, state: ReqState) -> None:
        reason = state.finish_reason
        if isinstance(reason, FinishAbort) and reason.is_bad_request:
            raise ValueError(reason.message)
        if isinstance(reason, FinishAbort) and (reason.status_code or 0) >= 500:
            raise InternalRequestError(reason.message)

    def _make_output(self, state: ReqState, stream: bool = False) -> dict:
        reason = state.finish_reason.to_json() if state.finish_reason is not None else None
        meta: dict[str, Any] = {"id": state.rid, "finish_reason": reason}
        meta["prompt_tokens"] = state.prompt_tokens
        meta["weight_version"] = self.server_args.weight_version
        meta["total_retractions"] = state.retractions
        if state.logprobs is not None:
            meta.update(state.logprobs.to_meta())
        meta["completion_tokens"] = state.completion_tokens
        meta["cached_tokens"] = state.cached_tokens
        if self.server_args.speculative_algorithm is not None:
            meta["spec_verify_ct"] = state.spec_verify_ct
            meta["spec_accepted_draft_tokens"] = state.spec_accepted_drafts
        if state.finished:
            meta["e2e_latency"] = time.monotonic() - state.created
        # As SGLang: with --stream-output a streamed chunk's ids are the new ones only; its text stays cumulative.
        start = state.sent_output_ids if stream and self.server_args.stream_output else 0
        output_ids = state.output_ids[start:]
        if stream:
            state.sent_output_ids = len(state.output_ids)
        if self.tokenizer is None:
            return {"output_ids": output_ids, "token_ids": list(output_ids), "meta_info": meta}
        return {"text": state.text, "output_ids": output_ids, "meta_info": meta}

    # ---- receiving ------------------------------------------------------------------------------------
    def _ensure_recv_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self.recv_task is None or self.recv_task.done() or self.recv_loop_owner is not loop:
            self.recv_task = loop.create_task(self._recv_loop())
            self.recv_loop_owner = loop

    async def _recv_loop(self) -> None:
        while True:
            msg = await self.recv_from_detokenizer.recv_pyobj()
            if isinstance(msg, BatchStrOutput):
                self._handle_outputs(msg)
            elif isinstance(msg, BatchEmbeddingOutput):
                handle_embedding_output(self, msg)
            else:
                self.control.deliver(msg)

    def _handle_outputs(self, msg: BatchStrOutput) -> None:
        for i, rid in enumerate(msg.rids):
            state = self.rid_to_state.get(rid)
            if state is None:
                continue
            now = time.monotonic()
            if self.metrics is not None and state.log_metrics:
                since_last = None if state.last_output_time is None else now - state.last_output_time
                self.metrics.on_output(now - state.created, since_last, len(msg.new_output_ids[i]))
            if msg.new_output_ids[i]:
                if state.first_output_time is None:
                    state.first_output_time = now
                state.last_output_time = now
            state.text += msg.new_texts[i]
            state.output_ids.extend(msg.new_output_ids[i])
            state.finish_reason = msg.finished_reasons[i]
            state.prompt_tokens = msg.prompt_tokens[i]
            state.completion_tokens = msg.completion_tokens[i]
            state.cached_tokens = msg.cached_tokens[i]
            state.retractions = msg.retractions[i]
            if msg.spec_verify_ct:
                state.spec_verify_ct = msg.spec_verify_ct[i]
                state.spec_accepted_drafts = msg.spec_accepted_drafts[i]
            if state.logprobs is not None and msg.logprobs[i] is not None:
                state.logprobs.extend(msg.logprobs[i])
            if msg.finished_reasons[i] is not None:
                state.finished = True
                if self.server_args.log_requests:
                    self._log_finished(state)
                reason = msg.finished_reasons[i]
                if isinstance(reason, FinishAbort) and reason.message == ABORT_BEFORE_PREFILL:
                    state.prompt_tokens = state.completion_tokens = 0
                if self.metrics is not None and state.log_metrics:
                    since_first = None if state.first_output_time is None else now - state.first_output_time
                    self.metrics.on_finish(now - state.created, state.prompt_tokens, state.completion_tokens,
                                           state.cached_tokens, state.has_grammar, since_first)
            state.event.set()

    def close(self) -> None:
        """Stop receiving and close the sockets now (pending messages are dropped), so no context is left
        to block at exit. Call it from outside the event loop that ran the receive task."""
        task, loop = self.recv_task, self.recv_loop_owner
        if task is not None and not task.done() and loop is not None and not loop.is_closed():
            task.cancel()
            loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
        self.ctx.destroy(linger=0)

    def _log_finished(self, state: ReqState) -> None:
        limit = 2048 if self.server_args.log_requests_level >= 2 else 256
        logger.info(
            "Finish: rid=%s, finish_reason=%s, prompt_tokens=%s, completion_tokens=%s, cached_tokens=%s, "
            "output=%r", state.rid, state.finish_reason, state.prompt_tokens,
            state.completion_tokens, state.cached_tokens, state.text[:limit],
        )

    # ---- control --------------------------------------------------------------------------------------
    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        if not abort_all and rid not in self.rid_to_state:
            return
        self.send_to_scheduler.send_pyobj(AbortReq(rid=rid, abort_all=abort_all))

    async def flush_cache(self) -> bool:
        out: FlushCacheReqOutput = await self.control.request(FlushCacheReq(), FlushCacheReqOutput)
        return out.success

    async def get_internal_state(self) -> SchedulerState:
        out: GetInternalStateReqOutput = await self.control.request(GetInternalStateReq(), GetInternalStateReqOutput)
        return out.state

    async def get_internal_states(self) -> list[SchedulerState]:
        """One state per scheduler replica (the server's internal_states), in replica order."""
        outs = await self.control.request_all(GetInternalStateReq(), GetInternalStateReqOutput)
        return sorted((out.state for out in outs), key=lambda s: s.info.dp_rank)
