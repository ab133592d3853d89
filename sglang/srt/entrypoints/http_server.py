"""The HTTP server: a thin FastAPI layer over the tokenizer manager (native SGLang routes)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import threading
import time
from typing import Any, AsyncIterator, Optional

import orjson
import requests
import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import ORJSONResponse, PlainTextResponse, Response

from sglang.srt.entrypoints.launch import Subprocesses, launch_subprocesses, watch_children
from sglang.srt.entrypoints.parser_routes import register_parser_routes
from sglang.srt.entrypoints.openai.routes import install_api_key_check, register_openai_routes
from sglang.srt.entrypoints.sse import open_stream, sse_json, sse_response
from sglang.srt.managers.generate_input import GenerateReqInput
from sglang.srt.managers.process_utils import configure_logging
from sglang.srt.server_args import ServerArgs
from sglang.version import __version__

logger = logging.getLogger(__name__)

FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, "
    "the operation will not be performed.)\n"
)


def native_error(message: str, status: int = 400) -> ORJSONResponse:
    return ORJSONResponse({"error": {"message": message}}, status_code=status)


class ServerState:
    """What the routes share: args, subprocesses, the tokenizer manager."""

    def __init__(self, server_args: ServerArgs, subs: Subprocesses) -> None:
        self.args = server_args
        self.subs = subs
        self.tm = subs.tokenizer_manager
        self.model_info = subs.model_info
        # Set once the warm-up request has run; /health answers 503 until then.
        self.ready = threading.Event()


async def read_json(request: Request) -> Any:
    body = await request.body()
    try:
        return orjson.loads(body) if body else {}
    except orjson.JSONDecodeError as e:
        raise ValueError(f"Invalid JSON body: {e}") from None


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI()
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    app.state.server = state
    tm = state.tm
    args = state.args
    if args.api_key:
        install_api_key_check(app, args.api_key)
    register_openai_routes(app, state)
    register_parser_routes(app, args.tool_call_parser, args.reasoning_parser)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise ValueError("The request body must be a JSON object.")
            obj = GenerateReqInput.from_json(body)
        except (ValueError, TypeError) as e:
            return native_error(str(e))
        if obj.stream:
            return await stream_generate(request, obj)
        try:
            gen = tm.generate_request(obj)
            result = await _first_or_disconnect(request, gen)
        except ValueError as e:
            return native_error(str(e))
        if result is None:
            return Response(status_code=499)
        return ORJSONResponse(result)

    async def stream_generate(request: Request, obj: GenerateReqInput):
        gen = tm.generate_request(obj)
        outputs, error = await open_stream(gen, native_error)
        if error is not None:
            return error

        async def events() -> AsyncIterator[bytes]:
            async for out in outputs:
                yield sse_json(out)

        return sse_response(gen, events(), lambda message: sse_json({"error": {"message": message}}))

    @app.get("/health")
    async def health():
        return Response(status_code=200 if state.ready.is_set() else 503)

    @app.get("/health_generate")
    async def health_generate():
        obj = GenerateReqInput(
            input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0}, rid=f"HEALTH_CHECK_{time.time()}",
            log_metrics=False,
        )
        try:
            await asyncio.wait_for(tm.generate_request(obj).__anext__(), timeout=_health_timeout())
        except (asyncio.TimeoutError, ValueError):
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        cfg = state.model_info["hf_config"]
        return ORJSONResponse({
            "model_path": args.model_path,
            "tokenizer_path": args.tokenizer_path,
            "is_generation": not args.is_embedding,
            "preferred_sampling_params": args.preferred_sampling_params,
            "weight_version": args.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
        })

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        internal = await tm.get_internal_state()
        info = dataclasses.asdict(args)
        info.update(
            status="ready",
            max_total_num_tokens=internal["max_total_num_tokens"],
            max_req_input_len=internal["max_req_input_len"],
            internal_states=[{
                "last_gen_throughput": internal["last_gen_throughput"],
                "memory_usage": {
                    "weight": internal["weight_bytes"] / 2**30,
                    "kvcache": internal["kv_bytes"] / 2**30,
                    "token_capacity": internal["max_total_num_tokens"],
                    "cuda_graph": 0,
                },
                "load": internal["load"],
                **{k: internal[k] for k in ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate",
                                            "num_grammar_queue_reqs", "num_jump_forward_tokens")},
            }],
            version=__version__,
        )
        return ORJSONResponse(info)

    @app.get("/get_load")
    async def get_load():
        internal = await tm.get_internal_state()
        return ORJSONResponse({"load": internal["load"]})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        ok = await tm.flush_cache()
        return PlainTextResponse(FLUSH_CACHE_TEXT, status_code=200 if ok else 400)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        try:
            body = await read_json(request)
        except ValueError as e:
            return native_error(str(e))
        rid = body.get("rid", "") if isinstance(body, dict) else ""
        abort_all = bool(body.get("abort_all", False)) if isinstance(body, dict) else False
        tm.abort_request(str(rid or ""), abort_all=abort_all)
        return Response(status_code=200)

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request):
        try:
            body = await read_json(request)
            prompt = body.get("prompt") if isinstance(body, dict) else None
            add_special = bool(body.get("add_special_tokens", True))
            if tm.tokenizer is None:
                raise ValueError("This server was started with --skip-tokenizer-init; it cannot tokenize.")
            if isinstance(prompt, str):
                tokens: Any = tm.tokenizer.encode(prompt, add_special_tokens=add_special)
                count: Any = len(tokens)
            elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
                tokens = [tm.tokenizer.encode(p, add_special_tokens=add_special) for p in prompt]
                count = [len(t) for t in tokens]
            else:
                raise ValueError("Invalid input: 'prompt' must be a string or a list of strings.")
        except ValueError as e:
            return native_error(str(e))
        max_len = getattr(tm.tokenizer, "model_max_length", None)
        if not isinstance(max_len, int) or max_len > 1 << 40:
            max_len = tm.context_len
        return ORJSONResponse({"tokens": tokens, "count": count, "max_model_len": max_len})

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(request: Request):
        try:
            body = await read_json(request)
            tokens = body.get("tokens") if isinstance(body, dict) else None
            skip = bool(body.get("skip_special_tokens", True))
            if tm.tokenizer is None:
                raise ValueError("This server was started with --skip-tokenizer-init; it cannot detokenize.")
            if isinstance(tokens, list) and tokens and all(isinstance(t, list) for t in tokens):
                if not all(isinstance(i, int) for t in tokens for i in t):
                    raise ValueError("Invalid input: 'tokens' must be a list of integers.")
                text: Any = [tm.tokenizer.decode(t, skip_special_tokens=skip) for t in tokens]
            elif isinstance(tokens, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in tokens):
                text = tm.tokenizer.decode(tokens, skip_special_tokens=skip) if tokens else ""
            else:
                raise ValueError("Invalid input: 'tokens' must be a list of integers.")
        except ValueError as e:
            return native_error(str(e))
        return ORJSONResponse({"text": text})

    @app.get("/metrics")
    async def metrics():
        if tm.metrics is None:
            return native_error("Metrics are disabled; start the server with --enable-metrics.", 404)
        body = tm.metrics.render(await tm.get_internal_state())
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models():
        return ORJSONResponse({"object": "list", "data": [model_card(state)]})

    return app


def model_card(state: ServerState) -> dict:
    name = state.args.served_model_name
    return {
        "id": name, "object": "model", "created": int(state.subs.scheduler_info.get("created", time.time())),
        "owned_by": "sglang", "root": name, "max_model_len": state.tm.context_len,
    }


def _health_timeout() -> float:
    return float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))


async def _first_or_disconnect(request: Request, gen: AsyncIterator[Any]) -> Optional[Any]:
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


def _warmup(args: ServerArgs, ready: threading.Event) -> None:
    url = args.url()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/get_model_info", headers=headers, timeout=5).status_code == 200:
                break
        except requests.RequestException:
            pass
        time.sleep(0.5)
    if not args.skip_server_warmup:
        body: dict = {"sampling_params": {"temperature": 0, "max_new_tokens": 8}}
        if args.skip_tokenizer_init:
            body["input_ids"] = [10, 11, 12]
        else:
            body["text"] = "The capital city of France is"
        try:
            requests.post(url + "/generate", json=body, headers=headers, timeout=600).raise_for_status()
        except requests.RequestException as e:
            logger.error("Warm-up request failed: %s", e)
            os.kill(os.getpid(), signal.SIGTERM)
            return
    ready.set()
    logger.info("The server is fired up and ready to roll!")


def launch_server(server_args: ServerArgs) -> None:
    configure_logging(server_args.log_level)
    logger.info("server_args=%s", server_args)
    subs = launch_subprocesses(server_args)
    state = ServerState(server_args, subs)
    app = build_app(state)

    config = uvicorn.Config(
        app, host=server_args.host, port=server_args.port, timeout_keep_alive=5, loop="auto",
        log_level=(server_args.log_level_http or server_args.log_level).lower(),
    )
    server = uvicorn.Server(config)
    dead_children: list[str] = []

    def on_child_death(name: str) -> None:
        logger.error("Child process %s died; shutting down the server.", name)
        dead_children.append(name)
        server.should_exit = True

    watch_children(subs, on_child_death)
    threading.Thread(target=_warmup, args=(server_args, state.ready), daemon=True).start()
    try:
        server.run()
    finally:
        subs.shutdown()
    if dead_children:
        raise SystemExit(f"The server stopped because the {dead_children[0]} process died.")
