"""Pythonic format (Llama 3.2 / 4 style): a Python list of calls, `[get_weather(city="Paris"), now()]`, at the
start of the output or of a line. Keyword values are Python literals; they become JSON arguments.

A list is only judged once its closing bracket arrives (Python literals cannot be passed through as JSON
fragments), so each call streams as its name and then its whole arguments object.
"""

from __future__ import annotations

import ast
import json
from typing import Any, Optional

import regex

from sglang.srt.constrained.base_grammar_backend import close_declared_objects
from sglang.srt.function_call.base_format_detector import CALL_MAX_WHITESPACE, Arguments, CharDetector
from sglang.srt.function_call.core_types import StreamingParseResult, ToolCallItem, ToolSpec

_HEAD = regex.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")


_NAMED_CONSTANTS = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def literal(node: ast.AST) -> Any:
    """A Python literal, also accepting JSON's true / false / null (models mix them up)."""
    if isinstance(node, ast.Name) and node.id in _NAMED_CONSTANTS:
        return _NAMED_CONSTANTS[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            if k is None:
                raise ValueError("dict unpacking is not a literal")
            out[literal(k)] = literal(v)
        return out
    return ast.literal_eval(node)


def parse_call_list(source: str, names: set[str]) -> Optional[list[tuple[str, str]]]:
    """[(name, arguments JSON)] when `source` is a list of keyword-only calls to known tools, else None."""
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError:
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        if node.func.id not in names:
            return None
        try:
            args = {kw.arg: literal(kw.value) for kw in node.keywords if kw.arg is not None}
            calls.append((node.func.id, json.dumps(args, ensure_ascii=False)))
        except (ValueError, TypeError, SyntaxError):
            return None
    return calls


def python_literal(value: Any) -> str:
    """Python source for a JSON value, strings double-quoted as JSON writes them."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(json.dumps(str(k)) + ": " + python_literal(v) for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


def arguments_format(properties: list[tuple[str, dict]], required: set[str], i: int, first: bool) -> Optional[dict]:
    """Structural-tag format of `k=value` pairs for properties[i:], in declared order, the optional ones
    skippable, separated by ", " (`first`: nothing written before). Values follow each property's JSON schema
    (JSON literals, which the parser also reads). None when nothing is left."""
    if i == len(properties):
        return None
    key, schema = properties[i]
    rest = arguments_format(properties, required, i + 1, False)
    item = {"type": "sequence", "elements": [
        {"type": "const_string", "value": ("" if first else ", ") + key + "="},
        {"type": "json_schema", "json_schema": close_declared_objects(schema),
         "max_whitespace_cnt": CALL_MAX_WHITESPACE},
        *([rest] if rest else []),
    ]}
    if key in required:
        return item
    skip = arguments_format(properties, required, i + 1, first)
    return {"type": "or", "elements": [item, skip]} if skip else {"type": "optional", "content": item}


class PythonicDetector(CharDetector):
    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools)
        self.in_list = False
        self.buf = ""
        self.depth = 0
        self.quote = ""
        self.escaped = False
        self.line_start = True

    def render_calls(self, calls: list[tuple[str, Arguments]]) -> str:
        def call(name: str, args: Arguments) -> str:
            values = json.loads(args) if isinstance(args, str) else args
            return name + "(" + ", ".join(f"{k}={python_literal(v)}" for k, v in values.items()) + ")"

        return "[" + ", ".join(call(n, a) for n, a in calls) + "]"

    def call_format(self, tool: ToolSpec) -> Optional[dict[str, Any]]:
        props = tool.parameters.get("properties") or {}
        args = arguments_format(list(props.items()), set(tool.parameters.get("required") or []), 0, True)
        elements = [{"type": "const_string", "value": "[" + tool.name + "("}, *([args] if args else []),
                    {"type": "const_string", "value": ")]"}]
        return {"type": "sequence", "elements": elements}

    def has_tool_call(self, text: str) -> bool:
        return any(_HEAD.match(line.strip()) for line in text.splitlines())

    def finish(self) -> StreamingParseResult:
        if self.in_list and _HEAD.match(self.buf, partial=True) is None:
            self._reject()  # not a call list: it is content; a call list cut short is dropped
        self._end_spaces()
        return self._settled()

    def _step(self, c: str) -> None:
        if not self.in_list:
            if c == "[" and self.line_start:
                self.in_list, self.buf, self.depth, self.quote = True, "[", 1, ""
                self.saved_spaces, self.spaces = self.spaces, ""
                return
            self._content(c)
            return
        self.buf += c
        self._scan(c)
        if _HEAD.match(self.buf, partial=True) is None:
            self._reject()
        elif self.depth == 0:
            calls = parse_call_list(self.buf, self.names)
            if calls is None:
                self._reject()
                return
            for name, args in calls:
                self.out.calls.append(ToolCallItem(self.call_index, name=name))
                self.out.calls.append(ToolCallItem(self.call_index, parameters=args))
                self.call_index += 1
            self.in_list, self.buf, self.line_start = False, "", True

    def _scan(self, c: str) -> None:
        if self.quote:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == self.quote:
                self.quote = ""
        elif c in "'\"":
            self.quote = c
        elif c in "([{":
            self.depth += 1
        elif c in ")]}":
            self.depth -= 1

    def _reject(self) -> None:
        """The bracket opened no call list: it and what followed are content."""
        buf, self.buf, self.in_list = self.buf, "", False
        self.spaces = self.saved_spaces
        self._content("[")
        for c in buf[1:]:
            self._step(c)

    def _content(self, c: str) -> None:
        self.line_start = c == "\n" or (self.line_start and c.isspace())
        super()._content(c)
