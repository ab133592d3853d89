"""The intermediate representation of a frontend program: expressions appended to a program state."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable
from typing import Any, Optional, Union

REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

# Sampling fields a gen can set; None means "inherit the run-level default".
SAMPLING_FIELDS = (
    "max_new_tokens", "min_new_tokens", "n", "stop", "stop_token_ids", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "ignore_eos", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "return_text_in_logprobs", "json_schema",
)


@dataclasses.dataclass
class SglSamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    n: int = 1
    stop: Union[str, list[str]] = ()
    stop_token_ids: Optional[list[int]] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    return_logprob: Optional[bool] = None
    logprob_start_len: Optional[int] = None
    top_logprobs_num: Optional[int] = None
    return_text_in_logprobs: Optional[bool] = None
    json_schema: Optional[str] = None
    dtype: Optional[str] = None
    regex: Optional[str] = None

    def clone(self) -> SglSamplingParams:
        return dataclasses.replace(self)

    def to_srt_kwargs(self) -> dict[str, Any]:
        """The `sampling_params` object of a native /generate request."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "min_new_tokens": self.min_new_tokens,
            "n": self.n,
            "stop": list(self.stop) if isinstance(self.stop, (list, tuple)) else self.stop,
            "stop_token_ids": self.stop_token_ids,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "ignore_eos": self.ignore_eos,
            "regex": self.regex,
            "json_schema": self.json_schema,
        }


class SglExpr:
    node_ct = 0

    def __init__(self) -> None:
        self.node_id = SglExpr.node_ct
        SglExpr.node_ct += 1

    def __add__(self, other: Any) -> SglExprList:
        other = _as_expr(other)
        if isinstance(self, SglExprList):
            return SglExprList(self.expr_list + [other])
        return SglExprList([self, other])

    def __radd__(self, other: Any) -> SglExprList:
        other = _as_expr(other)
        if isinstance(self, SglExprList):
            return SglExprList([other] + self.expr_list)
        return SglExprList([other, self])


def _as_expr(x: Any) -> SglExpr:
    if isinstance(x, SglExpr):
        return x
    if isinstance(x, str):
        return SglConstantText(x)
    raise TypeError(f"Cannot concatenate {type(x).__name__} with a frontend expression")


class SglExprList(SglExpr):
    def __init__(self, expr_list: list[SglExpr]) -> None:
        super().__init__()
        self.expr_list = expr_list

    def __repr__(self) -> str:
        return f"ExprList({self.expr_list})"


class SglArgument(SglExpr):
    """A placeholder for a program argument while tracing."""

    def __init__(self, name: str, value: Any = None) -> None:
        super().__init__()
        self.name, self.value = name, value

    def __repr__(self) -> str:
        return f"Argument(name={self.name})"


class SglConstantText(SglExpr):
    def __init__(self, value: str) -> None:
        super().__init__()
        self.value = value

    def __repr__(self) -> str:
        return f"Constant({self.value!r})"


class SglImage(SglExpr):
    def __init__(self, path: Any) -> None:
        super().__init__()
        self.path = path


class SglVideo(SglExpr):
    def __init__(self, path: str, num_frames: int) -> None:
        super().__init__()
        self.path, self.num_frames = path, num_frames


class SglGen(SglExpr):
    def __init__(self, name: Optional[str] = None, regex: Optional[str] = None, dtype: Any = None,
                 **sampling: Any) -> None:
        super().__init__()
        self.name = name
        if dtype is not None:
            dtype = _dtype_name(dtype)
            if regex is not None:
                warnings.warn("dtype overrides regex in gen()", stacklevel=2)
                regex = None
        self.sampling_params = {k: v for k, v in sampling.items() if v is not None}
        self.regex, self.dtype = regex, dtype

    def __repr__(self) -> str:
        return f"Gen({self.name!r})"


def _dtype_name(dtype: Any) -> str:
    names = {int: "int", float: "float", str: "str", bool: "bool"}
    if dtype in names:
        return names[dtype]
    if dtype in names.values():
        return dtype
    raise ValueError(f"Unsupported dtype {dtype!r}; use int, float, str or bool")


class SglSelect(SglExpr):
    def __init__(self, name: Optional[str], choices: list[str], temperature: float, choices_method: Any) -> None:
        super().__init__()
        self.name, self.choices = name, choices
        self.temperature, self.choices_method = temperature, choices_method

    def __repr__(self) -> str:
        return f"Select({self.name!r}, choices={self.choices})"


class SglRoleBegin(SglExpr):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role


class SglRoleEnd(SglExpr):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role


