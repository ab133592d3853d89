"""The response side of tools and reasoning: one choice's text split into `reasoning_content`, `content` and
`tool_calls`, whole or as stream deltas."""

from __future__ import annotations

import uuid
from typing import Any, Optional

from sglang.srt.entrypoints.openai.tool_requests import tools_active
from sglang.srt.function_call import FunctionCallParser, ToolCallItem
from sglang.srt.reasoning_parser import make_reasoning_parser


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ChoiceOutputParser:
    """Separates reasoning (with --reasoning-parser) and tool calls (with --tool-call-parser) of one choice."""

    def __init__(self, req, tool_call_parser: Optional[str], reasoning_parser: Optional[str]) -> None:
        thinking = (req.chat_template_kwargs or {}).get("enable_thinking") is not False
        self.reasoning = (make_reasoning_parser(reasoning_parser, req.stream_reasoning)
                          if reasoning_parser and req.separate_reasoning and thinking else None)
        self.tools = (FunctionCallParser(req.tools, tool_call_parser)
                      if tool_call_parser and tools_active(req.tools, req.tool_choice) else None)
        self.call_ids: dict[int, str] = {}

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def finish_reason(self, reason: Optional[str], matched: Any) -> tuple[Optional[str], Any]:
        """A generation that stopped after making calls finished because of them."""
        if reason == "stop" and self.call_ids:
            return "tool_calls", None
        return reason, matched

    # ---- whole output ----
    def message(self, text: str) -> dict[str, Any]:
        reasoning, content = self._split_reasoning(text, whole=True)
        calls: list[ToolCallItem] = []
        if self.tools is not None:
            content, calls = self.tools.parse_non_stream(content)
        tool_calls = [self._whole_call(c) for c in calls]
        return {"role": "assistant", "content": content or None, "reasoning_content": reasoning or None,
                "tool_calls": tool_calls or None}

    def _whole_call(self, call: ToolCallItem) -> dict[str, Any]:
        self.call_ids[call.call_index] = new_call_id()
        return {"id": self.call_ids[call.call_index], "index": None, "type": "function",
                "function": {"name": call.name, "arguments": call.parameters}}

    # ---- stream ----
    def feed(self, text: str) -> Optional[dict[str, Any]]:
        """The delta for the next piece of output text (None when nothing is settled yet)."""
        reasoning, content = self._split_reasoning(text, whole=False)
        return self._delta(reasoning, content, finishing=False)

    def finish(self) -> Optional[dict[str, Any]]:
        reasoning, content = self.reasoning.finish() if self.reasoning is not None else ("", "")
        return self._delta(reasoning, content, finishing=True)

    def _split_reasoning(self, text: str, whole: bool) -> tuple[str, str]:
        if self.reasoning is None:
            return "", text
        return self.reasoning.parse_non_stream(text) if whole else self.reasoning.parse_stream_chunk(text)

    def _delta(self, reasoning: str, content: str, finishing: bool) -> Optional[dict[str, Any]]:
        items: list[ToolCallItem] = []
        if self.tools is not None:
            content, items = self.tools.parse_stream_chunk(content)
            if finishing:
                more_text, more_items = self.tools.finish()
                content, items = content + more_text, items + more_items
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        calls = self._stream_calls(items)
        if calls:
            delta["tool_calls"] = calls
        return delta or None

    def _stream_calls(self, items: list[ToolCallItem]) -> list[dict[str, Any]]:
        """OpenAI tool-call deltas: the first piece of a call has its id, type and name, later ones arguments."""
        out: dict[int, dict[str, Any]] = {}
        for item in items:
            entry = out.get(item.call_index)
            if entry is None:
                entry = {"index": item.call_index, "function": {"arguments": ""}}
                if item.call_index not in self.call_ids:
                    self.call_ids[item.call_index] = new_call_id()
                    entry.update(id=self.call_ids[item.call_index], type="function")
                out[item.call_index] = entry
            if item.name is not None:
                entry["function"]["name"] = item.name
            entry["function"]["arguments"] += item.parameters
        return [out[i] for i in sorted(out) if out[i]["function"].get("name") or out[i]["function"]["arguments"]]


def wire_delta(delta: dict[str, Any]) -> dict[str, Any]:
    """A stream delta as SGLang sends it: `role`, `content`, `reasoning_content` and `tool_calls` always present
    (null when empty); each tool-call piece has `id`, `index`, `type` and `function.name` (null after the first
    piece of a call) beside `function.arguments`."""
    calls = delta.get("tool_calls")
    return {
        "role": delta.get("role"),
        "content": delta.get("content"),
        "reasoning_content": delta.get("reasoning_content"),
        "tool_calls": None if calls is None else [
            {"id": c.get("id"), "index": c.get("index"), "type": "function",
             "function": {"name": c["function"].get("name"), "arguments": c["function"].get("arguments")}}
            for c in calls
        ],
    }
