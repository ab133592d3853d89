"""FunctionCallParser: the tool-call format chosen with --tool-call-parser, for one model output."""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from sglang.srt.function_call.base_format_detector import BaseFormatDetector
from sglang.srt.function_call.core_types import StreamingParseResult, ToolCallItem, tool_specs
from sglang.srt.function_call.deepseekv3_detector import DeepSeekV3Detector
from sglang.srt.function_call.gpt_oss_detector import GptOssDetector
from sglang.srt.function_call.llama32_detector import Llama32Detector
from sglang.srt.function_call.mistral_detector import MistralDetector
from sglang.srt.function_call.pythonic_detector import PythonicDetector
from sglang.srt.function_call.qwen25_detector import Qwen25Detector

TOOL_CALL_PARSERS: dict[str, type[BaseFormatDetector]] = {
    "qwen25": Qwen25Detector,
    "qwen": Qwen25Detector,
    "hermes": Qwen25Detector,
    "llama3": Llama32Detector,
    "mistral": MistralDetector,
    "pythonic": PythonicDetector,
    "gpt-oss": GptOssDetector,
    "deepseekv3": DeepSeekV3Detector,
}


def check_tool_call_parser(name: str) -> None:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"Unknown tool call parser {name!r}; choose one of {', '.join(sorted(TOOL_CALL_PARSERS))}")


class FunctionCallParser:
    """Parses one output (streamed or whole) against the request's tools."""

    def __init__(self, tools: Optional[list[dict[str, Any]]], tool_call_parser: str) -> None:
        check_tool_call_parser(tool_call_parser)
        self.tools = tool_specs(tools)
        self.detector = TOOL_CALL_PARSERS[tool_call_parser](self.tools)

    def has_tool_call(self, text: str) -> bool:
        return self.detector.has_tool_call(text)

    def parse_non_stream(self, text: str) -> tuple[str, list[ToolCallItem]]:
        result = self.detector.detect_and_parse(text)
        return result.normal_text, result.calls

    def parse_stream_chunk(self, chunk: str) -> tuple[str, list[ToolCallItem]]:
        result = self.detector.parse_streaming_increment(chunk)
        return result.normal_text, result.calls

    def finish(self) -> tuple[str, list[ToolCallItem]]:
        result: StreamingParseResult = self.detector.finish()
        return result.normal_text, result.calls

    def tool_index(self, name: Optional[str]) -> int:
        """The position of the named tool in the request's list (-1 when unknown)."""
        return next((i for i, t in enumerate(self.tools) if t.name == name), -1)

    def structural_tag(self, tool_choice: Union[str, dict[str, Any]]) -> Optional[str]:
        """The constraint that makes the model produce one call in this format: of the named function, or (for
        "required") of any tool. None when this format has no constrained form."""
        if isinstance(tool_choice, dict):
            wanted = tool_choice.get("function", {}).get("name")
            tools = [t for t in self.tools if t.name == wanted]
        else:
            tools = self.tools
        formats = [self.detector.call_format(t) for t in tools]
        if not formats or any(f is None for f in formats):
            return None
        fmt = formats[0] if len(formats) == 1 else {"type": "or", "elements": formats}
        return json.dumps({"type": "structural_tag", "format": fmt})
