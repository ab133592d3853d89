"""The tokenizer manager's side of pooled requests (--is-embedding): tokenize, send, wait for the rows.

Outputs are dicts `{"embedding": [...], "meta_info": {...}}`, one per item: the pooled vector of an embedding
model, the score(s) of a reward model or a cross-encoder.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from sglang.srt.managers.embedding_input import EmbeddingItem, EmbeddingReqInput
from sglang.srt.managers.finish_reason import FinishAbort
from sglang.srt.managers.io_struct import BatchEmbeddingOutput, TokenizedEmbeddingReqInput
from sglang.srt.managers.prompt_limits import allowed_input_len, check_token_ids

if TYPE_CHECKING:
    from sglang.srt.managers.tokenizer_manager import ReqState, TokenizerManager

NOT_EMBEDDING_MODEL = (
    "This model does not appear to be an embedding model by default. Please add `--is-embedding` when launching "
    "the server or try another model."
)
NOT_GENERATION_MODEL = (
    "This model was launched with `--is-embedding` and does not support generation. Use /encode, /classify, "
    "/v1/embeddings or /v1/rerank, or launch the server without `--is-embedding`."
)


def tokenize_embedding_item(tm: TokenizerManager, item: EmbeddingItem) -> TokenizedEmbeddingReqInput:
    """Validate and tokenize one item. Raises ValueError with a message for the client."""
    token_type_ids = None
    if item.input_ids is None:
        if tm.tokenizer is None:
            raise ValueError("The server was started with skip_tokenizer_init=True and cannot accept text; "
                             "provide input_ids.")
        if item.pair is not None:
            enc = tm.tokenizer(item.pair[0], item.pair[1])
            input_ids = list(enc["input_ids"])
            types = enc.get("token_type_ids")
            # Only models with a second segment embedding read the types (BERT); XLM-R has one type.
            if types is not None and getattr(tm.model_info.hf_config, "type_vocab_size", 1) > 1:
                token_type_ids = list(types)
        else:
            input_ids = tm.tokenizer.encode(item.text)
        input_text = item.text if item.pair is None else None
    else:
        input_text = None
        input_ids = item.input_ids
        check_token_ids(input_ids, tm.vocab_size)
    n = len(input_ids)
    if n == 0:
        raise ValueError("The input is empty after tokenization; provide a non-empty input.")
    if n > tm.max_req_input_len:
        n = allowed_input_len(n, tm.max_req_input_len, tm.server_args.allow_auto_truncate)
        input_ids = input_ids[:n]
        token_type_ids = token_type_ids[:n] if token_type_ids else None
    return TokenizedEmbeddingReqInput(rid=item.rid, input_text=input_text, input_ids=input_ids,
                                      token_type_ids=token_type_ids)


async def encode_request(tm: TokenizerManager, obj: EmbeddingReqInput) -> list[dict[str, Any]]:
    """Pool every item of `obj`; one output dict per item, in order. Raises ValueError for bad input."""
    await tm.model_update_lock.acquire_reader()  # no pooling starts while weights load
    try:
        return await _encode_request(tm, obj)
    finally:
        tm.model_update_lock.release_reader()


async def _encode_request(tm: TokenizerManager, obj: EmbeddingReqInput) -> list[dict[str, Any]]:
    if not tm.server_args.is_embedding:
        raise ValueError(NOT_EMBEDDING_MODEL)
    tm._ensure_recv_loop()
    tokenized = [tokenize_embedding_item(tm, item) for item in obj.items()]
    for t in tokenized:
        if t.rid in tm.rid_to_state:
            raise ValueError(f"Duplicate request id: {t.rid}")
    tm.check_capacity(len(tokenized))
    states: list[ReqState] = []
    for t in tokenized:
        state = tm.new_state(t.rid)
        tm.rid_to_state[t.rid] = state
        states.append(state)
    for t in tokenized:
        tm.send_to_scheduler.send_pyobj(t)
    try:
        outputs = []
        for state in states:
            while not state.finished:
                await tm.wait_for_output(state)
            reason = state.finish_reason
            if isinstance(reason, FinishAbort):
                raise ValueError(reason.message)
            outputs.append({
                "embedding": state.embedding,
                "meta_info": {
                    "id": state.rid,
                    "finish_reason": reason.to_json() if reason is not None else None,
                    "prompt_tokens": state.prompt_tokens,
                    "cached_tokens": state.cached_tokens,
                    "e2e_latency": time.monotonic() - state.created,
                },
            })
        return outputs
    finally:
        for state in states:
            if not state.finished:
                tm.abort_request(state.rid)
            tm.rid_to_state.pop(state.rid, None)


def handle_embedding_output(tm: TokenizerManager, msg: BatchEmbeddingOutput) -> None:
    for i, rid in enumerate(msg.rids):
        state = tm.rid_to_state.get(rid)
        if state is None:
            continue
        state.embedding = msg.embeddings[i]
        state.prompt_tokens = msg.prompt_tokens[i]
        state.cached_tokens = msg.cached_tokens[i]
        state.finish_reason = msg.finished_reasons[i]
        state.finished = True
        state.event.set()
