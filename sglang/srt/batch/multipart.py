"""A streaming multipart/form-data reader: the upload body goes to disk chunk by chunk, never whole into memory.

It yields events as bytes arrive: ("part", name, filename) when a part's headers are read, ("data", bytes)
for its body, ("end", None, None) when the part is complete. Malformed input raises ValueError.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Optional

MAX_HEADER_BYTES = 16 * 1024


def boundary_of(content_type: str) -> bytes:
    if not content_type.lower().startswith("multipart/form-data"):
        raise ValueError("The upload must be sent as multipart/form-data with a 'file' field.")
    m = re.search(r'boundary="?([^";]+)"?', content_type)
    if not m:
        raise ValueError("The multipart/form-data content type has no boundary.")
    return m.group(1).encode("latin-1")


def _disposition(headers: bytes) -> tuple[str, Optional[str]]:
    text = headers.decode("utf-8", "replace")
    for line in text.split("\r\n"):
        if line.lower().startswith("content-disposition:"):
            name = re.search(r'\bname="([^"]*)"', line)
            filename = re.search(r'\bfilename="([^"]*)"', line)
            if name:
                return name.group(1), filename.group(1) if filename else None
    raise ValueError("A multipart part has no Content-Disposition name.")


class MultipartReader:
    def __init__(self, boundary: bytes) -> None:
        # Seen as "\r\n--boundary" between parts; the body's first boundary lacks the CRLF, so one is prepended.
        self.delim = b"\r\n--" + boundary
        self.buf = bytearray(b"\r\n")
        self.state = "preamble"  # preamble -> after_delim -> headers -> body -> after_delim ... -> done

    def feed(self, chunk: bytes) -> Iterator[tuple[str, object, object]]:
        self.buf += chunk
        while True:
            if self.state == "preamble":
                i = self.buf.find(self.delim)
                if i < 0:
                    del self.buf[: max(0, len(self.buf) - len(self.delim))]
                    return
                del self.buf[: i + len(self.delim)]
                self.state = "after_delim"
            elif self.state == "after_delim":
                if len(self.buf) < 2:
                    return
                tail = bytes(self.buf[:2])
                del self.buf[:2]
                if tail == b"--":
                    self.state = "done"
                elif tail == b"\r\n":
                    self.state = "headers"
                else:
                    raise ValueError("Malformed multipart body (bad boundary line).")
            elif self.state == "headers":
                i = self.buf.find(b"\r\n\r\n")
                if i < 0:
                    if len(self.buf) > MAX_HEADER_BYTES:
                        raise ValueError("Multipart part headers are too long.")
                    return
                name, filename = _disposition(bytes(self.buf[:i]))
                del self.buf[: i + 4]
                self.state = "body"
                yield "part", name, filename
            elif self.state == "body":
                i = self.buf.find(self.delim)
                if i < 0:
                    # Keep a tail that could be the start of a delimiter split across chunks.
                    keep = len(self.delim) - 1
                    if len(self.buf) > keep:
                        data = bytes(self.buf[: len(self.buf) - keep])
                        del self.buf[: len(self.buf) - keep]
                        yield "data", data, None
                    return
                if i:
                    yield "data", bytes(self.buf[:i]), None
                del self.buf[: i + len(self.delim)]
                self.state = "after_delim"
                yield "end", None, None
            else:  # done: the epilogue is ignored
                self.buf.clear()
                return

    def finished(self) -> bool:
        return self.state == "done"
