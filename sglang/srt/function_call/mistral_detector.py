"""Mistral format: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (a single object is accepted too)."""

from __future__ import annotations

from sglang.srt.function_call.base_format_detector import Arguments, JsonToolDetector


class MistralDetector(JsonToolDetector):
    markers = ("[TOOL_CALLS]",)
    call_begin = "[TOOL_CALLS] ["
    call_end = "]"

    def list_allowed(self) -> bool:
        return True

    def after_call(self, c: str) -> str:
        if c.isspace():
            return "stay"
        if self.in_list and c == ",":
            return "open"
        if self.in_list and c == "]":
            return "text"
        return "refeed"

    def render_calls(self, calls: list[tuple[str, Arguments]]) -> str:
        return "[TOOL_CALLS] [" + ", ".join(self._call_json(n, a) for n, a in calls) + "]"
