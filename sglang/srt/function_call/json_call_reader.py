"""Reads one JSON tool call, `{"name": ..., "arguments": {...}}`, a character at a time.

The reader reports the name as soon as it is complete and then passes the raw text of the arguments object
through as it arrives, so a streamed call shows its arguments growing. Whatever the order of arrival, the
reported pieces depend only on the characters, never on how they were chunked: a non-streaming parse (one
chunk) and a streaming parse (many) give the same call.

A call whose head does not read `{"name": "<known tool>", "arguments"|"parameters": {` is buffered until its
object closes and then judged as a whole: a valid call in another key order (or with arguments encoded as a
JSON string) is accepted in one piece, anything else is rejected and its text goes back to the content.
"""

from __future__ import annotations

import json
from typing import Optional

import regex

# The head of a call in the usual key order, up to the opening brace of its arguments.
_HEAD = regex.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*\{')

Event = tuple  # ("name", str) | ("args", str) | ("call", name, args) | ("reject", raw) | ("end",) | ("end_marker",)


def accept_call(text: str, names: set[str]) -> Optional[tuple[str, str]]:
    """(name, arguments JSON) when `text` is one complete call object naming a known tool, else None."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models encode the arguments object as a string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class JsonCallReader:
    def __init__(self, names: set[str], end_marker: Optional[str] = None) -> None:
        self.names = names
        self.end_marker = end_marker
        self.raw = ""
        self.depth = 0
        self.in_str = False
        self.escaped = False
        self.mode = "head"  # head -> args -> tail, or head -> buffer
        self.held = ""  # argument text that might be the start of the end marker
        self.emitted_call = False

    def push(self, c: str) -> list[Event]:
        self.raw += c
        self._scan(c)
        if self.end_marker and self.raw.endswith(self.end_marker):
            return self._on_end_marker()
        if self.mode == "head":
            return self._head()
        if self.mode == "args":
            return self._args(c)
        if self.mode == "tail":
            return [("end",)] if self.depth == 0 else []
        return self._buffer()

    def finish(self) -> list[Event]:
        """The text ended inside this call (e.g. cut by max_tokens)."""
        if self.mode == "args" and self.held:
            held, self.held = self.held, ""
            return [("args", held)]
        if self.mode == "buffer":
            return [("reject", self.raw)]
        return []  # a head cut short is dropped: it is half a call, not content

    def _scan(self, c: str) -> None:
        if self.in_str:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_str = False
        elif c == '"':
            self.in_str = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1

    def _head(self) -> list[Event]:
        m = _HEAD.fullmatch(self.raw, partial=True)
        if m is None:
            self.mode = "buffer"
            return self._buffer()
        if m.partial:
            return []
        try:
            name = json.loads('"' + m.group(1) + '"')
        except json.JSONDecodeError:
            name = None
        if name not in self.names:
            self.mode = "buffer"
            return self._buffer()
        self.mode = "args"
        self.emitted_call = True
        return [("name", name), ("args", "{")]

    def _args(self, c: str) -> list[Event]:
        self.held += c
        if self.depth <= 1:  # the arguments object just closed
            held, self.held = self.held, ""
            self.mode = "tail"
            events: list[Event] = [("args", held)]
            if self.depth == 0:
                events.append(("end",))
            return events
        keep = self._marker_prefix_len(self.held)
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        return [("args", out)] if out else []

    def _buffer(self) -> list[Event]:
        if self.depth > 0 or self.in_str:
            return []
        accepted = accept_call(self.raw, self.names)
        if accepted is None:
            return [("reject", self.raw)]
        self.emitted_call = True
        return [("call", *accepted), ("end",)]

    def _on_end_marker(self) -> list[Event]:
        if self.mode == "args":
            self.held = ""  # the call is malformed; its arguments end where they stopped
            return [("end_marker",)]
        if self.mode == "tail":
            return [("end_marker",)]
        body = self.raw[: len(self.raw) - len(self.end_marker or "")]
        accepted = accept_call(body, self.names)
        if accepted is None:
            return [("reject", self.raw)]
        self.emitted_call = True
        return [("call", *accepted), ("end_marker",)]

    def _marker_prefix_len(self, text: str) -> int:
        if not self.end_marker:
            return 0
        for k in range(min(len(text), len(self.end_marker) - 1), 0, -1):
            if self.end_marker.startswith(text[-k:]):
                return k
        return 0
