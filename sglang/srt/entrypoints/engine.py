"""`sglang.Engine`: the in-process API over the same scheduler and detokenizer processes as the server."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import warnings
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any, Optional, Union

from sglang.srt.entrypoints.launch import launch_subprocesses, watch_children
from sglang.srt.entrypoints.openai.score import score_items
from sglang.srt.managers.data_parallel.dispatcher import merge_states
from sglang.srt.managers.expert_record_client import expert_distribution
from sglang.srt.managers.generate_input import GenerateReqInput
from sglang.srt.managers.io_struct import AbortReq, SchedulerState
from sglang.srt.managers.process_utils import configure_logging
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def _thread_event_loop() -> asyncio.AbstractEventLoop:
    """This thread's event loop, made and set as current when it has none (or a closed one). The engine runs its
    sync calls on it, so `asyncio.get_event_loop().run_until_complete(engine.async_generate(...))` shares the loop
    with them, as in SGLang; being shared, it is not closed at shutdown."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            loop: Optional[asyncio.AbstractEventLoop] = asyncio.get_event_loop()
        except RuntimeError:  # a thread other than the main one, with no loop set
            loop = None
    if loop is None or loop.is_closed():
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
    return loop


class Engine:
    """Offline engine: `Engine(model_path=..., **server_args)`."""

    def __init__(self, **kwargs: Any) -> None:
        if "server_args" in kwargs:
            server_args = kwargs.pop("server_args")
        else:
            kwargs.setdefault("log_level", "error")
            server_args = ServerArgs(**kwargs)
        self.server_args = server_args
        configure_logging(server_args.log_level)
        self.loop = _thread_event_loop()
        self._subs = launch_subprocesses(server_args)
        self.tokenizer_manager = self._subs.tokenizer_manager
        self._dead_child: Optional[str] = None
        watch_children(self._subs, self._on_child_death)

    def _on_child_death(self, name: str) -> None:
        self._dead_child = name
        logger.error("Child process %s died", name)

    def _check_alive(self) -> None:
        if self._dead_child is not None:
            raise RuntimeError(f"The engine's {self._dead_child} process died; create a new Engine.")

    # ---- generation -----------------------------------------------------------------------------------
    def _make_input(self, prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                    top_logprobs_num, token_ids_logprob, stream, rid, return_text_in_logprobs,
                    image_data, custom_logit_processor, lora_path=None) -> GenerateReqInput:
        return GenerateReqInput(
            text=prompt, input_ids=input_ids, sampling_params=sampling_params, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            token_ids_logprob=token_ids_logprob, stream=stream, rid=rid,
            return_text_in_logprobs=return_text_in_logprobs, image_data=image_data,
            custom_logit_processor=custom_logit_processor, lora_path=lora_path,
        )

    def generate(
        self,
        prompt: Optional[Union[str, list[str]]] = None,
        sampling_params: Optional[Union[dict, list[dict]]] = None,
        input_ids: Optional[Union[list[int], list[list[int]]]] = None,
        image_data: Optional[Any] = None,
        return_logprob: Optional[Union[bool, list[bool]]] = False,
        logprob_start_len: Optional[Union[int, list[int]]] = None,
        top_logprobs_num: Optional[Union[int, list[int]]] = None,
        token_ids_logprob: Optional[Union[list[int], list[list[int]]]] = None,
        stream: bool = False,
        rid: Optional[Union[str, list[str]]] = None,
        return_text_in_logprobs: bool = False,
        custom_logit_processor: Optional[Union[str, list[Optional[str]]]] = None,
        lora_path: Optional[Union[str, list[Optional[str]]]] = None,
        **unused: Any,
    ) -> Union[dict, list[dict], Iterator[dict]]:
        """Same output dicts as /generate; with stream=True an iterator of cumulative outputs."""
        self._check_alive()
        obj = self._make_input(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                               top_logprobs_num, token_ids_logprob, stream, rid, return_text_in_logprobs,
                               image_data, custom_logit_processor, lora_path)
        gen = self.tokenizer_manager.generate_request(obj)
        if stream:
            return self._iterate(gen)
        try:
            return self.loop.run_until_complete(gen.__anext__())
        finally:  # ends the request's bookkeeping now (and its hold on the weight-update lock)
            self.loop.run_until_complete(gen.aclose())

    def _iterate(self, gen: AsyncGenerator[dict, None]) -> Iterator[dict]:
        try:
            while True:
                try:
                    yield self.loop.run_until_complete(gen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self.loop.run_until_complete(gen.aclose())

    async def async_generate(
        self,
        prompt: Optional[Union[str, list[str]]] = None,
        sampling_params: Optional[Union[dict, list[dict]]] = None,
        input_ids: Optional[Union[list[int], list[list[int]]]] = None,
        image_data: Optional[Any] = None,
        return_logprob: Optional[Union[bool, list[bool]]] = False,
        logprob_start_len: Optional[Union[int, list[int]]] = None,
        top_logprobs_num: Optional[Union[int, list[int]]] = None,
        token_ids_logprob: Optional[Union[list[int], list[list[int]]]] = None,
        stream: bool = False,
        rid: Optional[Union[str, list[str]]] = None,
        return_text_in_logprobs: bool = False,
        custom_logit_processor: Optional[Union[str, list[Optional[str]]]] = None,
        lora_path: Optional[Union[str, list[Optional[str]]]] = None,
        **unused: Any,
    ) -> Union[dict, list[dict], AsyncIterator[dict]]:
        self._check_alive()
        obj = self._make_input(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                               top_logprobs_num, token_ids_logprob, stream, rid, return_text_in_logprobs,
                               image_data, custom_logit_processor, lora_path)
        gen = self.tokenizer_manager.generate_request(obj)
        if stream:
            return gen
        try:
            return await gen.__anext__()
        finally:
            await gen.aclose()

    # ---- control --------------------------------------------------------------------------------------
    def encode(
        self,
        prompt: Optional[Union[str, list[str], list[list[str]]]] = None,
        input_ids: Optional[Union[list[int], list[list[int]]]] = None,
        rid: Optional[Union[str, list[str]]] = None,
    ) -> Any:
        """Pooled outputs of an `is_embedding=True` engine: `{"embedding", "meta_info"}` for one input, a list
        of them for a batch (texts, [query, document] pairs for cross-encoders, or token ids)."""
        from sglang.srt.managers.embedding_input import EmbeddingReqInput
        from sglang.srt.managers.embedding_manager import encode_request

        self._check_alive()
        obj = EmbeddingReqInput.from_json({"text": prompt, "input_ids": input_ids, "rid": rid})
        outputs = self.loop.run_until_complete(encode_request(self.tokenizer_manager, obj))
        return outputs[0] if obj.is_single() else outputs

    def flush_cache(self) -> bool:
        return self.loop.run_until_complete(self.tokenizer_manager.flush_cache())

    def start_expert_distribution_record(self) -> None:
        self.loop.run_until_complete(expert_distribution(self.tokenizer_manager, "start_record"))

    def stop_expert_distribution_record(self) -> None:
        self.loop.run_until_complete(expert_distribution(self.tokenizer_manager, "stop_record"))

    def dump_expert_distribution_record(self) -> str:
        """Write the record (see README) and return the .pt file's path."""
        return self.loop.run_until_complete(expert_distribution(self.tokenizer_manager, "dump_record"))

    def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None) -> tuple[bool, str]:
        """(success, message): serve the weights at `model_path` (same architecture and shapes) from now on."""
        from sglang.srt.managers.weight_update_client import parse_update_request, update_weights_from_disk

        obj = parse_update_request({"model_path": model_path, "load_format": load_format})
        return self.loop.run_until_complete(update_weights_from_disk(self.tokenizer_manager, obj))

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict:
        """Serve the PEFT adapter at `lora_path` as `lora_name` (`pinned`: never evicted from memory); the
        /load_lora_adapter result as a dict."""
        return self._update_lora({"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned}, load=True)

    def unload_lora_adapter(self, lora_name: str) -> dict:
        """Stop serving `lora_name`, once the requests already using it finished."""
        return self._update_lora({"lora_name": lora_name}, load=False)

    def _update_lora(self, body: dict, load: bool) -> dict:
        from sglang.srt.lora.client import lora_result_body, parse_lora_update, update_lora_adapters

        msg = parse_lora_update(body, load)
        return lora_result_body(self.loop.run_until_complete(update_lora_adapters(self.tokenizer_manager, msg)))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` rows of checkpoint weight `name` (ValueError when there is none)."""
        from sglang.srt.managers.weight_update_client import get_weights_by_name, parse_read_request

        obj = parse_read_request({"name": name, "truncate_size": truncate_size})
        return self.loop.run_until_complete(get_weights_by_name(self.tokenizer_manager, obj))

    def get_internal_state(self) -> dict:
        return self.loop.run_until_complete(self.tokenizer_manager.get_internal_state()).to_dict()

    def get_server_info(self) -> dict:
        states = self.loop.run_until_complete(self.tokenizer_manager.get_internal_states())
        return engine_server_info(self.server_args, states)

    def score(self, query: Optional[Union[str, list[int]]] = None,
              items: Optional[Union[str, list[str], list[int], list[list[int]]]] = None,
              label_token_ids: Optional[list[int]] = None, apply_softmax: bool = False,
              item_first: bool = False) -> list[list[float]]:
        """Next-token probabilities of `label_token_ids` after query + each item (item + query with item_first),
        one list per item, as /v1/score answers them; ValueError for bad input."""
        self._check_alive()
        body = {"query": query, "items": items, "label_token_ids": label_token_ids, "apply_softmax": apply_softmax,
                "item_first": item_first}
        return self.loop.run_until_complete(score_items(self.tokenizer_manager, body))

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.tokenizer_manager.send_to_scheduler.send_pyobj(AbortReq(rid=rid, abort_all=abort_all))

    def shutdown(self) -> None:
        if self._subs is not None:
            self._subs.shutdown()
            self._subs = None  # type: ignore[assignment]
            self.tokenizer_manager.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            if getattr(self, "_subs", None) is not None:
                self.shutdown()
        except Exception:
            pass


def engine_server_info(server_args: ServerArgs, states: list[SchedulerState]) -> dict:
    """get_server_info of an in-process engine: its args, the server-wide scheduler state and one state per
    data-parallel replica (`SchedulerState.to_dict()`, in replica order)."""
    state = merge_states(states).to_dict()
    info = dataclasses.asdict(server_args)
    info.update(
        status="ready",
        max_total_num_tokens=state["max_total_num_tokens"],
        max_req_input_len=state["max_req_input_len"],
        arithmetic=state["arithmetic"],
        weights={"bytes": state["weight_bytes"], "by_format": state["weights"]},
        kv_pools=state["kv_pools"],
        decode_path=state["decode_path"],
        internal_states=[s.to_dict() for s in states],
        version=_version(),
    )
    return info


def _version() -> str:
    from sglang.version import __version__

    return __version__
