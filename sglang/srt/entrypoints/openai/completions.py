"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Optional

from sglang.srt.entrypoints.openai.common import (
    OpenAIHandler,
    build_usage,
    finish_reason_of,
    sampling_params_from,
    sse_json,
    usage_chunk,
)
from sglang.srt.entrypoints.openai.protocol import CompletionRequest, now
from sglang.srt.lora.request import openai_lora_path
from sglang.srt.managers.generate_input import GenerateReqInput


class CompletionHandler(OpenAIHandler):
    def to_generate_input(self, req: CompletionRequest) -> GenerateReqInput:
        sp = sampling_params_from(req, req.max_tokens, {})
        if req.json_schema is not None:
            sp["json_schema"] = req.json_schema
        prompt = req.prompt
        want_logprobs = req.logprobs is not None
        kwargs: dict[str, Any] = dict(
            sampling_params=sp, stream=req.stream, rid=req.rid, return_logprob=want_logprobs,
            top_logprobs_num=req.logprobs or 0, return_text_in_logprobs=True,
            logprob_start_len=0 if (req.echo and want_logprobs) else -1,
            lora_path=openai_lora_path(req, self.tm.server_args.served_model_name, self.tm.lora_adapters),
        )
        if isinstance(prompt, str) or (isinstance(prompt, list) and isinstance(prompt[0], str)):
            return GenerateReqInput(text=prompt, **kwargs)
        return GenerateReqInput(input_ids=prompt, **kwargs)

    def _prompt_texts(self, req: CompletionRequest) -> list[str]:
        p = req.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], str):
            return list(p)
        lists = [p] if isinstance(p[0], int) else p
        return [self.tm.tokenizer.decode(ids) if self.tm.tokenizer else "" for ids in lists]

    def build_response(self, req: CompletionRequest, outputs: list[dict]) -> dict:
        prompts = self._prompt_texts(req) if req.echo else None
        choices = []
        for i, out in enumerate(outputs):
            reason, matched = finish_reason_of(out["meta_info"])
            text = out["text"]
            if prompts is not None:
                text = prompts[i // req.n] + text
            choices.append({
                "index": i, "text": text,
                "logprobs": completion_logprobs(out["meta_info"], req.echo) if req.logprobs is not None else None,
                "finish_reason": reason, "matched_stop": matched,
            })
        return {
            "id": outputs[0]["meta_info"]["id"], "object": "text_completion", "created": now(), "model": req.model,
            "choices": choices, "usage": build_usage(outputs, req.n).model_dump(),
        }

    async def stream_events(self, req: CompletionRequest, outputs: AsyncIterator[dict]) -> AsyncIterator[bytes]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = now()
        chunk_id = ""
        prompts = self._prompt_texts(req) if req.echo else None
        sent: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finals: dict[int, dict] = {}

        def chunk(index: int, text: str, logprobs: Optional[dict], reason: Optional[str], matched) -> bytes:
            return sse_json({
                "id": chunk_id, "object": "text_completion", "created": created, "model": req.model,
                "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                             "matched_stop": matched}],
                "usage": None,
            })

        async for out in outputs:
            chunk_id = chunk_id or out["meta_info"]["id"]
            index = out.get("index", 0)
            first = index not in sent
            text = out["text"]
            delta = text[sent.get(index, 0):]
            if first and prompts is not None:
                delta = prompts[index // req.n] + delta
            sent[index] = len(text)
            # Each chunk carries the logprobs of its own new tokens (and, with echo, the prompt's in the first).
            logprobs = None
            if req.logprobs is not None:
                meta = out["meta_info"]
                logprobs = completion_logprobs(meta, req.echo and first, start=sent_tokens.get(index, 0))
                sent_tokens[index] = len(meta.get("output_token_logprobs") or [])
            reason, matched = finish_reason_of(out["meta_info"])
            if reason is not None:
                finals[index] = out
            if delta or reason is not None or (logprobs is not None and logprobs["tokens"]):
                yield chunk(index, delta, logprobs, reason, matched)
        if include_usage:
            yield usage_chunk(chunk_id, "text_completion", created, req.model, finals, req.n)


def completion_logprobs(meta: dict, echo: bool, start: int = 0) -> dict:
    """OpenAI completion logprobs of the output tokens from `start` on, after the prompt's with `echo`."""
    tokens: list[Any] = []
    tops: list[Any] = []
    if echo:
        tokens += meta.get("input_token_logprobs") or []
        tops += meta.get("input_top_logprobs") or [None] * len(meta.get("input_token_logprobs") or [])
    out_tokens = (meta.get("output_token_logprobs") or [])[start:]
    tokens += out_tokens
    tops += (meta.get("output_top_logprobs") or [])[start:] or [None] * len(out_tokens)
    return {
        "text_offset": [-1] * len(tokens),
        "token_logprobs": [lp for lp, _i, _t in tokens],
        "tokens": [t or "" for _lp, _i, t in tokens],
        "top_logprobs": [None if top is None else {t or "": v for v, _i, t in top} for top in tops],
    }
