"""Tool-call parsing: one detector class per model format behind one interface (see base_format_detector)."""

from sglang.srt.function_call.core_types import StreamingParseResult, ToolCallItem, ToolSpec
from sglang.srt.function_call.function_call_parser import (
    TOOL_CALL_PARSERS,
    FunctionCallParser,
    check_tool_call_parser,
)

__all__ = ["FunctionCallParser", "StreamingParseResult", "TOOL_CALL_PARSERS", "ToolCallItem", "ToolSpec",
           "check_tool_call_parser"]
