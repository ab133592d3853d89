"""Constrained requests in the scheduler: waiting for their grammar, advancing it, and jumping forward."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Optional

from sglang.srt.constrained.base_grammar_backend import BaseGrammarBackend, InvalidGrammar, constraint_key
from sglang.srt.managers.finish_reason import FinishAbort, bad_request
from sglang.srt.managers.schedule_batch import Req

logger = logging.getLogger(__name__)

NO_BACKEND_MESSAGE = (
    "Constrained decoding ({kind}) needs a grammar backend, but the server runs with --grammar-backend none."
)


class GrammarQueue:
    """Requests whose grammar is still compiling. The compile runs on the backend's worker thread; the
    scheduler polls here once per loop iteration, so requests already running are never held up."""

    def __init__(self, backend: Optional[BaseGrammarBackend], timeout_s: float) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        # (request, constraint key, its compile, when the request started waiting)
        self.pending: list[tuple[Req, tuple[str, str], Future, float]] = []

    def __len__(self) -> int:
        return len(self.pending)

    def submit(self, req: Req) -> Optional[Req]:
        """Start the grammar of `req`. Returns `req` when it can be scheduled now (no constraint, or a cached
        grammar), None when it waits here; a request that cannot run at all comes back finished."""
        key = constraint_key(req.sampling_params)
        if key is None:
            return req
        if self.backend is None:
            req.finished_reason = bad_request(NO_BACKEND_MESSAGE.format(kind=key[0]))
            return req
        future = self.backend.get_future(key)
        if future.done():
            self._resolve(req, future.result())
            return req
        self.pending.append((req, key, future, time.monotonic()))
        return None

    def pop_ready(self) -> list[Req]:
        """Requests whose compile finished (ready to schedule, or finished with a 400) or timed out."""
        if not self.pending:
            return []
        ready, still = [], []
        now = time.monotonic()
        for req, key, future, start in self.pending:
            if future.done():
                self._resolve(req, future.result())
                ready.append(req)
            elif now - start > self.timeout_s:
                self.backend.forget(key)
                req.finished_reason = bad_request(
                    f"Grammar compilation timed out after {self.timeout_s:g} s (--grammar-compile-timeout).")
                ready.append(req)
            else:
                still.append((req, key, future, start))
        self.pending = still
        return ready

    def remove_matching(self, match: Callable[[Req], bool]) -> list[Req]:
        taken = [req for req, _, _, _ in self.pending if match(req)]
        self.pending = [p for p in self.pending if not match(p[0])]
        return taken

    def _resolve(self, req: Req, compiled) -> None:
        if isinstance(compiled, InvalidGrammar):
            req.finished_reason = bad_request(compiled.message)
        else:
            req.grammar = self.backend.new_matcher(compiled)


def accept_sampled_token(req: Req, token: int) -> None:
    """Advance the request's matcher past the token it just sampled."""
    if req.grammar is None or req.grammar.accept_token(token):
        return
    # Only possible when every token was masked out (for instance min_new_tokens hiding the only allowed EOS).
    logger.warning("Request %s: the grammar rejected token %d; finishing the request", req.rid, token)
    req.finished_reason = FinishAbort(f"The grammar rejected the sampled token {token}.")


def jump_forward_tokens(req: Req, tokenizer) -> list[int]:
    """Tokens the grammar forces next (accepted by the matcher already), or [] when there is a choice.

    The forced text is tokenized on its own and each token is checked against the matcher; tokens after
    the first one it refuses are dropped, and nothing is taken past max_new_tokens."""
    grammar = req.grammar
    if grammar is None or tokenizer is None or grammar.is_terminated():
        return []
    text = grammar.jump_forward_string()
    if not text:
        return []
    room = req.sampling_params.max_new_tokens - len(req.output_ids) - 1
    if room <= 0:
        return []
    accepted: list[int] = []
    for token in tokenizer.encode(text, add_special_tokens=False)[:room]:
        if not grammar.accept_token(token):
            break
        accepted.append(token)
    return accepted
