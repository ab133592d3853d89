"""The harmony response format of gpt-oss, read from generated text: reasoning, content and tool calls.

An assistant turn is a sequence of messages, each `[<|start|>ROLE] <|channel|>CHANNEL[ to=RECIPIENT][
<|constrain|>TYPE] <|message|>TEXT` closed by `<|end|>`, `<|call|>` (a tool call) or `<|return|>` (the last message);
the chat template ends the prompt with `<|start|>assistant`, so the output begins at `<|channel|>`. The `analysis`
channel holds the reasoning, `final` the answer, and `commentary` either a preamble to the user or, with a recipient
`to=functions.NAME`, a call of tool NAME whose message is its JSON arguments (the recipient may also sit in the role
header: `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>...`).

`HarmonyStream` reads an output whole or chunk by chunk and turns it into events: reasoning text, content text and
complete tool calls. A partial marker at the end of a chunk is held back until the next one decides it, so the events
of a streamed output concatenate to those of the whole output. Text outside any message (a model that does not
write the format) is content. The output may end without a closing marker (the stop token is not part of the text):
`finish` closes the open message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
CLOSERS = (END, CALL, RETURN)
_RECIPIENT = re.compile(r"to=([^\s<]+)")


@dataclass
class HarmonyEvent:
    """`kind` is "reasoning", "content" or "tool"; a tool event carries its `recipient` (`functions.NAME`) and its
    arguments as `text`."""

    kind: str
    text: str
    recipient: str = ""

    @property
    def function(self) -> str:
        """The called function's name: the recipient's last dotted part (`functions.get_weather` -> get_weather)."""
        return self.recipient.rsplit(".", 1)[-1]


def render_tool_call(recipient: str, arguments: str) -> str:
    """The text gpt-oss writes for one call of `recipient` (`functions.NAME`) with JSON `arguments`."""
    return f"{START}assistant{CHANNEL}commentary to={recipient} {CONSTRAIN}json{MESSAGE}{arguments}{CALL}"


class HarmonyStream:
    def __init__(self) -> None:
        self.buf = ""
        self.state = "outside"  # outside -> header -> content -> outside
        self.header = ""
        self.channel = ""
        self.recipient: Optional[str] = None
        self.call_text = ""  # the arguments of the tool call being read

    def feed(self, text: str) -> list[HarmonyEvent]:
        self.buf += text
        events: list[HarmonyEvent] = []
        while self.buf:
            at = self.buf.find("<|")
            if at < 0:
                keep = 1 if self.buf.endswith("<") else 0  # may become "<|" with the next chunk
                self._text(self.buf[: len(self.buf) - keep], events)
                self.buf = self.buf[len(self.buf) - keep:]
                break
            if at > 0:
                self._text(self.buf[:at], events)
                self.buf = self.buf[at:]
            marker = next((m for m in MARKERS if self.buf.startswith(m)), None)
            if marker is None:
                if any(m.startswith(self.buf) for m in MARKERS):
                    break  # a marker may still be completing: wait for the next chunk
                self._text("<|", events)  # not a marker: plain text
                self.buf = self.buf[2:]
                continue
            self.buf = self.buf[len(marker):]
            self._marker(marker, events)
        return _merged(events)

    def finish(self) -> list[HarmonyEvent]:
        """The output ended: what is held back is text, and an open message closes."""
        events: list[HarmonyEvent] = []
        if self.buf:
            self._text(self.buf, events)
            self.buf = ""
        if self.state == "content":
            self._close(events)
        return _merged(events)

    def _text(self, text: str, events: list[HarmonyEvent]) -> None:
        if self.state == "header":
            self.header += text
        elif self.state == "content":
            if self.recipient is not None:
                self.call_text += text
            else:
                events.append(HarmonyEvent("reasoning" if self.channel == "analysis" else "content", text))
        else:
            events.append(HarmonyEvent("content", text))

    def _marker(self, marker: str, events: list[HarmonyEvent]) -> None:
        if marker in (START, CHANNEL):
            if self.state == "content":
                self._close(events)  # a message left open: the next one begins
            if marker == START or self.state == "outside":
                self.header = ""
            self.state = "header"
            self.header += marker
        elif marker == CONSTRAIN:
            self._text(marker, events)
        elif marker == MESSAGE:
            if self.state == "header":
                self._open()
            else:
                self._text(marker, events)
        elif self.state == "content":  # a closer
            self._close(events)

    def _open(self) -> None:
        channel_part = self.header.split(CHANNEL, 1)[1] if CHANNEL in self.header else ""
        words = channel_part.replace(CONSTRAIN, " ").split()
        self.channel = words[0] if words else ""
        found = _RECIPIENT.search(self.header)
        self.recipient = found.group(1) if found else None
        self.call_text = ""
        self.state = "content"

    def _close(self, events: list[HarmonyEvent]) -> None:
        if self.recipient is not None:
            events.append(HarmonyEvent("tool", self.call_text, self.recipient))
        self.state, self.header, self.recipient, self.call_text = "outside", "", None, ""


def _merged(events: list[HarmonyEvent]) -> list[HarmonyEvent]:
    """Adjacent text events of one kind as one event."""
    out: list[HarmonyEvent] = []
    for e in events:
        if out and e.kind != "tool" and out[-1].kind == e.kind:
            out[-1] = HarmonyEvent(e.kind, out[-1].text + e.text)
        elif e.kind == "tool" or e.text:
            out.append(e)
    return out
