"""`EngineBackend`: the frontend backend over an in-process `sglang.Engine` (no HTTP)."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Optional, Union

from sglang.global_config import global_config
from sglang.lang.backend.native_backend import NativeBackend
from sglang.lang.chat_template import get_chat_template, get_chat_template_by_model_path

# One backend per engine, so every program on it shares one event-loop thread.
_BY_ENGINE: weakref.WeakKeyDictionary[Any, EngineBackend] = weakref.WeakKeyDictionary()
_BY_ENGINE_LOCK = threading.Lock()


class EngineBackend(NativeBackend):
    """Program states run on many threads; the engine's requests all run on one event loop of our own,
    where the engine's tokenizer manager receives the results."""

    def __init__(self, engine: Any = None, chat_template_name: Optional[str] = None, **server_args: Any) -> None:
        super().__init__()
        if engine is None:
            from sglang.srt.entrypoints.engine import Engine

            engine = Engine(**server_args)
            self._owns_engine = True
        else:
            self._owns_engine = False
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="sglang-engine-backend", daemon=True)
        self._thread.start()
        model_path = engine.server_args.model_path
        if chat_template_name:
            self.chat_template = get_chat_template(chat_template_name)
        else:
            self.chat_template = get_chat_template_by_model_path(model_path)

    @classmethod
    def for_engine(cls, engine: Any) -> EngineBackend:
        with _BY_ENGINE_LOCK:
            backend = _BY_ENGINE.get(engine)
            if backend is None:
                backend = _BY_ENGINE[engine] = cls(engine)
            return backend

    def get_model_name(self) -> str:
        return self.engine.server_args.model_path

    def _run(self, coro: Any) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout=global_config.request_timeout)

    @staticmethod
    def _engine_kwargs(body: dict) -> dict:
        kwargs = dict(body)
        if "text" in kwargs:
            kwargs["prompt"] = kwargs.pop("text")
        return kwargs

    def _generate_raw(self, body: dict) -> Union[dict, list]:
        self.engine._check_alive()
        return self._run(self.engine.async_generate(**self._engine_kwargs(body)))

    def _generate_stream_raw(self, body: dict) -> Iterator[dict]:
        self.engine._check_alive()
        kwargs = self._engine_kwargs(body)

        async def open_stream():
            return await self.engine.async_generate(**kwargs)

        agen = self._run(open_stream())
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(agen.aclose())

    def flush_cache(self) -> Any:
        return self._run(self.engine.tokenizer_manager.flush_cache())

    def get_server_info(self) -> dict:
        from sglang.srt.entrypoints.engine import engine_server_info

        # The engine's coroutines run on this backend's loop thread, so its own get_server_info cannot be used.
        states = self._run(self.engine.tokenizer_manager.get_internal_states())
        return engine_server_info(self.engine.server_args, states)

    def shutdown(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if self._owns_engine:
            self.engine.shutdown()
