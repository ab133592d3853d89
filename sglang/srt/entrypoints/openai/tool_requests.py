"""The request side of tool calling: validating `tools` / `tool_choice`, giving the tools and earlier calls to
the chat template, and the grammar that enforces `tool_choice: "required"` or a named function."""

from __future__ import annotations

import copy
import json
import logging
import re
from typing import Any, Optional, Union

from jsonschema import SchemaError
from jsonschema.validators import validator_for

from sglang.srt.function_call import FunctionCallParser

logger = logging.getLogger(__name__)

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_CONSTRAINT_KEYS = ("regex", "ebnf", "json_schema", "structural_tag")

ToolChoice = Union[str, dict[str, Any], None]


def forced_tool_choice(tool_choice: ToolChoice) -> bool:
    """`required` or a named function: the output must be a call."""
    return tool_choice == "required" or isinstance(tool_choice, dict)


def tools_active(tools: Optional[list], tool_choice: ToolChoice) -> bool:
    return bool(tools) and tool_choice != "none"


def validate_tools(tools: Optional[list[dict[str, Any]]], tool_choice: ToolChoice) -> None:
    """Raise ValueError naming the field when `tools` or `tool_choice` is unusable."""
    names: list[str] = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}].type must be 'function'")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"tools[{i}].function is required and must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise ValueError(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_', '.' or '-', got {name!r}")
        if name in names:
            raise ValueError(f"tools[{i}].function.name {name!r} is used by more than one tool")
        names.append(name)
        _check_parameters(i, fn.get("parameters"))
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if isinstance(tool_choice, str):
        if tool_choice != "required":
            raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}")
        if not names:
            raise ValueError("tool_choice 'required' needs at least one tool in 'tools'")
        return
    wanted = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
    if not isinstance(wanted, str):
        raise ValueError('tool_choice must look like {"type": "function", "function": {"name": "..."}}')
    if wanted not in names:
        raise ValueError(f"tool_choice names the function {wanted!r}, which is not in 'tools'")


def _check_parameters(i: int, params: Any) -> None:
    if params is None:
        return
    where = f"tools[{i}].function.parameters"
    if not isinstance(params, dict):
        raise ValueError(f"{where} must be a JSON schema object")
    try:
        validator_for(params).check_schema(params)
    except SchemaError as e:
        path = "/".join(str(p) for p in e.path)
        where_in = f" (at {path})" if path else ""
        raise ValueError(f"{where} is not a valid JSON schema: {e.message}{where_in}") from None
    if params.get("type", "object") != "object":
        raise ValueError(f"{where} must describe an object (type 'object'), got type {params.get('type')!r}")


def template_messages(messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]], active: bool,
                      template_source: str, parser: Optional[FunctionCallParser]) -> list[dict[str, Any]]:
    """Messages ready for the chat template.

    Templates read a call's arguments as an object, so JSON-string arguments are decoded. A template that does
    not render `tool_calls` gets the calls written into the assistant's content in the parser's format, and a
    template that ignores `tools` gets them described in the system message; either way the model sees what a
    tool-aware template would have shown it, and a conversation re-renders the same text turn after turn.
    """
    out = []
    renders_calls = "tool_calls" in template_source
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            decoded = [_decoded_call(c) for c in calls]
            if not renders_calls and parser is not None:
                # The arguments as the client sent them back: the text the model generated, when it made the call.
                pairs = [(d["function"]["name"], _raw_arguments(c, d)) for c, d in zip(calls, decoded)]
                text = parser.detector.render_calls(pairs)
                m = dict(m, content=(m.get("content") or "") + ("\n" if m.get("content") else "") + text)
            m = dict(m, tool_calls=decoded)
        out.append(m)
    if active and parser is not None and "tools" not in template_source:
        prompt = tool_system_prompt(tools or [], parser)
        if out and out[0].get("role") == "system":
            out[0] = dict(out[0], content=(out[0].get("content") or "") + "\n\n" + prompt)
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _raw_arguments(call: dict[str, Any], decoded: dict[str, Any]) -> Any:
    raw = (call.get("function") or {}).get("arguments")
    return raw if isinstance(raw, str) and raw.strip() else decoded["function"]["arguments"]


def _decoded_call(call: dict[str, Any]) -> dict[str, Any]:
    call = copy.deepcopy(call)
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise ValueError(f"tool_calls arguments of {fn.get('name')!r} are not valid JSON") from None
    call["function"] = fn
    return call


def tool_system_prompt(tools: list[dict[str, Any]], parser: FunctionCallParser) -> str:
    listing = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    example = parser.detector.render_calls([("function_name", {"argument_name": "value"})])
    return (
        "You can call the following functions:\n" + listing + "\n\n"
        "To call a function, reply in exactly this format, with arguments that match its parameters:\n" + example
    )


def add_tool_constraint(sp: dict[str, Any], tools: Optional[list], tool_choice: ToolChoice,
                        parser: Optional[FunctionCallParser]) -> None:
    """Constrain decoding to a call when `tool_choice` forces one."""
    if not tools or tool_choice is None or not forced_tool_choice(tool_choice):
        return
    if parser is None:
        raise ValueError("tool_choice 'required' or a named function needs a server started with --tool-call-parser")
    if any(sp.get(k) is not None for k in _CONSTRAINT_KEYS):
        logger.warning("The request already has a grammar constraint; tool_choice is not enforced by decoding")
        return
    tag = parser.structural_tag(tool_choice)
    if tag is None:
        logger.warning("This tool-call format has no constrained form; tool_choice is not enforced by decoding")
        return
    sp["structural_tag"] = tag
