"""SGLang-compatible serving engine and frontend language."""

from sglang.version import __version__

__all__ = ["Engine", "__version__"]


def __getattr__(name: str):
    # The engine pulls in torch; keep `import sglang` light for frontend-only users.
    if name == "Engine":
        from sglang.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module 'sglang' has no attribute {name!r}")
