"""The executor behind each program state: a worker thread that runs appended expressions in order."""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from typing import Any, Optional

from sglang.lang.backend.native_backend import encode_image_base64
from sglang.lang.chat_template import ChatTemplate
from sglang.lang.ir import (
    SAMPLING_FIELDS,
    SglArgument,
    SglCommitLazy,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglGen,
    SglImage,
    SglRoleBegin,
    SglRoleEnd,
    SglSamplingParams,
    SglSelect,
    SglSeparateReasoning,
    SglVarScopeBegin,
    SglVarScopeEnd,
    SglVideo,
)

logger = logging.getLogger(__name__)

# gen() keyword -> field of SglSamplingParams, where the names differ.
_GEN_TO_SAMPLING = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}


class StopTracing(Exception):
    """Raised while tracing when the program reaches something that depends on its arguments or a model."""


class ConcateAndAppend(SglExpr):
    def __init__(self, states: list) -> None:
        super().__init__()
        self.states = states


class StreamExecutor:
    """Holds a program's text, messages and variables; executes expressions on its own thread.

    With `tracing=True` it runs synchronously and stops (StopTracing) at the first generation or argument,
    which yields the program's constant prefix."""

    def __init__(self, backend: Any, arguments: dict, default_sampling_para: SglSamplingParams,
                 chat_template: Optional[ChatTemplate], stream: bool, use_thread: bool = True,
                 tracing: bool = False) -> None:
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = arguments
        self.default_sampling_para = default_sampling_para
        self.stream = stream
        self.tracing = tracing
        self.chat_template = chat_template or backend.get_chat_template()

        self.variables: dict[Any, Any] = {}
        self.variable_event: dict[Any, threading.Event] = {}
        self.meta_info: dict[Any, Any] = {}
        self.is_finished = False
        self.ended = False
        self.error_: Optional[BaseException] = None

        self.text_ = ""
        self.messages_: list[dict] = []
        self.cur_role: Optional[str] = None
        self.cur_role_begin_pos: Optional[int] = None
        self.images_: list[tuple[Any, str]] = []
        self.cur_images: list[tuple[Any, str]] = []
        self.fork_start_text_pos: Optional[int] = None
        self.var_scopes: dict[str, int] = {}

        self.stream_text_event = threading.Event() if stream else None
        self.stream_var_event: dict[Any, threading.Event] = {}

        self.use_thread = use_thread and not tracing
        if self.use_thread:
            self.queue: queue.Queue = queue.Queue()
            self.worker = threading.Thread(target=self._thread_worker_func, daemon=True)
            self.worker.start()

    # ---- queue ------------------------------------------------------------------------------------
    def submit(self, expr: SglExpr) -> None:
        self._init_var_event(expr)
        if self.use_thread:
            if self.error_ is not None:
                raise RuntimeError(f"The program state failed earlier: {self.error_}") from self.error_
            if self.ended:
                raise RuntimeError("The program has ended; its state no longer runs expressions")
            self.queue.put(expr)
        else:
            self._execute(expr)

    def sync(self) -> None:
        if self.use_thread:
            self.queue.join()

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.use_thread and self.worker.is_alive():
            self.queue.put(None)
        self.backend.end_program(self)

    def _thread_worker_func(self) -> None:
        error = None
        while True:
            expr = self.queue.get()
            if expr is None:
                self.queue.task_done()
                break
            try:
                self._execute(expr)
            except Exception as e:  # noqa: BLE001 - surfaced to the caller through get_var / error()
                logger.warning("Error in a frontend program: %r", e)
                error = e
                self.queue.task_done()
                break
            self.queue.task_done()
            if self.stream_text_event:
                self.stream_text_event.set()
        # Drain what is left so sync() returns, then wake every waiter: nothing more will be produced.
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
            self.queue.task_done()
        self.error_ = error
        self.is_finished = True
        for event in list(self.variable_event.values()) + list(self.stream_var_event.values()):
            event.set()
        if self.stream_text_event:
            self.stream_text_event.set()

    def _init_var_event(self, expr: SglExpr) -> None:
        if isinstance(expr, (SglGen, SglSelect, SglVarScopeBegin, SglSeparateReasoning)):
            self.variable_event.setdefault(expr.name, threading.Event())
            if self.stream:
                self.stream_var_event.setdefault(expr.name, threading.Event())
            if isinstance(expr, SglSeparateReasoning) and expr.expr is not None:
                self._init_var_event(expr.expr)
        elif isinstance(expr, SglExprList):
            for e in expr.expr_list:
                self._init_var_event(e)

    def get_var(self, name: Any) -> Any:
        if name in self.variables and (name not in self.variable_event or self.variable_event[name].is_set()):
            return self.variables[name]
        if name not in self.variable_event:
            # Not produced by anything queued so far; it may still come from a var_scope in the queue.
            self.sync()
            if name not in self.variable_event and name not in self.variables:
                known = sorted(str(k) for k in self.variables)
                raise KeyError(f"Unknown variable {name!r} in the program state; defined variables: {known}")
        if name in self.variable_event:
            self.variable_event[name].wait()
        if name not in self.variables:
            if self.error_ is not None:
                raise RuntimeError(f"The program failed before setting variable {name!r}: {self.error_}") \
                    from self.error_
            raise KeyError(f"Variable {name!r} was never set: the program ended first")
        return self.variables[name]

    def set_var(self, name: Any, value: Any) -> None:
        self.variables[name] = value
        self.variable_event.setdefault(name, threading.Event()).set()

    # ---- execution --------------------------------------------------------------------------------
    def _execute(self, other: Any) -> None:
        if isinstance(other, str):
            self._execute_fill(other)
        elif isinstance(other, SglExprList):
            for x in other.expr_list:
                self._execute(x)
        elif isinstance(other, SglConstantText):
            self._execute_fill(other.value)
        elif isinstance(other, SglArgument):
            if self.tracing:
                raise StopTracing()
            self._execute_fill(str(other.value))
        elif isinstance(other, SglGen):
            self._execute_gen(other)
        elif isinstance(other, SglSelect):
            self._execute_select(other)
        elif isinstance(other, SglRoleBegin):
            self._execute_role_begin(other)
        elif isinstance(other, SglRoleEnd):
            self._execute_role_end(other)
        elif isinstance(other, (SglImage, SglVideo)):
            self._execute_image(other)
        elif isinstance(other, SglVarScopeBegin):
            self.var_scopes[other.name] = len(self.text_)
        elif isinstance(other, SglVarScopeEnd):
            begin = self.var_scopes.pop(other.name)
            self.variables[other.name] = self.text_[begin:]
            self.variable_event[other.name].set()
        elif isinstance(other, SglCommitLazy):
            if not self.tracing:
                self.backend.commit_lazy_operations(self)
        elif isinstance(other, ConcateAndAppend):
            self._execute_concatenate_and_append_text(other)
        elif isinstance(other, SglSeparateReasoning):
            self._execute_separate_reasoning(other)
        else:
            raise ValueError(f"Unknown type: {type(other)}")

    def _execute_fill(self, value: Any) -> None:
        self.text_ += str(value)

    def _execute_image(self, expr: Any) -> None:
        if self.tracing:
            raise StopTracing()
        base64_data = encode_image_base64(expr.path)
        self.images_.append((expr.path, base64_data))
        self.cur_images.append((expr.path, base64_data))
        self.text_ += self.chat_template.image_token

    def _resolve_sampling_params(self, gen_params: dict) -> SglSamplingParams:
        params = self.default_sampling_para.clone()
        for key, value in gen_params.items():
            field = _GEN_TO_SAMPLING.get(key, key)
            if field not in SAMPLING_FIELDS:
                raise TypeError(f"gen() got an unknown sampling parameter {key!r}")
            setattr(params, field, value)
        stop = params.stop
        params.stop = [stop] if isinstance(stop, str) else list(stop)
        # The template's end-of-turn marker always ends a generation inside a role.
        params.stop += [s for s in self.chat_template.stop_str if s not in params.stop]
        return params

    def _execute_gen(self, expr: SglGen) -> None:
        if self.tracing:
            raise StopTracing()
        params = self._resolve_sampling_params(expr.sampling_params)
        params.regex, params.dtype = expr.regex, expr.dtype
        name = expr.name
        if not self.stream:
            comp, meta_info = self.backend.generate(self, sampling_params=params)
            self.text_ += comp[0] if isinstance(comp, list) else comp
            self.variables[name] = comp
            self.meta_info[name] = meta_info
            self.variable_event[name].set()
            return
        self.variables[name] = ""
        self.stream_var_event[name].set()
        for comp, meta_info in self.backend.generate_stream(self, sampling_params=params):
            self.text_ += comp
            self.variables[name] += comp
            self.meta_info[name] = meta_info
            self.stream_var_event[name].set()
            self.stream_text_event.set()
        self.variable_event[name].set()
        self.stream_var_event[name].set()

    def _execute_select(self, expr: SglSelect) -> None:
        if self.tracing:
            raise StopTracing()
        decision = self.backend.select(self, expr.choices, expr.temperature, expr.choices_method)
        if expr.name is not None:
            self.variables[expr.name] = decision.decision
            self.meta_info[expr.name] = decision.meta_info
            self.variable_event[expr.name].set()
            if expr.name in self.stream_var_event:
                self.stream_var_event[expr.name].set()
        self.text_ += decision.decision

    def _execute_role_begin(self, expr: SglRoleBegin) -> None:
        assert self.cur_role is None, "Nested roles are not allowed."
        if not self.messages_ and expr.role != "system":
            default_system = self.chat_template.default_system_prompt
            if default_system:
                self._execute_role_begin(SglRoleBegin("system"))
                self._execute_fill(default_system)
                self._execute_role_end(SglRoleEnd("system"))
        self.cur_role = expr.role
        prefix, _ = self.chat_template.get_prefix_and_suffix(expr.role, self.messages_)
        self._execute_fill(prefix)
        self.cur_role_begin_pos = len(self.text_)

    def _execute_role_end(self, expr: SglRoleEnd) -> None:
        if self.cur_role != expr.role:
            raise AssertionError(f"Role end {expr.role!r} does not match the open role {self.cur_role!r}")
        new_text = self.text_[self.cur_role_begin_pos:].lstrip()
        _, suffix = self.chat_template.get_prefix_and_suffix(expr.role, self.messages_)
        self._execute_fill(suffix)
        if self.cur_images:
            content: Any = [{"type": "text", "text": new_text}] + [
                {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{b64}"}}
                for _, b64 in self.cur_images
            ]
            self.cur_images = []
        else:
            content = new_text
        self.messages_.append({"role": expr.role, "content": content})
        self.cur_role = None
        self.cur_role_begin_pos = None

    def _execute_concatenate_and_append_text(self, expr: ConcateAndAppend) -> None:
        new_text = ""
        for state in expr.states:
            exe = state.stream_executor
            exe.sync()
            new_text += exe.text_[exe.fork_start_text_pos:]
        self._execute_fill(new_text)

    def _execute_separate_reasoning(self, expr: SglSeparateReasoning) -> None:
        self._execute(expr.expr)
        name = expr.name
        text = self.variables.get(name)
        if not isinstance(text, str):
            return
        reasoning, answer = "", text
        if "</think>" in text:
            reasoning, answer = text.split("</think>", 1)
            reasoning = reasoning.replace("<think>", "", 1).strip()
            answer = answer.lstrip()
        self.variables[name] = answer
        self.set_var(f"{name}_reasoning_content", reasoning)

    # ---- forking ----------------------------------------------------------------------------------
    def fork(self, size: int = 1) -> list[StreamExecutor]:
        if self.tracing:
            raise StopTracing()
        size = int(size)
        if size < 1:
            raise ValueError(f"fork() needs a positive number of branches, got {size}")
        # Wait for the queued expressions first: the text decides whether there is a prefix to share.
        self.sync()
        if size > 1 and self.text_ and self.error_ is None:
            # Send the shared prefix once; every branch then finds it in the prefix cache.
            self.submit(SglCommitLazy())
            self.sync()
        if self.error_ is not None:
            raise RuntimeError(f"Cannot fork a failed program state: {self.error_}") from self.error_
        exes = []
        for _ in range(size):
            exe = StreamExecutor(self.backend, self.arguments, self.default_sampling_para, self.chat_template,
                                 self.stream)
            for name, value in self.variables.items():
                exe.set_var(name, value)
            exe.meta_info = dict(self.meta_info)
            exe.text_ = self.text_
            exe.messages_ = list(self.messages_)
            exe.cur_role = self.cur_role
            exe.cur_role_begin_pos = self.cur_role_begin_pos
            exe.fork_start_text_pos = len(self.text_)
            exe.images_ = list(self.images_)
            exes.append(exe)
        return exes
