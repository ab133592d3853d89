"""Llama 3.x JSON format: `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`), several calls
separated by `;`. A bare object counts as a call only at the start of the output or right after a call."""

from __future__ import annotations

from sglang.srt.function_call.base_format_detector import Arguments, JsonToolDetector


class Llama32Detector(JsonToolDetector):
    markers = ("<|python_tag|>",)
    body_markers = ("{",)
    arguments_key = "parameters"

    def after_call(self, c: str) -> str:
        if c.isspace():
            return "stay"
        return "open" if c == ";" else "refeed"

    def render_calls(self, calls: list[tuple[str, Arguments]]) -> str:
        return "; ".join(self._call_json(n, a) for n, a in calls)
