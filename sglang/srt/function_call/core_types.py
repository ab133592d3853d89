"""Values the tool-call parsers exchange: tools, parsed calls and the result of one parse step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ToolCallItem:
    """One piece of a tool call. A streaming parser emits the name once (with `parameters` possibly empty), then
    argument fragments with `name=None`; a non-streaming parse gives one item per call with everything."""

    call_index: int
    name: Optional[str] = None
    parameters: str = ""


@dataclass
class StreamingParseResult:
    normal_text: str = ""
    calls: list[ToolCallItem] = field(default_factory=list)

    def extend(self, other: StreamingParseResult) -> StreamingParseResult:
        self.normal_text += other.normal_text
        self.calls.extend(other.calls)
        return self


def merge_calls(items: list[ToolCallItem]) -> list[ToolCallItem]:
    """Fold streamed pieces into one item per call (name from the first piece, fragments concatenated)."""
    merged: dict[int, ToolCallItem] = {}
    for item in items:
        call = merged.setdefault(item.call_index, ToolCallItem(item.call_index))
        if item.name is not None:
            call.name = item.name
        call.parameters += item.parameters
    return [merged[i] for i in sorted(merged)]


@dataclass(frozen=True)
class ToolSpec:
    """The part of an OpenAI tool the parsers and the constraint builder need."""

    name: str
    parameters: dict[str, Any]
    description: str = ""

    @staticmethod
    def from_openai(tool: dict[str, Any]) -> ToolSpec:
        fn = tool.get("function") or {}
        params = fn.get("parameters")
        return ToolSpec(fn.get("name", ""), params if isinstance(params, dict) else {"type": "object"},
                        fn.get("description") or "")


def tool_specs(tools: Optional[list[dict[str, Any]]]) -> list[ToolSpec]:
    return [ToolSpec.from_openai(t) for t in tools or []]
