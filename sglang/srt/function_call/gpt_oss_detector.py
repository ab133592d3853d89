"""gpt-oss format: harmony messages to a function, `<|channel|>commentary to=functions.NAME <|constrain|>json
<|message|>{...}<|call|>` (the recipient may sit in the role header instead; harmony.py reads either).

Content is the final and commentary messages' text; the analysis channel's text is reasoning, which is not content
(`--reasoning-parser gpt-oss` returns it as `reasoning_content`). A call of a function the request did not offer is
dropped, as SGLang does. Calls are reported whole, when their message closes.
"""

from __future__ import annotations

import json

from sglang.srt.function_call.base_format_detector import Arguments, BaseFormatDetector
from sglang.srt.function_call.core_types import StreamingParseResult, ToolCallItem, ToolSpec
from sglang.srt.harmony import HarmonyEvent, HarmonyStream, render_tool_call


class GptOssDetector(BaseFormatDetector):
    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools)
        self.stream = HarmonyStream()

    def has_tool_call(self, text: str) -> bool:
        return "to=functions." in text

    def parse_streaming_increment(self, new_text: str) -> StreamingParseResult:
        return self._result(self.stream.feed(new_text))

    def finish(self) -> StreamingParseResult:
        return self._result(self.stream.finish())

    def _result(self, events: list[HarmonyEvent]) -> StreamingParseResult:
        result = StreamingParseResult()
        for event in events:
            if event.kind == "content":
                result.normal_text += event.text
            elif event.kind == "tool" and event.function in self.names:
                try:
                    arguments = json.loads(event.text) if event.text.strip() else {}
                except json.JSONDecodeError:
                    continue  # not a call this request can run: dropped
                result.calls.append(ToolCallItem(self.call_index, event.function,
                                                 json.dumps(arguments, ensure_ascii=False)))
                self.call_index += 1
        return result

    def render_calls(self, calls: list[tuple[str, Arguments]]) -> str:
        return "".join(render_tool_call(f"functions.{name}", args if isinstance(args, str) else json.dumps(args))
                       for name, args in calls)
