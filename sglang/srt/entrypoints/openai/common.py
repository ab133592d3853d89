"""Pieces shared by the OpenAI chat and completions handlers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Optional

import orjson
from fastapi import Request
from pydantic import BaseModel, ValidationError

from sglang.srt.entrypoints.openai.protocol import ErrorResponse, SamplingExtras, UsageInfo
from sglang.srt.entrypoints.responses import ORJSONResponse
from sglang.srt.entrypoints.sse import open_stream, sse_json, sse_response


def error_response(message: str, status: int = 400, err_type: str = "BadRequestError",
                   param: Optional[str] = None) -> ORJSONResponse:
    body = ErrorResponse(message=message, type=err_type, param=param, code=status)
    return ORJSONResponse(body.model_dump(), status_code=status)


def sse_error(message: str, status: int = 400, err_type: str = "BadRequestError") -> bytes:
    return sse_json({"error": ErrorResponse(message=message, type=err_type, code=status).model_dump()})


def stream_error(message: str, status: int) -> bytes:
    return sse_error(message, status, STATUS_ERROR_TYPES.get(status, "BadRequestError"))


# The error `type` of OpenAI error bodies by HTTP status.
STATUS_ERROR_TYPES = {413: "PayloadTooLarge", 500: "InternalServerError", 503: "ServiceUnavailableError",
                       504: "TimeoutError"}


def sampling_params_from(req: SamplingExtras, max_new_tokens: Optional[int], defaults: dict) -> dict:
    """Map OpenAI + SGLang-extra request fields onto native sampling_params."""

    def pick(name: str, fallback: Any) -> Any:
        val = getattr(req, name)
        return val if val is not None else defaults.get(name, fallback)

    sp: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": pick("temperature", 1.0),
        "top_p": pick("top_p", 1.0),
        "top_k": pick("top_k", -1),
        "min_p": pick("min_p", 0.0),
        "repetition_penalty": pick("repetition_penalty", 1.0),
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "min_new_tokens": req.min_tokens,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "regex": req.regex,
        "ebnf": req.ebnf,
        "ignore_eos": req.ignore_eos,
        "no_stop_trim": req.no_stop_trim,
        "skip_special_tokens": req.skip_special_tokens,
        "logit_bias": req.logit_bias,
        "n": req.n,
    }
    if req.seed is not None:
        sp["sampling_seed"] = req.seed
    return {k: v for k, v in sp.items() if v is not None or k == "max_new_tokens"}


def finish_reason_of(meta: dict) -> tuple[Optional[str], Any]:
    """(OpenAI finish_reason, matched_stop) from a native meta_info."""
    reason = meta.get("finish_reason")
    if reason is None:
        return None, None
    kind = reason.get("type")
    if kind == "stop":
        return "stop", reason.get("matched")
    if kind == "length":
        return "length", None
    return "abort", None


def build_usage(outputs: list[dict], n: int) -> UsageInfo:
    """prompt_tokens over the first choice of each prompt, completion_tokens over all choices."""
    prompt = sum(o["meta_info"]["prompt_tokens"] for i, o in enumerate(outputs) if i % n == 0)
    completion = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    cached = sum(o["meta_info"].get("cached_tokens", 0) for i, o in enumerate(outputs) if i % n == 0)
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
        prompt_tokens_details={"cached_tokens": cached} if cached > 0 else None,
    )


def as_list(out: Any) -> list[dict]:
    return out if isinstance(out, list) else [out]


def usage_chunk(chunk_id: str, obj: str, created: int, model: str, finals: dict[int, dict], n: int,
                keep_nulls: bool = False) -> bytes:
    """The last chunk of a stream with `include_usage`: no choices, the usage of all of them. As SGLang does, the
    chat stream's usage keeps its null keys and the completions stream's drops them."""
    usage = build_usage([finals[i] for i in sorted(finals)], n).model_dump(exclude_none=not keep_nulls)
    return sse_json({"id": chunk_id, "object": obj, "created": created, "model": model, "choices": [],
                     "usage": usage})


class OpenAIHandler:
    """Shared request flow: validate -> generate -> one JSON response or an SSE stream."""

    def __init__(self, tokenizer_manager) -> None:
        self.tm = tokenizer_manager

    def to_generate_input(self, req: Any) -> Any:
        raise NotImplementedError

    def build_response(self, req: Any, outputs: list[dict]) -> dict:
        raise NotImplementedError

    def stream_events(self, req: Any, outputs: AsyncIterator[dict]) -> AsyncIterator[bytes]:
        raise NotImplementedError

    async def handle(self, req: Any):
        try:
            obj = self.to_generate_input(req)
        except ValueError as e:
            return error_response(str(e))
        gen = self.tm.generate_request(obj)
        if req.stream:
            stream, error = await open_stream(gen, error_response)
            if error is not None or stream is None:
                return error
            return sse_response(gen, self.stream_events(req, stream), stream_error)
        try:
            outputs = as_list(await gen.__anext__())
        except ValueError as e:
            return error_response(str(e))
        finally:
            await gen.aclose()
        return ORJSONResponse(self.build_response(req, outputs))


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """Parse a JSON body into `model`; returns the model or an error response."""
    ctype = request.headers.get("content-type", "")
    if "application/json" not in ctype:
        return error_response("Unsupported Media Type: Only 'application/json' is allowed", 400, "Bad Request")
    raw = await request.body()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return error_response(f"Invalid JSON body: {e}", 400, "Bad Request")
    if not isinstance(data, dict):
        return error_response("The request body must be a JSON object", 400, "Bad Request")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        return error_response(_validation_message(e), 400, "Bad Request")


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts)
