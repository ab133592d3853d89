"""`OpenAI`: the frontend backend for any OpenAI-compatible endpoint (chat or completions)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Optional

from sglang.lang.backend.base_backend import BaseBackend
from sglang.lang.chat_template import ChatTemplate, get_chat_template_by_model_path
from sglang.lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    compute_normalized_prompt_logprobs,
    token_length_normalized,
)
from sglang.lang.ir import SglSamplingParams

logger = logging.getLogger(__name__)

INSTRUCT_MODEL_NAMES = ["gpt-3.5-turbo-instruct"]


class OpenAI(BaseBackend):
    """`gen` goes through chat completions (chat models) or completions; `select` needs a completions
    endpoint that returns prompt logprobs (`echo` + `logprobs`), as SGLang's own server does."""

    def __init__(self, model_name: str, is_chat_model: Optional[bool] = None,
                 chat_template: Optional[ChatTemplate] = None, is_azure: bool = False, **client_kwargs: Any) -> None:
        super().__init__()
        import openai

        self.client = openai.AzureOpenAI(**client_kwargs) if is_azure else openai.OpenAI(**client_kwargs)
        self.model_name = model_name
        if chat_template is not None:
            self.chat_template = chat_template
        else:
            # The prompt text of a program is built with the model's own template, so completions and
            # select see the same text the native backends do.
            self.chat_template = get_chat_template_by_model_path(model_name)
        if is_chat_model is None:
            is_chat_model = model_name not in INSTRUCT_MODEL_NAMES
        self.is_chat_model = is_chat_model
        self.chat_prefix = self.chat_template.role_prefix_and_suffix.get("assistant", ("", ""))[0]

    def get_model_name(self) -> str:
        return self.model_name

    # ---- generation -------------------------------------------------------------------------------
    def _request_kwargs(self, sampling_params: SglSamplingParams) -> dict:
        if sampling_params.regex is not None or sampling_params.dtype is not None:
            logger.warning("Regex and dtype constraints are not supported by the OpenAI backend; ignored.")
        kwargs: dict[str, Any] = {
            "max_tokens": sampling_params.max_new_tokens,
            "temperature": sampling_params.temperature,
            "top_p": sampling_params.top_p,
            "frequency_penalty": sampling_params.frequency_penalty,
            "presence_penalty": sampling_params.presence_penalty,
            "n": sampling_params.n,
        }
        stop = sampling_params.stop
        stop = [stop] if isinstance(stop, str) else list(stop)
        if stop:
            kwargs["stop"] = stop[:4]  # the OpenAI API takes at most four stop sequences
        if sampling_params.json_schema is not None and self.is_chat_model:
            import json

            kwargs["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": json.loads(sampling_params.json_schema)}}
        return kwargs

    def _chat_messages(self, s: Any) -> list[dict]:
        if not s.text_.endswith(self.chat_prefix):
            raise RuntimeError("For OpenAI chat models, sgl.gen must come right after sgl.assistant "
                               "(the request is built from the program's messages).")
        return s.messages_

    def generate(self, s: Any, sampling_params: SglSamplingParams) -> tuple[Any, dict]:
        kwargs = self._request_kwargs(sampling_params)
        if self.is_chat_model:
            ret = self.client.chat.completions.create(model=self.model_name, messages=self._chat_messages(s),
                                                      **kwargs)
            texts = [c.message.content or "" for c in ret.choices]
        else:
            ret = self.client.completions.create(model=self.model_name, prompt=s.text_, **kwargs)
            texts = [c.text for c in ret.choices]
        meta = {"id": ret.id, "finish_reason": ret.choices[0].finish_reason,
                "prompt_tokens": ret.usage.prompt_tokens if ret.usage else None,
                "completion_tokens": ret.usage.completion_tokens if ret.usage else None}
        return (texts if sampling_params.n > 1 else texts[0]), meta

    def generate_stream(self, s: Any, sampling_params: SglSamplingParams) -> Iterator[tuple[str, dict]]:
        kwargs = self._request_kwargs(sampling_params)
        kwargs.pop("n")
        if self.is_chat_model:
            stream = self.client.chat.completions.create(model=self.model_name, messages=self._chat_messages(s),
                                                         stream=True, **kwargs)
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    yield chunk.choices[0].delta.content, {"id": chunk.id}
        else:
            stream = self.client.completions.create(model=self.model_name, prompt=s.text_, stream=True, **kwargs)
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    yield chunk.choices[0].text, {"id": chunk.id}

    # ---- selection --------------------------------------------------------------------------------
    def _prompt_logprobs(self, prompts: list[str]) -> list[tuple[list[Optional[float]], list[str]]]:
        ret = self.client.completions.create(model=self.model_name, prompt=prompts, max_tokens=1, temperature=0,
                                             echo=True, logprobs=0)
        out = []
        for choice in sorted(ret.choices, key=lambda c: c.index):
            if choice.logprobs is None or not choice.logprobs.token_logprobs:
                raise NotImplementedError("select() needs prompt logprobs (echo + logprobs) from the endpoint")
            # The last entry is the one generated token: drop it, keep the prompt's entries.
            out.append((list(choice.logprobs.token_logprobs[:-1]), list(choice.logprobs.tokens[:-1])))
        return out

    def select(self, s: Any, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod = token_length_normalized) -> ChoicesDecision:
        if temperature > 1e-5:
            raise ValueError(f"select() scores choices deterministically; temperature must be 0 (got {temperature})")
        if choices_method.requires_unconditional_logprobs:
            raise NotImplementedError("unconditional_likelihood_normalized needs token ids, which the OpenAI "
                                      "API does not return; use a native backend")
        (prefix_logprobs, _), *scored = self._prompt_logprobs([s.text_] + [s.text_ + c for c in choices])
        start = max(len(prefix_logprobs) - 2, 0)
        input_token_logprobs = []
        for logprobs, tokens in scored:
            # Same window as the native /generate request: from two tokens before the choice, first one null.
            entries = [[lp, None, tok] for lp, tok in zip(logprobs[start:], tokens[start:])]
            if entries:
                entries[0][0] = None
            input_token_logprobs.append(entries)
        normalized = [compute_normalized_prompt_logprobs(lp) for lp in input_token_logprobs]
        for i, logprobs in enumerate(input_token_logprobs):
            if len(logprobs) > 1 and logprobs[0][2] and s.text_.endswith(logprobs[0][2]):
                input_token_logprobs[i] = logprobs[1:]
                normalized[i] = compute_normalized_prompt_logprobs(input_token_logprobs[i])
        return choices_method(choices=choices, normalized_prompt_logprobs=normalized,
                              input_token_logprobs=input_token_logprobs,
                              output_token_logprobs=[[] for _ in choices])


