"""The served model's final hidden states by request row and position, for EAGLE drafting.

The model runner hands every forward's final (normed) hidden states to `HiddenLog.record` (ModelRunner.hidden_sink):
prompt chunks, plain decode steps and verify steps. Each request row keeps one span of consecutive positions
lo..hi-1. A prompt chunk continues the span only where it ends (the next chunk of the same prompt); a decode row
at a position inside or just after the span extends or overwrites it (a verify step's rows for rejected draft
tokens are overwritten when the accepted token at that position runs); any other write starts a new span there (a
new request in the row, whose prefix served from the radix cache has no hidden states here). The draft consumes
positions in order; what it has consumed is dropped. A draft tree's nodes off its main path run in spare rows: the
accepted ones' states are moved to the request's row (`adopt`) and the spare rows' dropped.

The fused CPU decode step hands these states over from its one call (FusedCpuDecode.forward_with_hidden), so
speculation keeps it; `describe_decode_path` says so in the `Decode path:` line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.model_executor.decode_strategy import DecodePlan

logger = logging.getLogger(__name__)

# Consumed positions are dropped once there are this many (one copy of the rest per drop).
_COMPACT_ROWS = 256


@dataclass
class _Span:
    lo: int
    hi: int
    buf: torch.Tensor  # [capacity, hidden]: position p at buf[p - lo]


class HiddenLog:
    def __init__(self) -> None:
        self.spans: dict[int, _Span] = {}

    def record(self, forward_batch: ForwardBatch, hidden: torch.Tensor) -> None:
        """Store the hidden states of a forward's rows under (request row, position)."""
        rows = forward_batch.req_pool_indices.tolist()
        if forward_batch.forward_mode.is_decode():
            positions = forward_batch.positions.tolist()
            start = 0
            # Runs of rows at consecutive positions of one request (a verify step's rows of one request).
            for i in range(1, len(rows) + 1):
                if i == len(rows) or rows[i] != rows[start] or positions[i] != positions[i - 1] + 1:
                    self.write(rows[start], positions[start], hidden[start:i])
                    start = i
            return
        offset = 0
        for row, prefix, n in zip(rows, forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu):
            span = self.spans.get(row)
            if span is not None and span.hi != prefix:
                del self.spans[row]  # only the next chunk of a prompt continues a span: this is a new sequence
            self.write(row, prefix, hidden[offset : offset + n])
            offset += n

    def write(self, row: int, pos: int, values: torch.Tensor) -> None:
        span = self.spans.get(row)
        if span is None or not span.lo <= pos <= span.hi:
            span = self.spans[row] = _Span(pos, pos, values.new_empty((max(64, 2 * len(values)), values.shape[1])))
        end = pos + len(values)
        if end - span.lo > span.buf.shape[0]:
            grown = span.buf.new_empty((2 * (end - span.lo), span.buf.shape[1]))
            grown[: span.hi - span.lo] = span.buf[: span.hi - span.lo]
            span.buf = grown
        span.buf[pos - span.lo : end - span.lo] = values
        span.hi = max(span.hi, end)

    def first(self, row: int, upto: int) -> Optional[int]:
        """The first position of the row's span when it covers every position from there to upto-1, else None."""
        span = self.spans.get(row)
        return span.lo if span is not None and span.hi >= upto else None

    def get(self, row: int, start: int, end: int) -> torch.Tensor:
        """Hidden states of positions start..end-1 (within the row's span)."""
        span = self.spans[row]
        assert span.lo <= start and end <= span.hi, (row, start, end, span.lo, span.hi)
        return span.buf[start - span.lo : end - span.lo]

    def consumed(self, row: int, upto: int) -> None:
        """Positions before `upto` are no longer needed."""
        span = self.spans.get(row)
        if span is None or upto - span.lo < _COMPACT_ROWS:
            return
        keep = span.buf[upto - span.lo : span.hi - span.lo].clone()
        span.buf = torch.cat([keep, keep.new_empty((max(64, len(keep)), keep.shape[1]))])
        span.lo = upto

    def drop(self, row: int) -> None:
        self.spans.pop(row, None)

    def adopt(self, row: int, positions: list[int], rows_from: list[int]) -> None:
        """A draft tree's verify step ran nodes off its main path in spare rows (speculative/verify.py): the hidden
        states of the accepted ones (at `positions`, recorded under `rows_from`) become the request row's, in place
        of the main path's nodes recorded there."""
        for pos, src in zip(positions, rows_from):
            self.write(row, pos, self.get(src, pos, pos + 1))


def describe_decode_path(runner: Any, algorithm: str, states: str) -> None:
    """Add to the served model's `Decode path:` line (and log it) how its decode batches hand `states` to the draft
    head: from the fused CPU decode step's one call where it runs them, else from the layer-by-layer forward."""
    plan = runner.decode_plan
    if plan is None:
        return
    if plan.fused is not None:
        note = f"; with {algorithm} the fused step also returns {states} from its one call"
    else:
        note = f"; with {algorithm} the layer-by-layer forward returns {states}"
    if note not in plan.description:
        runner.decode_plan = DecodePlan(plan.fused, plan.description + note)
        logger.info(runner.decode_plan.description)
