"""Process-wide settings of the frontend language."""

from __future__ import annotations

from typing import Any, Optional


class GlobalConfig:
    def __init__(self) -> None:
        self.verbosity = 0
        self.default_backend: Optional[Any] = None
        # A constant program prefix shorter than this is not worth a separate cache request.
        self.min_cache_prefix_chars = 64
        # Seconds a frontend HTTP request may take before it fails instead of hanging.
        self.request_timeout = 600.0


global_config = GlobalConfig()
