"""/v1/files: upload (streamed to disk under a size limit), list, retrieve, content, delete."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any, Optional, cast

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from sglang.srt.batch.multipart import MultipartReader, boundary_of
from sglang.srt.batch.store import FILE_ID_RE, Store, new_file_id
from sglang.srt.entrypoints.openai.batch_serving import batch_serving
from sglang.srt.entrypoints.openai.common import error_response
from sglang.srt.entrypoints.responses import ORJSONResponse

PURPOSES = ("batch", "batch_output", "user_data", "assistants", "fine-tune", "vision", "evals")
# Multipart framing around the file body: headers, the purpose field, boundaries.
FRAMING_SLACK = 64 * 1024


def file_object(row: dict) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"]}


def not_found(file_id: str) -> ORJSONResponse:
    return error_response(f"No file with id {file_id!r}.", 404, "NotFoundError", "file_id")


def check_file_id(store: Store, file_id: str) -> tuple[Optional[dict], Optional[ORJSONResponse]]:
    """Malformed ids (such as '../x') are refused before any lookup: an id never becomes a path."""
    if not FILE_ID_RE.match(file_id):
        return None, error_response(f"Invalid file id {file_id!r}: file ids look like 'backend_input_file-<hex>'.",
                                    400, "BadRequestError", "file_id")
    row = store.get_file(file_id)
    return (row, None) if row else (None, not_found(file_id))


class JsonlChecker:
    """Checks, as bytes stream in, that every non-blank line is a JSON object; remembers the first bad line."""

    def __init__(self) -> None:
        self.partial = bytearray()
        self.lines = 0  # non-blank lines, the requests
        self.line_no = 0  # physical lines, for messages
        self.error: Optional[str] = None

    def feed(self, data: bytes) -> None:
        if self.error is not None:
            return
        end = data.rfind(b"\n")
        if end < 0:  # only the new bytes are scanned, so a very long line costs linear time
            self.partial += data
            return
        for raw in (bytes(self.partial) + data[:end]).split(b"\n"):
            self._check(raw)
        self.partial = bytearray(data[end + 1:])

    def close(self) -> None:
        if self.partial:
            self._check(bytes(self.partial))

    def _check(self, raw: bytes) -> None:
        self.line_no += 1
        if self.error is not None or not raw.strip():
            return
        self.lines += 1
        try:
            ok = isinstance(orjson.loads(raw), dict)
        except orjson.JSONDecodeError as e:
            self.error = f"line {self.line_no} is not valid JSON ({e})"
            return
        if not ok:
            self.error = f"line {self.line_no} is not a JSON object"


class UploadError(Exception):
    def __init__(self, message: str, status: int = 400, param: Optional[str] = "file") -> None:
        super().__init__(message)
        self.status, self.param = status, param


async def receive_upload(request: Request, store: Store, max_size: int) -> dict:
    """Stream the multipart body to a temporary file, then move it in place and register it."""
    try:
        reader = MultipartReader(boundary_of(request.headers.get("content-type", "")))
    except ValueError as e:
        raise UploadError(str(e)) from None
    too_big = UploadError(f"The file is larger than the server's limit of {max_size} bytes (--max-file-size).", 413)
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > 2 * max_size + FRAMING_SLACK:
        raise too_big  # clearly too large: not worth reading
    file_id = new_file_id("input")
    store.open()  # creates the storage folder on the first upload
    tmp = os.path.join(store.tmp_dir, file_id + ".part")
    fields: dict[str, bytearray] = {}
    filename, current, size, oversized = None, None, 0, False
    checker = JsonlChecker()
    try:
        with open(tmp, "wb") as f:
            async for chunk in request.stream():
                for kind, a, b in reader.feed(chunk):
                    a, b = cast(Any, a), cast(Any, b)  # ("part", name, filename) or ("data", bytes, None)
                    if kind == "part":
                        current = a
                        if a == "file":
                            filename = b or "upload.jsonl"
                        else:
                            fields[a] = bytearray()
                    elif kind == "data" and current == "file":
                        size += len(a)
                        if size > max_size:
                            oversized = True  # keep reading (and dropping) so the client sees the answer
                        elif not oversized:
                            f.write(a)
                            checker.feed(a)
                    elif kind == "data" and current is not None:
                        if len(fields[current]) + len(a) > 4096:
                            raise UploadError(f"The form field {current!r} is too long.", 400, current)
                        fields[current] += a
            if oversized:
                raise too_big
            if not reader.finished():
                raise UploadError("The multipart body ended early.")
            if filename is None:
                raise UploadError("The form has no 'file' field.")
            purpose = bytes(fields.get("purpose", b"batch")).decode("utf-8", "replace").strip() or "batch"
            if purpose not in PURPOSES or purpose == "batch_output":
                raise UploadError(f"purpose must be one of {', '.join(p for p in PURPOSES if p != 'batch_output')};"
                                  f" got {purpose!r}.", 400, "purpose")
            if purpose == "batch":
                checker.close()
                if checker.error is not None:
                    raise UploadError(f"Malformed JSONL: {checker.error}.")
                if checker.lines == 0:
                    raise UploadError("The file has no requests (it is empty).")
            await asyncio.to_thread(_durable_close, f)
        final = store.path_of(file_id)
        os.replace(tmp, final)
        await asyncio.to_thread(_fsync_dir, store.root)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return await asyncio.to_thread(store.add_file, file_id, os.path.basename(filename)[:255], purpose, size)


def _durable_close(f) -> None:
    f.flush()
    os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def _read_file(path: str, size: int) -> AsyncIterator[bytes]:
    """Stream the committed bytes only: a result file still being written is read up to its last whole line."""
    with open(path, "rb") as f:
        left = size
        while left > 0:
            chunk = await asyncio.to_thread(f.read, min(left, 1 << 20))
            if not chunk:
                return
            left -= len(chunk)
            yield chunk


router = APIRouter()


@router.post("/v1/files")
async def upload_file(request: Request):
    store, max_size = batch_serving(request).store, request.app.state.server.args.max_file_size
    try:
        row = await receive_upload(request, store, max_size)
    except UploadError as e:
        return error_response(str(e), e.status, "BadRequestError", e.param)
    return ORJSONResponse(file_object(row))


@router.get("/v1/files")
async def list_files(request: Request, purpose: Optional[str] = None, limit: int = 10000, after: Optional[str] = None,
                     order: str = "desc"):
    store = batch_serving(request).store
    if not 1 <= limit <= 10000:
        return error_response("limit must be between 1 and 10000.", 400, "BadRequestError", "limit")
    if order not in ("asc", "desc"):
        return error_response("order must be 'asc' or 'desc'.", 400, "BadRequestError", "order")
    if after is not None and (not FILE_ID_RE.match(after) or store.get_file(after) is None):
        return error_response(f"No file with id {after!r}.", 400, "BadRequestError", "after")
    rows = store.list_files(purpose, limit + 1, after, order == "desc")
    data = [file_object(r) for r in rows[:limit]]
    return ORJSONResponse({"object": "list", "data": data, "has_more": len(rows) > limit,
                           "first_id": data[0]["id"] if data else None,
                           "last_id": data[-1]["id"] if data else None})


@router.get("/v1/files/{file_id}")
async def retrieve_file(request: Request, file_id: str):
    store = batch_serving(request).store
    row, err = check_file_id(store, file_id)
    return err or ORJSONResponse(file_object(row))


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str):
    store = batch_serving(request).store
    row, err = check_file_id(store, file_id)
    if err:
        return err
    return StreamingResponse(_read_file(store.path_of(file_id), row["bytes"]),
                             media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str):
    store = batch_serving(request).store
    _row, err = check_file_id(store, file_id)
    if err:
        return err
    busy = await asyncio.to_thread(store.delete_file, file_id)
    if busy is not None:
        resp = error_response(f"File {file_id} is in use by batch {busy}, which has not finished; cancel the "
                              "batch or wait for it to end before deleting the file.", 409, "ConflictError",
                              "file_id")
        resp.headers["x-should-retry"] = "false"  # the openai client retries 409s unless told not to
        return resp
    return ORJSONResponse({"id": file_id, "object": "file", "deleted": True})
