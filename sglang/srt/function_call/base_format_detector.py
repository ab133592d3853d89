"""The interface every tool-call format implements, and the shared machinery of the JSON formats.

A detector is stateful: one instance reads one model output, either in one piece (`detect_and_parse`) or chunk
by chunk (`parse_streaming_increment`, then `finish`). Streaming and non-streaming share the same per-character
state machine, so the concatenated streamed result always equals the non-streamed one.

Text outside calls is content. Text that could still become a call marker is held back until it is decided,
and whitespace that only separates content from calls is dropped, so no half call ever reaches the content.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any, Optional, Union

from sglang.srt.constrained.base_grammar_backend import close_declared_objects
from sglang.srt.function_call.core_types import StreamingParseResult, ToolCallItem, ToolSpec, merge_calls
from sglang.srt.function_call.json_call_reader import JsonCallReader

# A call's arguments: an object, or its JSON text.
Arguments = Union[dict[str, Any], str]

# Whitespace between the JSON tokens of a constrained call: one character at a time. Arguments need no layout,
# and a small model given more room fills it with blank lines until max_tokens.
CALL_MAX_WHITESPACE = 1


class BaseFormatDetector(ABC):
    def __init__(self, tools: list[ToolSpec]) -> None:
        self.tools = tools
        self.names = {t.name for t in tools}
        self.call_index = 0  # index of the next call in this output

    @abstractmethod
    def parse_streaming_increment(self, new_text: str) -> StreamingParseResult:
        """Consume the next chunk of model output; return the content and call pieces it settles."""

    @abstractmethod
    def finish(self) -> StreamingParseResult:
        """The output has ended: settle whatever is held back."""

    @abstractmethod
    def has_tool_call(self, text: str) -> bool:
        """Whether `text` contains the start of a call in this format."""

    def detect_and_parse(self, text: str) -> StreamingParseResult:
        """Parse a whole output (this instance must be fresh): one item per call, arguments complete."""
        result = self.parse_streaming_increment(text)
        result.extend(self.finish())
        result.calls = merge_calls(result.calls)
        return result

    @abstractmethod
    def render_calls(self, calls: list[tuple[str, Arguments]]) -> str:
        """The text a model of this format writes for these (name, arguments) calls: used to show the model the
        format, and to put earlier calls back into a chat template that does not render `tool_calls`. Arguments
        given as JSON text are written as they are where the format allows, so a call the model made renders
        back to the text it generated (and the next turn finds it in the prefix cache)."""

    def call_format(self, tool: ToolSpec) -> Optional[dict[str, Any]]:
        """An xgrammar structural-tag format that produces exactly one call of `tool` in this format, or None
        when the format cannot be expressed that way."""
        return None


class CharDetector(BaseFormatDetector):
    """A detector that reads the output one character at a time (`_step`), holding whitespace between content and
    calls (`spaces`: dropped before a call, kept at the end of an output that made none) and collecting what it
    settles in `out`."""

    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools)
        self.spaces = ""  # whitespace held until we know whether content follows it
        self.saved_spaces = ""  # whitespace before a marker, given back if the marker opens no call
        self.out = StreamingParseResult()

    @abstractmethod
    def _step(self, c: str) -> None:
        """Read one character of the output."""

    def parse_streaming_increment(self, new_text: str) -> StreamingParseResult:
        for c in new_text:
            self._step(c)
        return self._settled()

    def _settled(self) -> StreamingParseResult:
        out, self.out = self.out, StreamingParseResult()
        return out

    def _end_spaces(self) -> None:
        """The output ended: held whitespace is content where no call was made."""
        if self.call_index == 0:
            self.out.normal_text += self.spaces
        self.spaces = ""

    def _content(self, c: str) -> None:
        if c.isspace():
            self.spaces += c
            return
        self.out.normal_text += self.spaces + c
        self.spaces = ""


class JsonToolDetector(CharDetector):
    """Formats whose calls are JSON objects `{"name", "arguments"}`, introduced by a marker.

    Subclasses set `markers` (text that opens a call), `body_markers` (markers that are themselves the first
    character of the call object, like a bare `{`), `end_marker` (text that closes each call) and override
    `after_call` to say what may follow a call (a separator, the end of a list, the end marker).
    """

    markers: tuple[str, ...] = ()
    body_markers: tuple[str, ...] = ()
    end_marker: Optional[str] = None
    arguments_key = "arguments"
    call_begin = ""  # text the constrained form of a call starts and ends with
    call_end = ""

    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools)
        self.state = "text"  # text | open | body | after
        self.pending = ""  # text that may be the start of a marker
        self.at_boundary = True  # at the start of the output or right after a call
        self.marker = ""
        self.open_buf = ""
        self.in_list = False
        self.after_buf = ""
        self.reader: Optional[JsonCallReader] = None

    # ---- the interface ----
    def finish(self) -> StreamingParseResult:
        while self.state == "body" and self.reader is not None:
            reader = self.reader
            self._handle(reader.finish())
            if self.reader is reader:  # not rejected: a call cut short ends here
                self.call_index += reader.emitted_call
                self.reader = None
        if self.state == "text":  # also after a rejected call was read again as text
            pending, self.pending = self.pending, ""
            for c in pending:
                self._content(c)
        self._end_spaces()
        self.state = "done"
        return self._settled()

    def has_tool_call(self, text: str) -> bool:
        stripped = text.lstrip()
        return any(m in text for m in self.markers) or any(stripped.startswith(m) for m in self.body_markers)

    def render_calls(self, calls: list[tuple[str, Arguments]]) -> str:
        return "\n".join(self.call_begin + self._call_json(n, a) + self.call_end for n, a in calls)

    def _call_json(self, name: str, args: Arguments) -> str:
        raw = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return "{" + f'"name": {json.dumps(name, ensure_ascii=False)}, "{self.arguments_key}": {raw}' + "}"

    def call_format(self, tool: ToolSpec) -> Optional[dict[str, Any]]:
        schema = {
            "type": "object",
            "properties": {"name": {"const": tool.name}, self.arguments_key: close_declared_objects(tool.parameters)},
            "required": ["name", self.arguments_key],
        }
        elements: list[dict[str, Any]] = []
        if self.call_begin:
            elements.append({"type": "const_string", "value": self.call_begin})
        elements.append({"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": CALL_MAX_WHITESPACE})
        if self.call_end:
            elements.append({"type": "const_string", "value": self.call_end})
        return {"type": "sequence", "elements": elements} if len(elements) > 1 else elements[0]

    # ---- what may follow a call; subclasses override ----
    def after_call(self, c: str) -> str:
        """Given the next character after a call (`self.after_buf` holds those already kept): 'stay' (keep
        it and read on), 'open' (another call follows), 'text' (back to content, dropping what was kept), or
        'refeed' (back to content, re-reading what was kept and `c` as text)."""
        if c.isspace():
            return "stay"
        return "refeed"

    # ---- the state machine ----
    def _marker_allowed(self, marker: str) -> bool:
        return marker not in self.body_markers or self.at_boundary

    def _step(self, c: str) -> None:
        handler = {"text": self._text, "open": self._open, "body": self._body, "after": self._after}[self.state]
        handler(c)

    def _text(self, c: str) -> None:
        self.pending += c
        while self.pending:
            candidates = [m for m in self.markers + self.body_markers if self._marker_allowed(m)]
            if self.pending in candidates:
                marker, self.pending = self.pending, ""
                self._start_call(marker)
                return
            if any(m.startswith(self.pending) for m in candidates):
                return
            self._content(self.pending[0])
            self.pending = self.pending[1:]

    def _content(self, c: str) -> None:
        super()._content(c)
        if not c.isspace():
            self.at_boundary = False

    def _start_call(self, marker: str) -> None:
        self.saved_spaces, self.spaces = self.spaces, ""
        self.marker = marker
        self.open_buf = ""
        self.in_list = False
        if marker in self.body_markers:
            self._begin_body(marker)
        else:
            self.state = "open"

    def _begin_body(self, first: str) -> None:
        self.state = "body"
        self.reader = JsonCallReader(self.names, self.end_marker)
        self._handle(self.reader.push(first))

    def _open(self, c: str) -> None:
        if c.isspace():
            self.open_buf += c
        elif c == "{":
            self._begin_body(c)
        elif c == "[" and self.list_allowed() and not self.in_list:
            self.open_buf += c
            self.in_list = True
        else:
            self._reject(self.open_buf + c)

    def list_allowed(self) -> bool:
        return False

    def _body(self, c: str) -> None:
        assert self.reader is not None
        self._handle(self.reader.push(c))

    def _after(self, c: str) -> None:
        decision = self.after_call(c)
        if decision == "stay":
            self.after_buf += c
        elif decision == "open":
            self.state, self.open_buf, self.marker = "open", "", ""
        elif decision == "text":
            self.state, self.after_buf = "text", ""
        elif decision == "refeed":
            held, self.after_buf = self.after_buf + c, ""
            self.state = "text"
            for ch in held:
                self._step(ch)

    def _handle(self, events: list[tuple]) -> None:
        for ev in events:
            kind = ev[0]
            if kind == "name":
                self.out.calls.append(ToolCallItem(self.call_index, name=ev[1]))
            elif kind == "args":
                self.out.calls.append(ToolCallItem(self.call_index, parameters=ev[1]))
            elif kind == "call":
                self.out.calls.append(ToolCallItem(self.call_index, name=ev[1], parameters=ev[2]))
            elif kind == "reject":
                body_marker = self.marker in self.body_markers
                self._reject(ev[1][len(self.marker):] if body_marker else self.open_buf + ev[1])
            elif kind in ("end", "end_marker"):
                self.call_index += 1
                self.saved_spaces = ""
                self.reader = None
                self.at_boundary = True
                self.after_buf = ""
                self.state = "after" if kind == "end" else "text"

    def _reject(self, rest: str) -> None:
        """What followed a marker is not a call: the marker is content and `rest` is read again as text."""
        self.reader = None
        self.state = "text"
        self.spaces, self.saved_spaces = self.saved_spaces, ""
        for c in self.marker:
            self._content(c)
        for c in rest:
            self._step(c)
