"""`ProgramState` (the `s` of a program and what `run` returns) and `ProgramStateGroup` (its forks)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Optional, Union

from sglang.lang.interpreter import ConcateAndAppend, StopTracing, StreamExecutor
from sglang.lang.ir import (
    SglConstantText,
    SglExpr,
    SglExprList,
    SglRoleBegin,
    SglRoleEnd,
    SglVarScopeBegin,
    SglVarScopeEnd,
)


class ProgramState:
    def __init__(self, stream_executor: StreamExecutor) -> None:
        self.stream_executor = stream_executor
        self.ret_value: Any = None

    # ---- roles ------------------------------------------------------------------------------------
    def _role_common(self, name: str, expr: Optional[Any] = None):
        if expr is not None:
            self.stream_executor.submit(SglExprList([SglRoleBegin(name), _to_expr(expr), SglRoleEnd(name)]))
            return None

        @contextlib.contextmanager
        def role_scope():
            self.stream_executor.submit(SglRoleBegin(name))
            yield
            self.stream_executor.submit(SglRoleEnd(name))

        return role_scope()

    def system(self, expr: Optional[Any] = None):
        return self._role_common("system", expr)

    def user(self, expr: Optional[Any] = None):
        return self._role_common("user", expr)

    def assistant(self, expr: Optional[Any] = None):
        return self._role_common("assistant", expr)

    @contextlib.contextmanager
    def var_scope(self, name: str):
        self.stream_executor.submit(SglVarScopeBegin(name))
        yield
        self.stream_executor.submit(SglVarScopeEnd(name))

    # ---- forks ------------------------------------------------------------------------------------
    def fork(self, size: int = 1, position_ids_offset: Optional[list[int]] = None) -> ProgramStateGroup:
        states = [ProgramState(x) for x in self.stream_executor.fork(size)]
        return ProgramStateGroup(states, self)

    @contextlib.contextmanager
    def copy(self, position_ids_offset: Optional[list[int]] = None):
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()

    # ---- reading ----------------------------------------------------------------------------------
    def text(self) -> str:
        self.stream_executor.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict]:
        self.stream_executor.sync()
        return self.stream_executor.messages_

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> Optional[BaseException]:
        self.stream_executor.sync()
        return self.stream_executor.error_

    def get_var(self, name: Any) -> Any:
        if self.stream_executor.tracing:
            raise StopTracing()
        return self.stream_executor.get_var(name)

    def set_var(self, name: Any, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: Any) -> Any:
        self.get_var(name)
        return self.stream_executor.meta_info.get(name)

    def text_iter(self, var_name: Optional[str] = None) -> Iterator[str]:
        exe = self.stream_executor
        if not exe.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        prev = 0
        if var_name is None:
            event = exe.stream_text_event
            while True:
                event.wait()
                event.clear()
                finished = exe.is_finished
                out = exe.text_[prev:]
                prev += len(out)
                if out:
                    yield out
                if finished:
                    break
            self._raise_if_failed()
            return
        event = self._stream_var_event(var_name)
        if event is None:
            return
        while True:
            event.wait()
            event.clear()
            done = exe.variable_event[var_name].is_set()
            out = exe.variables.get(var_name, "")[prev:]
            prev += len(out)
            if out:
                yield out
            if done:
                break
        self._raise_if_failed()

    def _stream_var_event(self, var_name: str):
        exe = self.stream_executor
        if var_name not in exe.stream_var_event:
            exe.sync()
            if var_name not in exe.stream_var_event:
                raise KeyError(f"Unknown variable {var_name!r}: no gen or select in the program sets it")
        return exe.stream_var_event[var_name]

    def _raise_if_failed(self) -> None:
        if self.stream_executor.error_ is not None:
            raise RuntimeError(f"The program failed: {self.stream_executor.error_}") from self.stream_executor.error_

    async def text_async_iter(self, var_name: Optional[str] = None,
                              return_meta_data: bool = False) -> AsyncIterator[Any]:
        """Like text_iter, without blocking the event loop (each wait runs in a worker thread)."""
        iterator = self.text_iter(var_name)
        loop = asyncio.get_running_loop()
        sentinel = object()
        while True:
            out = await loop.run_in_executor(None, next, iterator, sentinel)
            if out is sentinel:
                break
            if return_meta_data:
                meta = self.stream_executor.meta_info.get(var_name) if var_name is not None else None
                yield out, meta
            else:
                yield out

    # ---- operators --------------------------------------------------------------------------------
    def __iadd__(self, other: Any) -> ProgramState:
        if other is None:
            raise ValueError("Tried to append None to state.")
        self.stream_executor.submit(_to_expr(other))
        return self

    def __getitem__(self, name: Any) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: Any, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: Any) -> bool:
        return name in self.stream_executor.variables

    def __del__(self) -> None:
        try:
            self.stream_executor.end()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"ProgramState({self.text()})"


class ProgramStateGroup:
    def __init__(self, states: list[ProgramState], src_state: Optional[ProgramState] = None) -> None:
        self.states = states
        self.src_state = src_state

    def join(self, mode: str = "gather_variable") -> None:
        if mode == "gather_variable":
            src = self.src_state.stream_executor
            src_names = set(src.variables)
            for child in self.states:
                exe = child.stream_executor
                exe.sync()
                for name in set(exe.variables) - src_names:
                    gathered = src.variables.setdefault(name, [])
                    gathered.append(exe.variables[name])
                    src.variable_event.setdefault(name, _set_event())
                    src.variable_event[name].set()
        elif mode == "concate_and_append":
            self.src_state += ConcateAndAppend(self.states)
            self.src_state.stream_executor.sync()
        else:
            raise ValueError(f"Invalid join mode: {mode!r} (use 'gather_variable' or 'concate_and_append')")
        for child in self.states:
            child.stream_executor.end()

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        assert self.states[i] is value, "forks can only be updated in place (+=)"

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    def __iadd__(self, other: Union[Callable[[int], Any], SglExpr, str, list, tuple]) -> ProgramStateGroup:
        if callable(other) and not isinstance(other, SglExpr):
            for i, state in enumerate(self.states):
                state += other(i)
        elif isinstance(other, (SglExpr, str)):
            for state in self.states:
                state += other
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"Expected {len(self.states)} expressions, one per fork, got {len(other)}")
            for state, expr in zip(self.states, other):
                state += expr
        else:
            raise ValueError(f"Cannot append {type(other).__name__} to a group of forks")
        return self


def _set_event():
    import threading

    return threading.Event()


def _to_expr(x: Any) -> SglExpr:
    if isinstance(x, SglExpr):
        return x
    if isinstance(x, str):
        return SglConstantText(x)
    raise TypeError(f"Cannot append {type(x).__name__} to a program state (use strings or frontend expressions)")