class SglVarScopeBegin(SglExpr):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


class SglVarScopeEnd(SglExpr):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


class SglCommitLazy(SglExpr):
    """Send the text so far to the backend (max_new_tokens=0) so that later requests hit the prefix cache."""


class SglSeparateReasoning(SglExpr):
    def __init__(self, model_type: str, expr: SglExpr) -> None:
        super().__init__()
        self.model_type, self.expr = model_type, expr
        self.name = getattr(expr, "name", None)


class SglFunction:
    """A program: a Python function whose first parameter is the program state."""

    def __init__(self, func: Callable, num_api_spec_tokens: Optional[int] = None,
                 bind_arguments: Optional[dict] = None) -> None:
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = bind_arguments or {}
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise TypeError("A frontend function must take the program state as its first parameter")
        self.arg_names = [p.name for p in params[1:]]
        self.arg_defaults = [p.default for p in params[1:]]
        self.pin_prefix_done = False

    def bind(self, **kwargs: Any) -> SglFunction:
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"bind(): unknown arguments {sorted(unknown)}")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def run(self, *args: Any, max_new_tokens: int = 128, n: int = 1, stop: Optional[Union[str, list[str]]] = None,
            stop_token_ids: Optional[list[int]] = None, temperature: float = 1.0, top_p: float = 1.0,
            top_k: int = -1, min_p: float = 0.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
            ignore_eos: bool = False, return_logprob: Optional[bool] = None,
            logprob_start_len: Optional[int] = None, top_logprobs_num: Optional[int] = None,
            return_text_in_logprobs: Optional[bool] = None, stream: bool = False, backend: Any = None,
            use_thread: bool = True, **kwargs: Any):
        from sglang.lang.runner import run_program

        sampling = SglSamplingParams(
            max_new_tokens=max_new_tokens, n=n, stop=stop if stop is not None else (),
            stop_token_ids=stop_token_ids, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num, return_text_in_logprobs=return_text_in_logprobs,
        )
        kwargs = {**self.bind_arguments, **kwargs}
        return run_program(self, _resolve_backend(backend), args, kwargs, sampling, stream, use_thread=use_thread)

    def run_batch(self, batch_kwargs: list, *, max_new_tokens: int = 128, n: int = 1,
                  stop: Optional[Union[str, list[str]]] = None, stop_token_ids: Optional[list[int]] = None,
                  temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
                  frequency_penalty: float = 0.0, presence_penalty: float = 0.0, ignore_eos: bool = False,
                  return_logprob: Optional[bool] = None, logprob_start_len: Optional[int] = None,
                  top_logprobs_num: Optional[int] = None, return_text_in_logprobs: Optional[bool] = None,
                  backend: Any = None, num_threads: Union[str, int] = "auto", progress_bar: bool = False,
                  generator_style: bool = False):
        from sglang.lang.runner import run_program_batch

        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch expects a list of argument dicts (or of positional tuples)")
        normalized = []
        for item in batch_kwargs:
            if isinstance(item, dict):
                normalized.append({**self.bind_arguments, **item})
            elif isinstance(item, (list, tuple)):
                if len(item) != len(self.arg_names):
                    raise Exception("Given arguments mismatch the SGL function signature")
                normalized.append({**self.bind_arguments, **dict(zip(self.arg_names, item))})
            else:
                raise TypeError(f"run_batch items must be dicts or tuples, got {type(item).__name__}")
        sampling = SglSamplingParams(
            max_new_tokens=max_new_tokens, n=n, stop=stop if stop is not None else (),
            stop_token_ids=stop_token_ids, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num, return_text_in_logprobs=return_text_in_logprobs,
        )
        return run_program_batch(self, _resolve_backend(backend), normalized, sampling, num_threads,
                                 progress_bar, generator_style)

    def trace(self, *, backend: Any = None, **kwargs: Any):
        """Run the program without a model up to its first generation; returns the tracing state."""
        from sglang.lang.runner import trace_program

        return trace_program(self, kwargs, backend)

    def cache(self, backend: Any = None) -> None:
        """Send the program's constant prefix once so that later runs hit the prefix cache."""
        from sglang.lang.runner import cache_program

        cache_program(self, _resolve_backend(backend))

    def __call__(self, *args: Any, **kwargs: Any):
        return self.run(*args, **kwargs)


def _resolve_backend(backend: Any):
    from sglang.global_config import global_config
    from sglang.lang.backend.base_backend import as_backend

    backend = backend or global_config.default_backend
    assert backend is not None, "Please specify a backend"
    return as_backend(backend)
