"""Native POST /parse_function_call and POST /separate_reasoning: the server's parsers on a given text."""

from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter, Request

from sglang.srt.entrypoints.body_schemas import (
    ParseFunctionCallBody,
    SeparateReasoningBody,
    body_openapi,
    check_body,
)
from sglang.srt.entrypoints.openai.tool_requests import validate_tools
from sglang.srt.entrypoints.responses import ORJSONResponse
from sglang.srt.entrypoints.server_state import native_error, read_json, server_state
from sglang.srt.function_call import FunctionCallParser
from sglang.srt.reasoning_parser import make_reasoning_parser

router = APIRouter()


def parse_function_call(body: Any, default_parser: Optional[str]) -> dict[str, Any]:
    """{"text", "tools", "tool_call_parser"} -> {"normal_text", "calls": [{"tool_index", "name", "parameters"}]}"""
    if not isinstance(body, dict) or not isinstance(body.get("text"), str):
        raise ValueError("'text' is required and must be a string")
    tools = body.get("tools")
    if not isinstance(tools, list):
        raise ValueError("'tools' is required and must be a list of tools")
    body = check_body(ParseFunctionCallBody, body)
    validate_tools(tools, None)
    name = body.get("tool_call_parser") or default_parser
    if not name:
        raise ValueError("'tool_call_parser' is required (the server was started without --tool-call-parser)")
    parser = FunctionCallParser(tools, name)
    normal_text, calls = parser.parse_non_stream(body["text"])
    return {
        "normal_text": normal_text,
        "calls": [{"tool_index": parser.tool_index(c.name), "name": c.name, "parameters": c.parameters}
                  for c in calls],
    }


def separate_reasoning(body: Any, default_parser: Optional[str]) -> dict[str, str]:
    """{"text", "reasoning_parser"} -> {"reasoning_text", "text"}"""
    if not isinstance(body, dict) or not isinstance(body.get("text"), str):
        raise ValueError("'text' is required and must be a string")
    body = check_body(SeparateReasoningBody, body)
    name = body.get("reasoning_parser") or default_parser
    if not name:
        raise ValueError("'reasoning_parser' is required (the server was started without --reasoning-parser)")
    reasoning, text = make_reasoning_parser(name).parse_non_stream(body["text"])
    return {"reasoning_text": reasoning, "text": text}


@router.post("/parse_function_call", openapi_extra=body_openapi(ParseFunctionCallBody))
async def parse_function_call_route(request: Request):
    state = server_state(request)
    try:
        return ORJSONResponse(parse_function_call(await read_json(request), state.args.tool_call_parser))
    except ValueError as e:
        return native_error(str(e))


@router.post("/separate_reasoning", openapi_extra=body_openapi(SeparateReasoningBody))
async def separate_reasoning_route(request: Request):
    state = server_state(request)
    try:
        return ORJSONResponse(separate_reasoning(await read_json(request), state.args.reasoning_parser))
    except ValueError as e:
        return native_error(str(e))
