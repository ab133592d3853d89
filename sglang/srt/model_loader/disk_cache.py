"""Where this package keeps what it computes once per machine or per file, and how it publishes it safely.

Everything lives under `$SGLANG_CACHE_DIR` (default `~/.cache/sglang-lite`): compiled CPU extensions, GGUF files
converted to Hugging Face directories, extracted packaged models, and the startup GEMM measurement.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """Root of everything this package caches on disk: `$SGLANG_CACHE_DIR`, else `~/.cache/sglang-lite`."""
    configured = os.environ.get("SGLANG_CACHE_DIR")
    root = Path(configured).expanduser() if configured else Path.home() / ".cache" / "sglang-lite"
    return root


def build_cached_dir(target: Path, build: Callable[[Path], None]) -> Path:
    """Return `target`, creating it first with `build(tmp_dir)` when missing.

    A lock file serializes builders of the same target (so concurrent servers do not all spend the conversion
    time and memory), and the rename from a sibling temp dir makes the directory appear complete or not at all.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a+") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            if target.is_dir():  # another process finished it while we waited for the lock
                return target
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
            try:
                build(tmp)
                os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the cache is meant to be readable like any other
                os.rename(tmp, target)
            except OSError:
                if not target.is_dir():
                    raise
                # Someone without the lock (e.g. an older process) published first; theirs is as good as ours.
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)
    return target
