"""Batch input lines: which endpoints a batch may target, how a line is validated, how it is executed, and the
shape of the result and error lines written for it."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import orjson
from pydantic import BaseModel, ValidationError

from sglang.srt.entrypoints.openai.common import as_list

# Scheduler priority of batch lines: online requests carry 0, and larger values are admitted first.
BATCH_PRIORITY = -1


@dataclass
class BatchEndpoint:
    """One endpoint a batch can target: the body schema, and a coroutine running one validated body under a
    given request id and priority that returns the response body (raises ValueError for a bad request)."""

    request_model: type[BaseModel]
    execute: Callable[[Any, str, int], Awaitable[dict]]


def generate_endpoint(request_model: type[BaseModel], handler: Any) -> BatchEndpoint:
    """A batch endpoint over an OpenAI handler (chat, completions): the online request flow, not streamed."""

    async def execute(req: Any, rid: str, priority: int) -> dict:
        obj = handler.to_generate_input(req)
        obj.rid = rid
        obj.priority = priority
        gen = handler.tm.generate_request(obj)
        try:
            outputs = as_list(await gen.__anext__())
        finally:
            await gen.aclose()  # aborts the request if this task was cancelled mid-way
        return handler.build_response(req, outputs)

    return BatchEndpoint(request_model, execute)


@dataclass
class ParsedLine:
    index: int  # position among the file's non-blank lines; also the line's key in the database
    custom_id: Optional[str]
    request: Any = None
    error_code: Optional[str] = None
    error_message: Optional[str] = None
    line_no: int = 0  # physical line in the file (1-based), for error messages


def normalize_url(url: str) -> str:
    """Lines may name the endpoint with or without the /v1 prefix (the notebooks use '/chat/completions')."""
    url = url.strip()
    return url if url.startswith("/v1/") else "/v1" + (url if url.startswith("/") else "/" + url)


def parse_line(index: int, raw: bytes, endpoint: str, endpoints: dict[str, BatchEndpoint],
               seen: set[str]) -> ParsedLine:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return ParsedLine(index, None, error_code="invalid_json", error_message=f"The line is not valid JSON: {e}")
    if not isinstance(obj, dict):
        return ParsedLine(index, None, error_code="invalid_json", error_message="The line must be a JSON object.")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return ParsedLine(index, None, error_code="missing_custom_id",
                          error_message="custom_id is required and must be a non-empty string.")
    if cid in seen:
        return ParsedLine(index, cid, error_code="duplicate_custom_id",
                          error_message=f"custom_id {cid!r} appears more than once in the input file.")
    seen.add(cid)
    if obj.get("method", "POST") != "POST":
        return ParsedLine(index, cid, error_code="invalid_method", error_message="method must be 'POST'.")
    url = obj.get("url")
    if not isinstance(url, str):
        return ParsedLine(index, cid, error_code="invalid_url", error_message="url is required.")
    url = normalize_url(url)
    if url not in endpoints:
        return ParsedLine(index, cid, error_code="unsupported_url",
                          error_message=f"url {url!r} is not a supported batch endpoint "
                                        f"({', '.join(sorted(endpoints))}).")
    if url != endpoint:
        return ParsedLine(index, cid, error_code="invalid_url",
                          error_message=f"url {url!r} does not match the batch endpoint {endpoint!r}.")
    body = obj.get("body")
    if not isinstance(body, dict):
        return ParsedLine(index, cid, error_code="invalid_body", error_message="body must be a JSON object.")
    if body.get("stream"):
        return ParsedLine(index, cid, error_code="invalid_body",
                          error_message="Streaming requests are not supported in batch mode.")
    try:
        req = endpoints[url].request_model.model_validate(body)
    except ValidationError as e:
        msg = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
        return ParsedLine(index, cid, error_code="invalid_body", error_message=f"Invalid body: {msg}")
    return ParsedLine(index, cid, request=req)


def iter_lines(path: str, endpoint: str, endpoints: dict[str, BatchEndpoint]) -> Iterator[ParsedLine]:
    """Parse the input file line by line (never whole into memory); blank lines are skipped."""
    seen: set[str] = set()
    index = 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            line = parse_line(index, raw, endpoint, endpoints, seen)
            line.line_no = line_no
            yield line
            index += 1


def count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


def result_record(custom_id: str, rid: str, body: dict) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}


def request_error_record(custom_id: str, rid: str, message: str, status: int = 400) -> dict:
    """A request that was valid as a line but that the engine refused (e.g. too long for the context)."""
    err = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": rid, "body": {"error": err}}, "error": None}


def line_error_record(line: ParsedLine) -> dict:
    """A line that failed validation: it never ran."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": None,
            "error": {"code": line.error_code, "message": line.error_message, "line": line.line_no}}
