"""The interface every frontend backend implements."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

from sglang.lang.chat_template import ChatTemplate, get_chat_template


class BaseBackend:
    """A model the interpreter talks to: text generation, choice scoring, prefix caching."""

    def __init__(self) -> None:
        self.support_concate_and_append = False
        self.chat_template: ChatTemplate = get_chat_template("default")

    def get_model_name(self) -> str:
        raise NotImplementedError()

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def cache_prefix(self, prefix_str: str) -> None:
        """Make the backend keep `prefix_str` in its prefix cache (a no-op where there is none)."""

    def commit_lazy_operations(self, s: Any) -> None:
        """Send the state's text so far, so that forks of it share the cached prefix."""

    def fill_image(self, s: Any) -> None:
        pass

    def uncache_prefix(self, rid: str) -> None:
        pass

    def end_request(self, rid: Any) -> None:
        pass

    def begin_program(self, s: Any) -> None:
        pass

    def end_program(self, s: Any) -> None:
        pass

    def generate(self, s: Any, sampling_params: Any) -> tuple[Any, dict]:
        raise NotImplementedError()

    def generate_stream(self, s: Any, sampling_params: Any) -> Iterator[tuple[str, dict]]:
        raise NotImplementedError()

    def select(self, s: Any, choices: list[str], temperature: float, choices_method: Any) -> Any:
        raise NotImplementedError()

    def concatenate_and_append(self, src_rids: list[str], dst_rid: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support join(mode='concate_and_append')")

    def shutdown(self) -> None:
        pass

    def flush_cache(self) -> Any:
        pass

    def get_server_info(self) -> Optional[dict]:
        return None


def as_backend(obj: Any) -> BaseBackend:
    """Accept a backend, a `Runtime` (its endpoint) or an in-process `sglang.Engine`."""
    if isinstance(obj, BaseBackend):
        return obj
    endpoint = getattr(obj, "endpoint", None)
    if isinstance(endpoint, BaseBackend):
        return endpoint
    if type(obj).__name__ == "Engine" and hasattr(obj, "tokenizer_manager"):
        from sglang.lang.backend.engine_backend import EngineBackend

        return EngineBackend.for_engine(obj)
    raise TypeError(f"Not a frontend backend: {type(obj).__name__}")
