"""Separate a model's thinking section from its answer: `<think>...</think>` (DeepSeek-R1, Qwen3),
`◁think▷...◁/think▷` (Kimi), and gpt-oss's harmony channels (`gpt-oss`: the analysis channel is the reasoning).

One detector reads one output, whole or chunk by chunk, with a per-character state machine: a partial tag is
held back until it is decided, so the streamed pieces always concatenate to the non-streamed split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from sglang.srt.harmony import HarmonyEvent, HarmonyStream, render_tool_call


@dataclass(frozen=True)
class ThinkFormat:
    start: str
    end: str
    # The thinking section opens in the prompt (the template ends with the start tag), so the output begins
    # inside it whether or not it repeats the start tag.
    force_reasoning: bool


REASONING_PARSERS: dict[str, ThinkFormat] = {
    "deepseek-r1": ThinkFormat("<think>", "</think>", force_reasoning=True),
    "qwen3": ThinkFormat("<think>", "</think>", force_reasoning=False),
    "qwen3-thinking": ThinkFormat("<think>", "</think>", force_reasoning=True),
    "kimi": ThinkFormat("\u25c1think\u25b7", "\u25c1/think\u25b7", force_reasoning=False),
}


# Parsers of the harmony format (harmony.py) rather than a pair of tags.
HARMONY_PARSERS = ("gpt-oss",)


def check_reasoning_parser(name: str) -> None:
    if name not in REASONING_PARSERS and name not in HARMONY_PARSERS:
        names = sorted([*REASONING_PARSERS, *HARMONY_PARSERS])
        raise ValueError(f"Unknown reasoning parser {name!r}; choose one of {', '.join(names)}")


def make_reasoning_parser(name: str, stream_reasoning: bool = True) -> Union[ReasoningParser, HarmonyReasoningParser]:
    """The parser `--reasoning-parser name` means, for one output."""
    check_reasoning_parser(name)
    if name in HARMONY_PARSERS:
        return HarmonyReasoningParser(stream_reasoning)
    return ReasoningParser(name, stream_reasoning)


class HarmonyReasoningParser:
    """gpt-oss: the analysis channel's text is the reasoning; final and commentary messages are the content, and
    tool calls stay in their harmony text there, for the tool-call parser (`--tool-call-parser gpt-oss`). The same
    interface as ReasoningParser."""

    def __init__(self, stream_reasoning: bool = True) -> None:
        self.stream = HarmonyStream()
        self.stream_reasoning = stream_reasoning
        self.unsent = ""  # reasoning kept back while stream_reasoning is off, until the content begins

    def parse_non_stream(self, text: str) -> tuple[str, str]:
        reasoning, normal = self.parse_stream_chunk(text)
        r2, n2 = self.finish()
        return reasoning + r2, normal + n2

    def parse_stream_chunk(self, chunk: str) -> tuple[str, str]:
        return self._split(self.stream.feed(chunk), final=False)

    def finish(self) -> tuple[str, str]:
        return self._split(self.stream.finish(), final=True)

    def _split(self, events: list[HarmonyEvent], final: bool) -> tuple[str, str]:
        reasoning = "".join(e.text for e in events if e.kind == "reasoning")
        normal = "".join(render_tool_call(e.recipient, e.text) if e.kind == "tool" else e.text
                         for e in events if e.kind != "reasoning")
        if self.stream_reasoning:
            return reasoning, normal
        self.unsent += reasoning
        if final or normal:
            reasoning, self.unsent = self.unsent, ""
            return reasoning, normal
        return "", normal


class ReasoningParser:
    """`parse_non_stream(text)` or `parse_stream_chunk(chunk)` ... `finish()`; each returns
    (reasoning_text, normal_text)."""

    def __init__(self, model_type: str, stream_reasoning: bool = True) -> None:
        check_reasoning_parser(model_type)
        self.fmt = REASONING_PARSERS[model_type]
        # With stream_reasoning off, the thinking text is sent in one piece once the section closes.
        self.stream_reasoning = stream_reasoning
        self.state = "start"  # start -> reasoning -> after -> content, or start -> content
        self.buf = ""
        self.started = False  # some reasoning text has been emitted
        self.unsent = ""  # reasoning kept back while stream_reasoning is off

    def parse_non_stream(self, text: str) -> tuple[str, str]:
        reasoning, normal = self.parse_stream_chunk(text)
        r2, n2 = self.finish()
        return reasoning + r2, normal + n2

    def parse_stream_chunk(self, chunk: str) -> tuple[str, str]:
        reasoning: list[str] = []
        normal: list[str] = []
        for c in chunk:
            self._step(c, reasoning, normal)
        return self._reasoning_out("".join(reasoning)), "".join(normal)

    def finish(self) -> tuple[str, str]:
        reasoning, normal = "", ""
        if self.state == "start":
            if self.fmt.force_reasoning:
                reasoning = self.buf.strip()
            else:
                normal = self.buf
        elif self.state == "reasoning":
            reasoning = self.buf.rstrip() if self.started else self.buf.strip()
        self.buf, self.state = "", "done"
        return self._reasoning_out(reasoning, final=True), normal

    def _reasoning_out(self, text: str, final: bool = False) -> str:
        if self.stream_reasoning:
            return text
        self.unsent += text
        if final or self.state in ("after", "content", "done"):
            out, self.unsent = self.unsent, ""
            return out
        return ""

    def _step(self, c: str, reasoning: list[str], normal: list[str]) -> None:
        if self.state == "start":
            self.buf += c
            head = self.buf.lstrip()
            if head == self.fmt.start:
                self.state, self.buf = "reasoning", ""
            elif not self.fmt.start.startswith(head):
                held, self.buf = self.buf, ""
                self.state = "reasoning" if self.fmt.force_reasoning else "content"
                for ch in held:
                    self._step(ch, reasoning, normal)
        elif self.state == "reasoning":
            self.buf += c
            if self.buf.endswith(self.fmt.end):
                text = self.buf[: -len(self.fmt.end)].rstrip()
                reasoning.append(text if self.started else text.lstrip())
                self.state, self.buf = "after", ""
                return
            cut = len(self.buf) - self._end_prefix_len(self.buf)
            cut = len(self.buf[:cut].rstrip())  # trailing whitespace waits: it may end the section
            if cut > 0:
                text = self.buf[:cut]
                if not self.started:
                    text = text.lstrip()
                if text:
                    reasoning.append(text)
                    self.started = True
                    self.buf = self.buf[cut:]
        elif self.state == "after":
            if not c.isspace():
                self.state = "content"
                normal.append(c)
        else:
            normal.append(c)

    def _end_prefix_len(self, text: str) -> int:
        end = self.fmt.end
        for k in range(min(len(text), len(end) - 1), 0, -1):
            if end.startswith(text[-k:]):
                return k
        return 0
