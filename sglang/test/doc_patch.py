"""Defaults for running the documentation notebooks on small machines (imported by notebook 004)."""

from __future__ import annotations

from sglang.srt.server_args import ServerArgs
from sglang.utils import launch_server_cmd as _launch_server_cmd

DOC_DEFAULTS = {"max_running_requests": 128, "max_total_tokens": 20480, "cuda_graph_max_bs": 4}

_original_post_init = ServerArgs.__post_init__


def _patched_post_init(self: ServerArgs) -> None:
    for key, value in DOC_DEFAULTS.items():
        if getattr(self, key) is None:
            setattr(self, key, value)
    _original_post_init(self)


ServerArgs.__post_init__ = _patched_post_init  # type: ignore[method-assign]

try:  # notebooks run inside an event loop
    import nest_asyncio

    nest_asyncio.apply()
except ImportError:
    pass


def launch_server_cmd(command: str, host: str = "0.0.0.0", port: int | None = None):
    extra = " --max-running-requests 128 --max-total-tokens 20480 --cuda-graph-max-bs 4"
    return _launch_server_cmd(command + extra, host=host, port=port)
