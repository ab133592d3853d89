"""/v1/batches: create, retrieve, list, cancel (the store and runner: batch_serving.py)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Optional

from fastapi import APIRouter, Request
from pydantic import BaseModel

from sglang.srt.batch.store import BATCH_ID_RE, FILE_ID_RE, Store
from sglang.srt.entrypoints.openai.batch_serving import batch_serving
from sglang.srt.entrypoints.openai.common import error_response, parse_body
from sglang.srt.entrypoints.responses import ORJSONResponse

WINDOW_RE = re.compile(r"^([1-9][0-9]{0,3})h$")


class BatchCreateRequest(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: Optional[dict[str, str]] = None


def batch_object(row: dict) -> dict:
    return {
        "id": row["id"], "object": "batch", "endpoint": row["endpoint"],
        "errors": json.loads(row["errors"]) if row["errors"] else None,
        "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
        "status": row["status"], "output_file_id": row["output_file_id"],
        # The error file exists from the start but is only reported once it holds something.
        "error_file_id": row["error_file_id"] if row["failed"] > 0 else None,
        **{k: row[k] for k in ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
                               "failed_at", "expired_at", "cancelling_at", "cancelled_at")},
        "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
        "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
    }


router = APIRouter()


def lookup(store: Store, batch_id: str):
    if not BATCH_ID_RE.match(batch_id):
        return None, error_response(f"Invalid batch id {batch_id!r}.", 400, "BadRequestError", "batch_id")
    row = store.get_batch(batch_id)
    if row is None:
        return None, error_response(f"No batch with id {batch_id!r}.", 404, "NotFoundError", "batch_id")
    return row, None


@router.post("/v1/batches")
async def create_batch(request: Request):
    serving = batch_serving(request)
    store, endpoints = serving.store, serving.endpoints
    req = await parse_body(request, BatchCreateRequest)
    if not isinstance(req, BatchCreateRequest):
        return req
    if req.endpoint not in endpoints:
        return error_response(f"endpoint {req.endpoint!r} is not supported for batches; use one of "
                              f"{', '.join(sorted(endpoints))}.", 400, "BadRequestError", "endpoint")
    window = WINDOW_RE.match(req.completion_window)
    if window is None:
        return error_response(f"completion_window must look like '24h', got {req.completion_window!r}.",
                              400, "BadRequestError", "completion_window")
    fid = req.input_file_id
    if not FILE_ID_RE.match(fid):
        return error_response(f"Invalid input_file_id {fid!r}.", 400, "BadRequestError", "input_file_id")
    file_row = store.get_file(fid)
    if file_row is None:
        return error_response(f"No file with id {fid!r}.", 404, "NotFoundError", "input_file_id")
    if file_row["purpose"] != "batch":
        return error_response(f"File {fid} has purpose {file_row['purpose']!r}; a batch input needs 'batch'.",
                              400, "BadRequestError", "input_file_id")
    row = await asyncio.to_thread(store.add_batch, req.endpoint, fid, req.completion_window,
                                  int(window.group(1)) * 3600, req.metadata)
    serving.runner.start(row["id"])
    return ORJSONResponse(batch_object(row))


@router.get("/v1/batches")
async def list_batches(request: Request, limit: int = 20, after: Optional[str] = None):
    store = batch_serving(request).store
    if not 1 <= limit <= 100:
        return error_response("limit must be between 1 and 100.", 400, "BadRequestError", "limit")
    if after is not None and (not BATCH_ID_RE.match(after) or store.get_batch(after) is None):
        return error_response(f"No batch with id {after!r}.", 400, "BadRequestError", "after")
    rows = store.list_batches(limit + 1, after)
    data = [batch_object(r) for r in rows[:limit]]
    return ORJSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                           "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit})


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(request: Request, batch_id: str):
    row, err = lookup(batch_serving(request).store, batch_id)
    return err or ORJSONResponse(batch_object(row))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str):
    serving = batch_serving(request)
    store = serving.store
    row, err = lookup(store, batch_id)
    if err:
        return err
    if not await serving.runner.cancel(batch_id):
        row = store.get_batch(batch_id)
        resp = error_response(f"Batch {batch_id} is {row['status']}; only a validating or in_progress batch "
                              "can be cancelled.", 409, "ConflictError", "batch_id")
        resp.headers["x-should-retry"] = "false"
        return resp
    return ORJSONResponse(batch_object(store.get_batch(batch_id)))

