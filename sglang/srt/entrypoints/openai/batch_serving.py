"""The durable store, the batch runner and the endpoint table that the files and batches routes share."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI, Request

from sglang.srt.batch.lines import BatchEndpoint
from sglang.srt.batch.runner import BatchRunner
from sglang.srt.batch.store import Store


@dataclass
class BatchServing:
    store: Store
    runner: BatchRunner
    # Batch line url -> how a line of that endpoint runs (chat, completions, ...).
    endpoints: dict[str, BatchEndpoint]


def batch_serving(request: Request) -> BatchServing:
    return request.app.state.server.batches


def attach_batch_serving(app: FastAPI, state, endpoints: dict[str, BatchEndpoint]) -> BatchServing:
    """Build the store and runner under --file-storage-path, resume unfinished batches at startup."""
    args = state.args
    store = Store(args.file_storage_path)
    serving = BatchServing(store, BatchRunner(store, endpoints, args.batch_max_inflight), endpoints)
    state.batches = serving

    async def resume() -> None:
        if store.exists():  # storage left by an earlier run: clean up after a crash, resume its batches
            store.remove_orphans()
            await serving.runner.resume_all()

    app.router.on_startup.append(resume)
    app.router.on_shutdown.append(serving.runner.shutdown)
    return serving
