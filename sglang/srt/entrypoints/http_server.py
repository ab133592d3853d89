"""The HTTP server: the FastAPI app over the tokenizer manager, its warm-up, and the process that runs it."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import requests
import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from sglang.srt.entrypoints.embedding_routes import install_generation_guard
from sglang.srt.entrypoints.embedding_routes import router as embedding_router
from sglang.srt.entrypoints.error_handlers import install_error_handlers
from sglang.srt.entrypoints.expert_routes import router as expert_router
from sglang.srt.entrypoints.launch import launch_subprocesses, watch_children
from sglang.srt.entrypoints.lora_routes import router as lora_router
from sglang.srt.entrypoints.native_routes import router as native_router
from sglang.srt.entrypoints.openai.embeddings import router as openai_embeddings_router
from sglang.srt.entrypoints.openai.routes import attach_openai, install_api_key_check
from sglang.srt.entrypoints.openai.score import router as openai_score_router
from sglang.srt.entrypoints.parser_routes import router as parser_router
from sglang.srt.entrypoints.server_state import ServerState
from sglang.srt.entrypoints.tp_launch import run_worker_node
from sglang.srt.entrypoints.weight_routes import router as weight_router
from sglang.srt.managers.process_utils import configure_logging, exit_on_signal
from sglang.srt.managers.request_errors import WorkerDiedError
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

def build_app(state: ServerState) -> FastAPI:
    app = FastAPI()
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    app.state.server = state
    install_error_handlers(app, state.args)
    if state.args.api_key:
        install_api_key_check(app, state.args.api_key)
    attach_openai(app, state)
    app.include_router(native_router)
    app.include_router(parser_router)
    app.include_router(expert_router)
    app.include_router(weight_router)
    app.include_router(lora_router)
    app.include_router(embedding_router)
    install_generation_guard(app, state.args.is_embedding)
    app.include_router(openai_embeddings_router)
    app.include_router(openai_score_router)
    return app


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
        time.sleep(0.05)  # uvicorn binds its socket within moments of this thread starting
    if not args.skip_server_warmup:
        body: dict = {"sampling_params": {"temperature": 0, "max_new_tokens": 8}}
        if args.skip_tokenizer_init:
            body["input_ids"] = [10, 11, 12]
        else:
            body["text"] = "The capital city of France is"
        route = "/generate"
        if args.is_embedding:  # one prefill-only request through the pooling path
            route = "/encode"
            body.pop("sampling_params")
        try:
            requests.post(url + route, json=body, headers=headers, timeout=600).raise_for_status()
        except requests.RequestException as e:
            logger.error("Warm-up request failed: %s", e)
            os.kill(os.getpid(), signal.SIGTERM)
            return
    ready.set()
    logger.info("The server is fired up and ready to roll!")


def launch_server(server_args: ServerArgs) -> None:
    configure_logging(server_args.log_level)
    logger.info("server_args=%s", server_args)
    if server_args.node_rank > 0:  # scheduler ranks only: node 0 serves HTTP
        run_worker_node(server_args)
        return
    subs = launch_subprocesses(server_args)
    state = ServerState(server_args, subs)
    app = build_app(state)

    config = uvicorn.Config(
        app, host=server_args.host, port=server_args.port, timeout_keep_alive=5, loop="auto",
        log_level=(server_args.log_level_http or server_args.log_level).lower(),
        # On SIGTERM/SIGINT: stop accepting, let in-flight requests finish for this long, then close them.
        timeout_graceful_shutdown=round(server_args.graceful_shutdown_timeout),
    )
    server = uvicorn.Server(config)
    dead_children: list[str] = []

    def on_child_death(name: str) -> None:
        logger.error("Child process %s died; shutting down the server.", name)
        dead_children.append(name)
        # Nothing in flight can finish without the child: answer it with a 503 now, then close the connections
        # rather than wait for the grace period.
        loop = subs.tokenizer_manager.recv_loop_owner
        if loop is not None and not loop.is_closed():
            error = WorkerDiedError(f"The server's {name} process died; the server is shutting down.")
            loop.call_soon_threadsafe(subs.tokenizer_manager.fail_all, error)
            time.sleep(0.5)
        server.should_exit = server.force_exit = True

    watch_children(subs, on_child_death)
    threading.Thread(target=_warmup, args=(server_args, state.ready), daemon=True).start()
    # uvicorn re-raises the signal that stopped it once it is done; as SystemExit it unwinds through the
    # `finally` below, so the children are stopped and the socket folder removed instead of the process dying.
    signal.signal(signal.SIGTERM, exit_on_signal)
    try:
        server.run()
    finally:
        subs.shutdown()
    if dead_children:
        raise SystemExit(f"The server stopped because the {dead_children[0]} process died.")
