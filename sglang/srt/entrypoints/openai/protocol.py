"""Request and response schemas of the OpenAI-compatible API (with SGLang's extra fields)."""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class StreamOptions(BaseModel):
    include_usage: Optional[bool] = False


class JsonSchemaResponseFormat(BaseModel):
    name: str = "schema"
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = False
    model_config = ConfigDict(populate_by_name=True)


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: Optional[JsonSchemaResponseFormat] = None
    structures: Optional[list[dict[str, Any]]] = None
    triggers: Optional[list[str]] = None


class SamplingExtras(BaseModel):
    """Fields shared by chat and completions requests: OpenAI sampling fields plus SGLang's extras."""

    model: str = "default"
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    n: int = Field(default=1, ge=1, le=128)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    user: Optional[str] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    min_tokens: int = Field(default=0, ge=0)
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    repetition_penalty: Optional[float] = None
    stop_token_ids: Optional[list[int]] = None
    no_stop_trim: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    lora_path: Optional[Any] = None
    session_params: Optional[dict] = None
    rid: Optional[str] = None
    return_hidden_states: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_items(cls, v):
        if isinstance(v, list) and not all(isinstance(s, str) for s in v):
            raise ValueError("'stop' must be a string or a list of strings")
        return v


class ChatMessage(BaseModel):
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    reasoning_content: Optional[str] = None

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        low = v.lower()
        if low not in ("system", "user", "assistant", "tool", "developer"):
            raise ValueError("'role' must be one of 'system', 'assistant', or 'tool' (case-insensitive).")
        return low

    @model_validator(mode="after")
    def _content(self):
        if isinstance(self.content, list):
            for part in self.content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("text", "image_url", "video_url", "audio_url", "input_audio"):
                    raise ValueError(f"Unsupported content part type: {kind!r}")
                if kind == "text" and not isinstance(part.get("text"), str):
                    raise ValueError("A text content part needs a string 'text'")
                if self.role != "user" and kind != "text":
                    raise ValueError(f"Only user messages may contain {kind} parts")
        return self


class ChatCompletionRequest(SamplingExtras):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    max_tokens: Optional[int] = Field(default=None, ge=0)
    max_completion_tokens: Optional[int] = Field(default=None, ge=0)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, v):
        if not v:
            raise ValueError("'messages' must contain at least one message")
        return v


class CompletionRequest(SamplingExtras):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    best_of: Optional[int] = None
    echo: bool = False
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    max_tokens: int = Field(default=16)
    suffix: Optional[str] = None
    json_schema: Optional[str] = None

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v is not None and v <= 0:
            raise ValueError("max_tokens must be positive")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and len(v) == 0:
            raise ValueError("'prompt' cannot be empty")
        if isinstance(v, list) and isinstance(v[0], list) and any(len(x) == 0 for x in v):
            raise ValueError("'prompt' token lists cannot be empty")
        return v


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: Optional[int] = 0
    prompt_tokens_details: Optional[dict[str, int]] = None


class ErrorResponse(BaseModel):
    object: str = "error"
    message: str
    type: str
    param: Optional[str] = None
    code: int


def now() -> int:
    return int(time.time())
