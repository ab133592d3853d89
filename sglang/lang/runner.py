"""Running programs: one state, a batch of states on a thread pool, and prefix tracing for batches."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Union

from sglang.global_config import global_config
from sglang.lang.interpreter import StopTracing, StreamExecutor
from sglang.lang.ir import SglArgument, SglFunction, SglSamplingParams
from sglang.lang.program_state import ProgramState


def run_program(program: SglFunction, backend: Any, func_args: tuple, func_kwargs: dict,
                default_sampling_para: SglSamplingParams, stream: bool, sync: bool = False,
                use_thread: bool = True) -> ProgramState:
    executor = StreamExecutor(backend, func_kwargs, default_sampling_para, chat_template=None, stream=stream,
                              use_thread=use_thread)
    state = ProgramState(executor)
    if stream:
        # The body runs in the background so the caller can iterate the text while it is produced.
        threading.Thread(target=_run_internal, args=(state, program, func_args, func_kwargs, sync),
                         daemon=True).start()
        return state
    return _run_internal(state, program, func_args, func_kwargs, sync)


def _run_internal(state: ProgramState, program: SglFunction, func_args: tuple, func_kwargs: dict,
                  sync: bool) -> ProgramState:
    try:
        state.ret_value = program.func(state, *func_args, **func_kwargs)
    finally:
        state.stream_executor.end()
    if sync:
        state.stream_executor.sync()
    if global_config.verbosity >= 2:
        print(state.text())
    return state


def _num_threads(num_threads: Union[str, int], batch_size: int) -> int:
    if num_threads == "auto":
        num_threads = max(96, (os.cpu_count() or 1) * 16)
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be a positive int or 'auto', got {num_threads!r}")
    return max(1, min(num_threads, batch_size))


def run_program_batch(program: SglFunction, backend: Any, batch_arguments: list[dict],
                      default_sampling_para: SglSamplingParams, num_threads: Union[str, int],
                      progress_bar: bool, generator_style: bool = False):
    if len(batch_arguments) > 1:
        cache_program(program, backend)
    num_threads = _num_threads(num_threads, len(batch_arguments))
    if generator_style:
        return _run_batch_generator(program, backend, batch_arguments, default_sampling_para, num_threads,
                                    progress_bar)
    pbar = _progress(len(batch_arguments)) if progress_bar else None
    try:
        with ThreadPoolExecutor(num_threads) as pool:
            futures = []
            for arguments in batch_arguments:
                future = pool.submit(run_program, program, backend, (), arguments, default_sampling_para,
                                     False, True)
                if pbar is not None:
                    future.add_done_callback(lambda _: pbar.update())
                futures.append(future)
            return [f.result() for f in futures]
    finally:
        if pbar is not None:
            pbar.close()


def _run_batch_generator(program, backend, batch_arguments, default_sampling_para, num_threads,
                         progress_bar) -> Iterator[ProgramState]:
    pbar = _progress(len(batch_arguments)) if progress_bar else None
    try:
        with ThreadPoolExecutor(num_threads) as pool:
            futures = [pool.submit(run_program, program, backend, (), arguments, default_sampling_para, False, True)
                       for arguments in batch_arguments]
            for future in futures:
                yield future.result()
                if pbar is not None:
                    pbar.update()
    finally:
        if pbar is not None:
            pbar.close()


def _progress(total: int):
    import tqdm

    return tqdm.tqdm(total=total)


# ---- tracing ------------------------------------------------------------------------------------------
class _TracingArgument(SglArgument):
    """An argument placeholder: any use of its value ends tracing."""

    def __str__(self) -> str:
        raise StopTracing()

    def __format__(self, spec: str) -> str:
        raise StopTracing()

    def __getattr__(self, name: str) -> Any:
        raise StopTracing()


def trace_program(program: SglFunction, arguments: dict, backend: Optional[Any]) -> ProgramState:
    """Run the program without a model until it needs an argument or a generation."""
    from sglang.lang.backend.base_backend import BaseBackend

    backend = backend or global_config.default_backend or BaseBackend()
    from sglang.lang.backend.base_backend import as_backend

    backend = as_backend(backend)
    kwargs = {name: _TracingArgument(name) for name in program.arg_names}
    kwargs.update(program.bind_arguments)
    kwargs.update(arguments)
    executor = StreamExecutor(backend, kwargs, SglSamplingParams(), chat_template=None, stream=False,
                              tracing=True)
    state = ProgramState(executor)
    try:
        program.func(state, **kwargs)
    except StopTracing:
        pass
    except Exception:  # noqa: BLE001 - any other use of a placeholder also ends the constant prefix
        pass
    return state


def extract_prefix_by_tracing(program: SglFunction, backend: Any) -> str:
    return trace_program(program, {}, backend).stream_executor.text_


def cache_program(program: SglFunction, backend: Any) -> None:
    prefix = extract_prefix_by_tracing(program, backend)
    if prefix and len(prefix) > global_config.min_cache_prefix_chars:
        backend.cache_prefix(prefix)
