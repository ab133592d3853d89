"""Hermes / Qwen 2.5 format: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call."""

from __future__ import annotations

from sglang.srt.function_call.base_format_detector import JsonToolDetector


class Qwen25Detector(JsonToolDetector):
    markers = ("<tool_call>",)
    end_marker = "</tool_call>"
    call_begin = "<tool_call>\n"
    call_end = "\n</tool_call>"

    def after_call(self, c: str) -> str:
        kept = (self.after_buf + c).lstrip()
        if not kept or (self.end_marker.startswith(kept) and kept != self.end_marker):
            return "stay"
        return "text" if kept == self.end_marker else "refeed"
