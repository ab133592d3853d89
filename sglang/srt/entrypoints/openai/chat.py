"""POST /v1/chat/completions."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Optional

from sglang.srt.entrypoints.openai.chat_images import flatten_content
from sglang.srt.entrypoints.openai.chat_output import ChoiceOutputParser, wire_delta
from sglang.srt.entrypoints.openai.common import (
    OpenAIHandler,
    build_usage,
    finish_reason_of,
    sampling_params_from,
    sse_json,
    usage_chunk,
)
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, now
from sglang.srt.entrypoints.openai.tool_requests import (
    add_tool_constraint,
    template_messages,
    tools_active,
    validate_tools,
)
from sglang.srt.function_call import FunctionCallParser
from sglang.srt.lora.request import openai_lora_path
from sglang.srt.managers.generate_input import GenerateReqInput
from sglang.srt.reasoning_parser import HARMONY_PARSERS


class ChatHandler(OpenAIHandler):
    def __init__(self, tokenizer_manager, chat_template: Optional[str], generation_defaults: dict,
                 tool_call_parser: Optional[str] = None, reasoning_parser: Optional[str] = None) -> None:
        super().__init__(tokenizer_manager)
        self.chat_template = chat_template
        self.defaults = generation_defaults
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser

    def _tool_parser(self, req: ChatCompletionRequest) -> Optional[FunctionCallParser]:
        return FunctionCallParser(req.tools, self.tool_call_parser) if self.tool_call_parser and req.tools else None

    def _output_parser(self, req: ChatCompletionRequest) -> ChoiceOutputParser:
        return ChoiceOutputParser(req, self.tool_call_parser, self.reasoning_parser)

    def build_prompt_ids(self, req: ChatCompletionRequest, images: Optional[list[Any]] = None) -> list[int]:
        """The prompt's token ids; the urls of image_url parts are appended to `images`, in order."""
        tokenizer = self.tm.tokenizer
        if tokenizer is None:
            raise ValueError("Chat completions need a tokenizer; the server runs with --skip-tokenizer-init.")
        placeholder = self.tm.images.placeholder
        messages = [self._message_dict(m, images if images is not None else [], placeholder) for m in req.messages]
        source = self.chat_template or getattr(tokenizer, "chat_template", None) or ""
        messages = template_messages(messages, req.tools, tools_active(req.tools, req.tool_choice), str(source),
                                     self._tool_parser(req))
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools and req.tool_choice != "none":
            kwargs["tools"] = req.tools
        continue_final = req.continue_final_message and messages[-1]["role"] == "assistant"
        try:
            ids = tokenizer.apply_chat_template(
                messages, chat_template=self.chat_template, add_generation_prompt=not continue_final,
                continue_final_message=continue_final, tokenize=True, return_dict=False, **kwargs,
            )
        except Exception as e:  # template errors (e.g. roles it rejects) are the client's to fix
            raise ValueError(f"Failed to apply the chat template: {e}") from None
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        return list(ids)

    @staticmethod
    def _message_dict(m, images: list[Any], placeholder: Optional[str]) -> dict:
        content = m.content
        if isinstance(content, list):
            content = flatten_content(content, images, placeholder)
        d: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
        for key in ("name", "tool_call_id", "tool_calls", "reasoning_content"):
            val = getattr(m, key)
            if val is not None:
                d[key] = val
        return d

    def to_generate_input(self, req: ChatCompletionRequest) -> GenerateReqInput:
        validate_tools(req.tools, req.tool_choice)
        images: list[Any] = []
        ids = self.build_prompt_ids(req, images)
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        sp = sampling_params_from(req, max_new, self.defaults)
        fmt = req.response_format
        if fmt is not None and fmt.type == "json_object":
            sp["json_schema"] = '{"type": "object"}'
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ValueError("response_format.json_schema.schema is required for type 'json_schema'")
            sp["json_schema"] = json.dumps(fmt.json_schema.schema_)
        elif fmt is not None and fmt.type == "structural_tag":
            sp["structural_tag"] = json.dumps({"structures": fmt.structures or [], "triggers": fmt.triggers or []})
        add_tool_constraint(sp, req.tools, req.tool_choice, self._tool_parser(req))
        if self.tool_call_parser and tools_active(req.tools, req.tool_choice):
            sp["skip_special_tokens"] = False  # call markers may be special tokens
        if self.reasoning_parser in HARMONY_PARSERS and req.separate_reasoning:
            sp["skip_special_tokens"] = False  # the harmony channel markers are special tokens
        want_logprobs = req.logprobs
        return GenerateReqInput(
            input_ids=ids, sampling_params=sp, stream=req.stream, rid=req.rid,
            return_logprob=want_logprobs, top_logprobs_num=req.top_logprobs or 0 if want_logprobs else 0,
            return_text_in_logprobs=True, image_data=images or None,
            lora_path=openai_lora_path(req, self.tm.server_args.served_model_name, self.tm.lora_adapters),
        )

    def build_response(self, req: ChatCompletionRequest, outputs: list[dict]) -> dict:
        choices = []
        for i, out in enumerate(outputs):
            reason, matched = finish_reason_of(out["meta_info"])
            parser = self._output_parser(req)
            message = parser.message(out["text"])
            reason, matched = parser.finish_reason(reason, matched)
            choices.append({
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(out["meta_info"]) if req.logprobs else None,
                "finish_reason": reason,
                "matched_stop": matched,
            })
        return {
            "id": outputs[0]["meta_info"]["id"], "object": "chat.completion", "created": now(),
            "model": req.model, "choices": choices, "usage": build_usage(outputs, req.n).model_dump(),
        }

    async def stream_events(self, req: ChatCompletionRequest, outputs: AsyncIterator[dict]) -> AsyncIterator[bytes]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = now()
        chunk_id = ""
        sent_text: dict[int, int] = {}
        sent_lp: dict[int, int] = {}
        finals: dict[int, dict] = {}
        parsers: dict[int, ChoiceOutputParser] = {}

        def chunk(index: int, delta: dict, reason=None, matched=None, logprobs=None) -> bytes:
            return sse_json({
                "id": chunk_id, "object": "chat.completion.chunk", "created": created, "model": req.model,
                "choices": [{"index": index, "delta": wire_delta(delta), "logprobs": logprobs,
                             "finish_reason": reason, "matched_stop": matched}],
                "usage": None,
            })

        async for out in outputs:
            chunk_id = chunk_id or out["meta_info"]["id"]
            index = out.get("index", 0)
            if index not in sent_text:
                sent_text[index] = 0
                parsers[index] = self._output_parser(req)
                yield chunk(index, {"role": "assistant", "content": ""})
            text = out["text"]
            delta = text[sent_text[index]:]
            sent_text[index] = len(text)
            reason, matched = finish_reason_of(out["meta_info"])
            lp = None
            if req.logprobs:
                full = chat_logprobs(out["meta_info"])["content"]
                lp = {"content": full[sent_lp.get(index, 0):]}
                sent_lp[index] = len(full)
            parser = parsers[index]
            if parser.active:
                pieces = [parser.feed(delta)] + ([parser.finish()] if reason is not None else [])
                deltas = [d for d in pieces if d]
                reason, matched = parser.finish_reason(reason, matched)
            else:
                deltas = [{"content": delta}] if delta else []
            if not deltas and lp and lp["content"]:
                deltas = [{"content": ""}]
            for k, message_delta in enumerate(deltas):
                last = k == len(deltas) - 1
                yield chunk(index, message_delta, None if include_usage or not last else reason,
                            None if include_usage or not last else matched, lp if k == 0 else None)
            if reason is not None:
                finals[index] = out
                yield chunk(index, {}, reason, matched)
        if include_usage:
            yield usage_chunk(chunk_id, "chat.completion.chunk", created, req.model, finals, req.n,
                              keep_nulls=True)


def chat_logprobs(meta: dict) -> dict:
    tokens = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or [None] * len(tokens)
    content = []
    for (lp, _tid, text), top in zip(tokens, tops):
        text = text or ""
        content.append({
            "token": text, "bytes": list(text.encode("utf-8")), "logprob": lp,
            "top_logprobs": [
                {"token": t or "", "bytes": list((t or "").encode("utf-8")), "logprob": v} for v, _i, t in (top or [])
            ],
        })
    return {"content": content}
