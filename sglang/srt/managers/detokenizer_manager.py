"""The detokenizer process: token ids from the scheduler -> text increments for the tokenizer manager."""

from __future__ import annotations

import logging
from typing import Optional

import zmq

from sglang.srt.managers.finish_reason import FinishMatched
from sglang.srt.managers.incremental_detokenizer import IncrementalDetokenizer
from sglang.srt.managers.io_struct import BatchStrOutput, BatchTokenIDOutput
from sglang.srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)


def held_back_len(text: str, stop_strs: Optional[list[str]]) -> int:
    """Length of the longest suffix of `text` that could be the start of a stop string."""
    if not stop_strs:
        return 0
    best = 0
    for stop in stop_strs:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class DecodeState:
    """Per-request text state: the decoder, the text produced, and how much of it was already sent."""

    def __init__(self, tokenizer, skip_special_tokens: bool, spaces_between_special_tokens: bool) -> None:
        self.decoder = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )
        self.text = ""
        self.sent = 0


class DetokenizerManager:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}

    def handle(self, msg: BatchTokenIDOutput) -> BatchStrOutput:
        out = BatchStrOutput(
            rids=msg.rids, finished_reasons=msg.finished_reasons, new_texts=[], new_output_ids=msg.new_output_ids,
            prompt_tokens=msg.prompt_tokens, completion_tokens=msg.output_lens, cached_tokens=msg.cached_tokens,
            retractions=msg.retractions, logprobs=msg.logprobs, spec_verify_ct=msg.spec_verify_ct,
            spec_accepted_drafts=msg.spec_accepted_drafts,
        )
        for i, rid in enumerate(msg.rids):
            out.new_texts.append(self._new_text(msg, i, rid) if self.tokenizer is not None else "")
        return out

    def _new_text(self, msg: BatchTokenIDOutput, i: int, rid: str) -> str:
        state = self.states.get(rid)
        if state is None:
            state = DecodeState(self.tokenizer, msg.skip_special_tokens[i], msg.spaces_between_special_tokens[i])
            self.states[rid] = state
        ids = msg.new_output_ids[i]
        finished = msg.finished_reasons[i] is not None
        if finished and msg.trim_last_token[i] and ids:
            ids = ids[:-1]
        state.text += state.decoder.append(ids)
        stop_strs = msg.stop_strs[i]
        if finished:
            state.text += state.decoder.flush()
            del self.states[rid]
            reason = msg.finished_reasons[i]
            matched = reason.matched if isinstance(reason, FinishMatched) else None
            if isinstance(matched, str) and not msg.no_stop_trim[i]:
                pos = state.text.find(matched)
                if pos >= 0:
                    state.text = state.text[:pos]
            end = len(state.text)
        else:
            end = len(state.text) - held_back_len(state.text[state.sent:], stop_strs)
        if end <= state.sent:
            return ""
        new = state.text[state.sent:end]
        state.sent = end
        return new


def run_detokenizer_process(server_args: ServerArgs, port_args: PortArgs) -> None:
    from sglang.srt.managers.process_utils import configure_child_process, load_tokenizer_for

    configure_child_process(server_args, "detokenizer")
    import torch

    torch.set_num_threads(1)
    manager = DetokenizerManager(load_tokenizer_for(server_args))
    ctx = zmq.Context(2)
    recv = ctx.socket(zmq.PULL)
    recv.bind(port_args.detokenizer_ipc_name)
    send = ctx.socket(zmq.PUSH)
    send.connect(port_args.tokenizer_ipc_name)
    while True:
        msg = recv.recv_pyobj()
        if isinstance(msg, BatchTokenIDOutput):
            send.send_pyobj(manager.handle(msg))
        else:  # control replies pass through
            send.send_pyobj(msg)
