"""The native SGLang routes (/generate, /health, /get_model_info, /flush_cache, /tokenize, ...).

Every handler finds what it shares with the others (args, the tokenizer manager) in `request.app.state.server`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Optional

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from sglang.srt.entrypoints.body_schemas import (
    AbortBody,
    DetokenizeBody,
    GenerateBody,
    TokenizeBody,
    body_openapi,
    check_body,
)
from sglang.srt.entrypoints.responses import ORJSONResponse
from sglang.srt.entrypoints.server_state import model_card, native_error, read_json, server_state, timed_handler
from sglang.srt.entrypoints.sse import open_stream, sse_json, sse_response
from sglang.srt.lora.client import adapter_model_cards
from sglang.srt.managers.data_parallel import merge_states
from sglang.srt.managers.generate_input import GenerateReqInput
from sglang.version import __version__

FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, "
    "the operation will not be performed.)\n"
)

router = APIRouter()


@router.api_route("/generate", methods=["POST", "PUT"], openapi_extra=body_openapi(GenerateBody))
@timed_handler("generate_request")
async def generate(request: Request):
    state = server_state(request)
    try:
        obj = GenerateReqInput.from_json(check_body(GenerateBody, await read_json(request)))
    except (ValueError, TypeError) as e:
        return native_error(str(e))
    if obj.stream:
        return await stream_generate(request, obj)
    try:
        gen = state.tm.generate_request(obj)
        result = await _first_or_disconnect(request, gen)
    except ValueError as e:
        return native_error(str(e))
    if result is None:
        return Response(status_code=499)
    return ORJSONResponse(result)


async def stream_generate(request: Request, obj: GenerateReqInput):
    state = server_state(request)
    gen = state.tm.generate_request(obj)
    outputs, error = await open_stream(gen, native_error)
    if error is not None:
        return error

    async def events() -> AsyncIterator[bytes]:
        async for out in outputs:
            yield sse_json(out)

    return sse_response(gen, events(), lambda message, status: sse_json({"error": {"message": message}}))


@router.get("/health")
async def health(request: Request):
    state = server_state(request)
    return Response(status_code=200 if state.ready.is_set() else 503)


@router.get("/health_generate")
async def health_generate(request: Request):
    state = server_state(request)
    if not state.ready.is_set():  # still warming up: not ready, as /health says
        return Response(status_code=503)
    obj = GenerateReqInput(
        input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0}, rid=f"HEALTH_CHECK_{time.time()}",
        log_metrics=False,
    )
    try:
        if state.args.is_embedding:
            from sglang.srt.managers.embedding_input import EmbeddingReqInput
            from sglang.srt.managers.embedding_manager import encode_request

            probe = EmbeddingReqInput(input_ids=[0], rid=obj.rid)
            await asyncio.wait_for(encode_request(state.tm, probe), timeout=_health_timeout())
        else:
            gen = state.tm.generate_request(obj)
            try:
                await asyncio.wait_for(gen.__anext__(), timeout=_health_timeout())
            finally:
                await gen.aclose()
    except (asyncio.TimeoutError, ValueError):
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(request: Request):
    state = server_state(request)
    cfg = state.model_info.hf_config
    return ORJSONResponse({
        "model_path": state.args.model_path,
        "tokenizer_path": state.args.tokenizer_path,
        "is_generation": not state.args.is_embedding,
        "preferred_sampling_params": state.args.preferred_sampling_params,
        "weight_version": state.args.weight_version,
        "has_image_understanding": state.tm.images.has_image_understanding,
        "has_audio_understanding": False,
        "model_type": getattr(cfg, "model_type", None),
        "architectures": getattr(cfg, "architectures", None),
    })


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(request: Request):
    state = server_state(request)
    states = await state.tm.get_internal_states()
    internal = merge_states(states)
    info = dataclasses.asdict(state.args)
    info.update(
        status="ready",
        max_total_num_tokens=internal.info.max_total_num_tokens,
        max_req_input_len=internal.info.max_req_input_len,
        kv_pools=internal.info.kv_pools,
        decode_path=internal.info.decode_path,
        arithmetic=internal.info.arithmetic,
        weights={"bytes": internal.info.weight_bytes, "by_format": internal.info.weights},
        loaded_lora_adapters=dict(state.tm.lora_adapters),
        internal_states=[{
            "dp_rank": s.info.dp_rank,
            "last_gen_throughput": s.last_gen_throughput,
            "memory_usage": {
                "weight": s.info.weight_bytes / 2**30,
                "kvcache": s.info.kv_bytes / 2**30,
                "token_capacity": s.info.max_total_num_tokens,
                "cuda_graph": 0,
            },
            "load": s.load,
            "num_running_reqs": s.num_running_reqs,
            "num_queue_reqs": s.num_queue_reqs,
            "token_usage": s.token_usage,
            "cache_hit_rate": s.cache_hit_rate,
            "num_grammar_queue_reqs": s.num_grammar_queue_reqs,
            "num_jump_forward_tokens": s.num_jump_forward_tokens,
            "evictable_size": s.evictable_size,
            # as SGLang reports it where speculative decoding is on
            **({"avg_spec_accept_length": s.spec_accept_length} if state.args.speculative_algorithm else {}),
        } for s in states],
        version=__version__,
    )
    return ORJSONResponse(info)


@router.get("/get_load")
async def get_load(request: Request):
    state = server_state(request)
    internal = await state.tm.get_internal_state()
    return ORJSONResponse({"load": internal.load})


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request):
    state = server_state(request)
    ok = await state.tm.flush_cache()
    return PlainTextResponse(FLUSH_CACHE_TEXT, status_code=200 if ok else 400)


@router.post("/abort_request", openapi_extra=body_openapi(AbortBody))
async def abort_request(request: Request):
    state = server_state(request)
    try:
        body = check_body(AbortBody, await read_json(request))
    except ValueError as e:
        return native_error(str(e))
    state.tm.abort_request(body.get("rid") or "", abort_all=body.get("abort_all", False))
    return Response(status_code=200)


@router.post("/tokenize", openapi_extra=body_openapi(TokenizeBody))
@router.post("/v1/tokenize", openapi_extra=body_openapi(TokenizeBody))
async def tokenize(request: Request):
    state = server_state(request)
    try:
        body = await read_json(request)
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(p, str) for p in prompt))):
            raise ValueError("Invalid input: 'prompt' must be a string or a list of strings.")
        add_special = check_body(TokenizeBody, body).get("add_special_tokens", True)
        if state.tm.tokenizer is None:
            raise ValueError("This server was started with --skip-tokenizer-init; it cannot tokenize.")
        if isinstance(prompt, str):
            tokens: Any = state.tm.tokenizer.encode(prompt, add_special_tokens=add_special)
            count: Any = len(tokens)
        else:
            tokens = [state.tm.tokenizer.encode(p, add_special_tokens=add_special) for p in prompt]
            count = [len(t) for t in tokens]
    except ValueError as e:
        return native_error(str(e))
    max_len = getattr(state.tm.tokenizer, "model_max_length", None)
    if not isinstance(max_len, int) or max_len > 1 << 40:
        max_len = state.tm.context_len
    return ORJSONResponse({"tokens": tokens, "count": count, "max_model_len": max_len})


@router.post("/detokenize", openapi_extra=body_openapi(DetokenizeBody))
@router.post("/v1/detokenize", openapi_extra=body_openapi(DetokenizeBody))
async def detokenize(request: Request):
    state = server_state(request)
    try:
        body = await read_json(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        nested = isinstance(tokens, list) and bool(tokens) and all(isinstance(t, list) for t in tokens)
        rows = tokens if nested else [tokens]
        if not all(isinstance(row, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in row)
                   for row in rows):
            raise ValueError("Invalid input: 'tokens' must be a list of integers.")
        body = check_body(DetokenizeBody, body)
        if state.tm.tokenizer is None:
            raise ValueError("This server was started with --skip-tokenizer-init; it cannot detokenize.")
        vocab = len(state.tm.tokenizer)
        if any(not 0 <= i < vocab for row in rows for i in row):
            raise ValueError(f"Invalid input: 'tokens' must hold token ids in [0, {vocab}).")
        skip = body.get("skip_special_tokens", True)
        decoded = [state.tm.tokenizer.decode(row, skip_special_tokens=skip) if row else "" for row in rows]
        text: Any = decoded if nested else decoded[0]
    except ValueError as e:
        return native_error(str(e))
    return ORJSONResponse({"text": text})


@router.get("/metrics")
async def metrics(request: Request):
    state = server_state(request)
    if state.tm.metrics is None:
        return native_error("Metrics are disabled; start the server with --enable-metrics.", 404)
    body = state.tm.metrics.render(await state.tm.get_internal_state())
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def list_models(request: Request):
    state = server_state(request)
    card = model_card(state)
    return ORJSONResponse({"object": "list", "data": [card, *adapter_model_cards(card, state.tm.lora_adapters)]})


def _health_timeout() -> float:
    return float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))


async def _first_or_disconnect(request: Request, gen: AsyncGenerator[Any, None]) -> Optional[Any]:
    """Await the final output, aborting the request if the client goes away first."""
    task = asyncio.ensure_future(gen.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await gen.aclose()  # finishes the request's bookkeeping (and aborts it if still running)
