"""SGLang-compatible serving engine and frontend language."""

from sglang.global_config import global_config  # noqa: F401 - the object, not the module of that name
from sglang.version import __version__

# Public names and the module that defines each. They load on first use, so `import sglang` stays light
# (no torch for frontend-only users, no HTTP client for engine-only users).
_LAZY = {
    "Engine": "sglang.srt.entrypoints.engine",
    "ServerArgs": "sglang.srt.server_args",
    "RuntimeEndpoint": "sglang.lang.backend.runtime_endpoint",
    "Runtime": "sglang.lang.backend.runtime",
    "OpenAI": "sglang.lang.backend.openai",
    "token_length_normalized": "sglang.lang.choices",
    "greedy_token_selection": "sglang.lang.choices",
    "unconditional_likelihood_normalized": "sglang.lang.choices",
    **{
        name: "sglang.lang.api"
        for name in (
            "function", "gen", "gen_int", "gen_string", "select", "image", "video", "separate_reasoning",
            "system", "user", "assistant", "system_begin", "system_end", "user_begin", "user_end",
            "assistant_begin", "assistant_end", "set_default_backend", "flush_cache", "get_server_info",
        )
    },
}

__all__ = ["__version__", "global_config", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sglang' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
