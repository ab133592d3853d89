"""The public functions of the frontend language (`sgl.function`, `sgl.gen`, `sgl.select`, roles, ...)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Optional, Union

from sglang.global_config import global_config
from sglang.lang.choices import ChoicesSamplingMethod, token_length_normalized
from sglang.lang.ir import (
    SglExpr,
    SglExprList,
    SglFunction,
    SglGen,
    SglImage,
    SglRoleBegin,
    SglRoleEnd,
    SglSelect,
    SglSeparateReasoning,
    SglVideo,
    _as_expr,
)


def function(func: Optional[Callable] = None, num_api_spec_tokens: Optional[int] = None):
    if func is not None:
        return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)

    def decorator(f: Callable) -> SglFunction:
        return SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)

    return decorator


def set_default_backend(backend: Any) -> None:
    from sglang.lang.backend.base_backend import as_backend

    global_config.default_backend = as_backend(backend)


def _backend(backend: Any):
    from sglang.lang.backend.base_backend import as_backend

    backend = backend or global_config.default_backend
    if backend is None:
        return None
    return as_backend(backend)


def flush_cache(backend: Any = None) -> bool:
    backend = _backend(backend)
    if backend is None:
        return False
    backend.flush_cache()
    return True


def get_server_info(backend: Any = None) -> Optional[dict]:
    backend = _backend(backend)
    return None if backend is None else backend.get_server_info()


def gen(name: Optional[str] = None, max_tokens: Optional[int] = None, min_tokens: Optional[int] = None,
        n: Optional[int] = None, stop: Optional[Union[str, list[str]]] = None,
        stop_token_ids: Optional[list[int]] = None, temperature: Optional[float] = None,
        top_p: Optional[float] = None, top_k: Optional[int] = None, min_p: Optional[float] = None,
        frequency_penalty: Optional[float] = None, presence_penalty: Optional[float] = None,
        ignore_eos: Optional[bool] = None, return_logprob: Optional[bool] = None,
        logprob_start_len: Optional[int] = None, top_logprobs_num: Optional[int] = None,
        return_text_in_logprobs: Optional[bool] = None, dtype: Optional[Any] = None,
        choices: Optional[list[str]] = None, choices_method: Optional[ChoicesSamplingMethod] = None,
        regex: Optional[str] = None, json_schema: Optional[Any] = None) -> SglExpr:
    """A generation into variable `name`; with `choices`, a select among them."""
    if choices is not None:
        return select(name, choices, 0.0 if temperature is None else temperature,
                      token_length_normalized if choices_method is None else choices_method)
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(f"gen({name!r}): invalid regex {regex!r}: {e}") from e
    if json_schema is not None:
        from sglang.utils import convert_json_schema_to_str

        json_schema = convert_json_schema_to_str(json_schema)
    return SglGen(
        name, regex=regex, dtype=dtype, max_tokens=max_tokens, min_tokens=min_tokens, n=n, stop=stop,
        stop_token_ids=stop_token_ids, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
        return_logprob=return_logprob, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, json_schema=json_schema,
    )


def gen_int(name: Optional[str] = None, max_tokens: Optional[int] = None, n: Optional[int] = None,
            stop: Optional[Union[str, list[str]]] = None, stop_token_ids: Optional[list[int]] = None,
            temperature: Optional[float] = None, top_p: Optional[float] = None, top_k: Optional[int] = None,
            min_p: Optional[float] = None, frequency_penalty: Optional[float] = None,
            presence_penalty: Optional[float] = None, ignore_eos: Optional[bool] = None,
            return_logprob: Optional[bool] = None, logprob_start_len: Optional[int] = None,
            top_logprobs_num: Optional[int] = None, return_text_in_logprobs: Optional[bool] = None) -> SglExpr:
    return gen(name, max_tokens=max_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
               temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
               frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
               return_logprob=return_logprob, logprob_start_len=logprob_start_len,
               top_logprobs_num=top_logprobs_num, return_text_in_logprobs=return_text_in_logprobs, dtype=int)


def gen_string(name: Optional[str] = None, max_tokens: Optional[int] = None, n: Optional[int] = None,
               stop: Optional[Union[str, list[str]]] = None, stop_token_ids: Optional[list[int]] = None,
               temperature: Optional[float] = None, top_p: Optional[float] = None, top_k: Optional[int] = None,
               min_p: Optional[float] = None, frequency_penalty: Optional[float] = None,
               presence_penalty: Optional[float] = None, ignore_eos: Optional[bool] = None,
               return_logprob: Optional[bool] = None, logprob_start_len: Optional[int] = None,
               top_logprobs_num: Optional[int] = None,
               return_text_in_logprobs: Optional[bool] = None) -> SglExpr:
    return gen(name, max_tokens=max_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
               temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
               frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
               return_logprob=return_logprob, logprob_start_len=logprob_start_len,
               top_logprobs_num=top_logprobs_num, return_text_in_logprobs=return_text_in_logprobs, dtype=str)


def select(name: Optional[str] = None, choices: Optional[list[str]] = None, temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> SglExpr:
    if not choices:
        raise ValueError(f"select({name!r}) needs a non-empty list of choices")
    if not all(isinstance(c, str) for c in choices):
        raise TypeError(f"select({name!r}): every choice must be a string")
    if not isinstance(choices_method, ChoicesSamplingMethod):
        raise TypeError(f"select({name!r}): choices_method must be one of sglang's choice methods")
    return SglSelect(name, list(choices), temperature, choices_method)


def image(expr: Any) -> SglExpr:
    return SglImage(expr)


def video(path: str, num_frames: int) -> SglExpr:
    return SglVideo(path, num_frames)


def separate_reasoning(expr: Optional[SglExpr] = None, model_type: Optional[str] = None):
    return SglExprList([SglSeparateReasoning(model_type, expr)])


def _role_common(name: str, expr: Optional[Any] = None) -> SglExprList:
    if expr is None:
        return SglExprList([SglRoleBegin(name), SglRoleEnd(name)])
    return SglExprList([SglRoleBegin(name), _as_expr(expr), SglRoleEnd(name)])


def system(expr: Optional[Any] = None) -> SglExprList:
    return _role_common("system", expr)


def user(expr: Optional[Any] = None) -> SglExprList:
    return _role_common("user", expr)


def assistant(expr: Optional[Any] = None) -> SglExprList:
    return _role_common("assistant", expr)


def system_begin() -> SglRoleBegin:
    return SglRoleBegin("system")


def system_end() -> SglRoleEnd:
    return SglRoleEnd("system")


def user_begin() -> SglRoleBegin:
    return SglRoleBegin("user")


def user_end() -> SglRoleEnd:
    return SglRoleEnd("user")


def assistant_begin() -> SglRoleBegin:
    return SglRoleBegin("assistant")


def assistant_end() -> SglRoleEnd:
    return SglRoleEnd("assistant")
