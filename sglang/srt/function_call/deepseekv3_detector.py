"""DeepSeek-V3 format (DeepSeek-V3 / V2.5 chat templates): calls between `<｜tool▁calls▁begin｜>` and
`<｜tool▁calls▁end｜>`, each `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then the arguments in a fenced JSON
block and `<｜tool▁call▁end｜>`, calls separated by whitespace.

A call is judged once its end marker arrives, so each call streams as its name and then its whole arguments (kept as
written, as the JSON formats keep theirs). Calls to unknown tools, or text after the opening marker that is not a
call, go back to the content; a call cut short by the end of the output is dropped.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import regex

from sglang.srt.constrained.base_grammar_backend import close_declared_objects
from sglang.srt.function_call.base_format_detector import CALL_MAX_WHITESPACE, Arguments, CharDetector
from sglang.srt.function_call.core_types import StreamingParseResult, ToolCallItem, ToolSpec

CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"
ARGS_OPEN = "\n```json\n"
ARGS_CLOSE = "\n```"

_CALL = (rf"\s*{regex.escape(CALL_BEGIN)}function{regex.escape(SEP)}(?P<name>[^\n<]+){regex.escape(ARGS_OPEN)}"
         rf"(?P<args>.*?){regex.escape(ARGS_CLOSE + CALL_END)}")
_CALL_RE = regex.compile(_CALL, regex.DOTALL)
_END_RE = regex.compile(rf"\s*{regex.escape(CALLS_END)}")
# what may follow the opening marker or a call: another call or the closing marker
_NEXT_RE = regex.compile(rf"(?:{_CALL}|\s*{regex.escape(CALLS_END)})", regex.DOTALL)


class DeepSeekV3Detector(CharDetector):
    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools)
        self.pending = ""  # text that may be the start of the opening marker
        self.in_calls = False
        self.buf = ""  # what followed the opening marker and is not yet a whole call
        self.emitted = 0  # calls emitted since the opening marker

    def render_calls(self, calls: list[tuple[str, Arguments]]) -> str:
        def call(name: str, args: Arguments) -> str:
            raw = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            return f"{CALL_BEGIN}function{SEP}{name}{ARGS_OPEN}{raw}{ARGS_CLOSE}{CALL_END}"

        return CALLS_BEGIN + "\n".join(call(n, a) for n, a in calls) + CALLS_END

    def call_format(self, tool: ToolSpec) -> Optional[dict[str, Any]]:
        return {"type": "sequence", "elements": [
            {"type": "const_string", "value": f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}{tool.name}{ARGS_OPEN}"},
            {"type": "json_schema", "json_schema": close_declared_objects(tool.parameters),
             "max_whitespace_cnt": CALL_MAX_WHITESPACE},
            {"type": "const_string", "value": f"{ARGS_CLOSE}{CALL_END}{CALLS_END}"},
        ]}

    def has_tool_call(self, text: str) -> bool:
        return CALLS_BEGIN in text

    def finish(self) -> StreamingParseResult:
        if self.in_calls:
            if _NEXT_RE.fullmatch(self.buf, partial=True) is None:
                self._reject()  # not calls: content (a call cut short is dropped)
            self.in_calls, self.buf = False, ""
        pending, self.pending = self.pending, ""
        for c in pending:
            self._content(c)
        self._end_spaces()
        return self._settled()

    def _step(self, c: str) -> None:
        if not self.in_calls:
            self.pending += c
            if self.pending == CALLS_BEGIN:
                self.in_calls, self.buf, self.emitted, self.pending = True, "", 0, ""
                self.saved_spaces, self.spaces = self.spaces, ""
            elif not CALLS_BEGIN.startswith(self.pending):
                pending, self.pending = self.pending, ""
                self._content(pending[0])
                for rest in pending[1:]:
                    self._step(rest)
            return
        self.buf += c
        call = _CALL_RE.fullmatch(self.buf)
        if call is not None:
            name = call["name"].strip()
            if name not in self.names:
                self._reject()
                return
            self.out.calls.append(ToolCallItem(self.call_index, name=name))
            self.out.calls.append(ToolCallItem(self.call_index, parameters=call["args"].strip()))
            self.call_index += 1
            self.emitted += 1
            self.buf = ""
        elif _END_RE.fullmatch(self.buf) is not None:
            self.in_calls, self.buf = False, ""
        elif _NEXT_RE.fullmatch(self.buf, partial=True) is None:
            self._reject()

    def _reject(self) -> None:
        """What followed the opening marker (or the last call) is no call: it is content, the marker too where no
        call came after it."""
        buf, self.buf, self.in_calls = self.buf, "", False
        if self.emitted == 0:
            self.spaces = self.saved_spaces
            for c in CALLS_BEGIN:
                self._content(c)
        for c in buf:
            self._step(c)

