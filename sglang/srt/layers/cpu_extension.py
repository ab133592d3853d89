"""Build-once C++ extensions for CPU kernels, compiled with torch's JIT loader on first use.

Each extension is compiled into `$SGLANG_CACHE_DIR/torch_extensions` (default `~/.cache/sglang-lite/...`), one
build per source, torch version, Python ABI, machine and compiler flags, under a file lock so that concurrent
processes build it once. Any problem (no compiler, no ninja, a failed build, the extension's disable variable
set) makes `available()` False with one logged warning; callers then use their plain torch path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from sglang.srt.model_loader.disk_cache import cache_root
from sglang.srt.model_loader.dtype import read_cpu_flags

logger = logging.getLogger(__name__)


PORTABLE_ENV = "SGLANG_CPU_KERNELS_PORTABLE"
# The torch headers every extension source includes (csrc/torch_binding.h).
BINDING_HEADER = Path(__file__).resolve().parent / "csrc" / "torch_binding.h"


def isa_flags() -> list[str]:
    """Compiler flags for the SIMD paths: only when this CPU has AVX2, FMA and F16C (otherwise scalar code, which
    SGLANG_CPU_KERNELS_PORTABLE=1 also asks for: the tests build it that way to check it on any machine)."""
    portable = os.environ.get(PORTABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    if not portable and {"avx2", "fma", "f16c"} <= read_cpu_flags():
        return ["-mavx2", "-mfma", "-mf16c"]
    return []


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")


class CpuExtension:
    """One C++ source (and the headers it includes) compiled into one Python module, loaded lazily and at most
    once per process."""

    def __init__(self, prefix: str, source: Path, label: str, disable_env: str,
                 headers: Sequence[Path] = ()) -> None:
        self.prefix = prefix
        self.source = Path(source)
        self.headers = [BINDING_HEADER, *(Path(h) for h in headers)]
        self.label = label
        self.disable_env = disable_env
        self._lock = threading.Lock()
        self._module: Any = None
        self._error: str | None = None
        self._attempted = False
        self._disabled_logged = False

    def _build_spec(self, openmp: bool) -> tuple[str, Path, list[str], list[str]]:
        """(module name, build directory, cflags, ldflags); the name hashes everything the binary depends on."""
        cflags = ["-O3", *isa_flags()]
        ldflags: list[str] = []
        if openmp:
            # at::parallel_for only runs in parallel when the extension itself is compiled with OpenMP; at run time
            # the libgomp already loaded by torch is shared (same soname), so there is one thread pool.
            cflags.append("-fopenmp")
            ldflags.append("-fopenmp")
        key = hashlib.sha256()
        for part in (
            self.source.read_bytes(),
            *(h.read_bytes() for h in self.headers),
            torch.__version__.encode(),
            sys.implementation.cache_tag.encode(),
            platform.machine().encode(),
            " ".join(cflags + ldflags).encode(),
        ):
            key.update(part)
            key.update(b"\0")
        name = f"{self.prefix}_{key.hexdigest()[:16]}"
        return name, cache_root() / "torch_extensions" / name, cflags, ldflags

    def _import_built(self, name: str, build_dir: Path) -> Any:
        """The already built module, or None (missing or unloadable, e.g. left half-written by a killed build)."""
        path = build_dir / f"{name}.so"
        if not path.is_file():
            return None
        try:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        except (ImportError, OSError) as err:
            logger.info("Rebuilding the %s: %s could not be loaded (%s)", self.label, path, err)
            return None

    def _build(self, openmp: bool) -> Any:
        name, build_dir, cflags, ldflags = self._build_spec(openmp)
        build_dir.mkdir(parents=True, exist_ok=True)
        # An OS-level lock (released if the holder dies) serialises builders across processes. torch's own "lock"
        # file baton inside the build directory is not released by a crashed builder, so one found while we hold
        # our lock is stale and removed.
        lock_file = None
        try:
            import fcntl

            lock_file = open(build_dir.parent / f".{name}.lock", "a+")
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
        except ImportError:  # no fcntl (Windows): rely on torch's baton alone
            pass
        try:
            module = self._import_built(name, build_dir)
            if module is not None:
                return module
            if compiler() is None:
                raise RuntimeError("no C++ compiler found (set CXX or install g++)")
            import torch.utils.cpp_extension as cpp_ext

            if not cpp_ext.is_ninja_available():
                raise RuntimeError("ninja is not available")
            logger.info("Compiling the %s into %s (once per torch version and CPU flags)", self.label, build_dir)
            return cpp_ext.load(
                name=name,
                sources=[str(self.source)],
                extra_include_paths=sorted({str(h.parent) for h in self.headers}),
                extra_cflags=cflags,
                extra_ldflags=ldflags,
                build_directory=str(build_dir),
                verbose=False,
            )
        finally:
            if lock_file is not None:
                lock_file.close()  # releases the flock

    def _load(self) -> Any:
        if self._attempted:
            return self._module
        with self._lock:
            if self._attempted:
                return self._module
            try:
                for path in (self.source, *self.headers):
                    if not path.is_file():
                        raise RuntimeError(f"kernel source {path} is missing")
                try:
                    self._module = self._build(openmp=True)
                except Exception as err:  # noqa: BLE001 - retry without OpenMP, e.g. a compiler without libgomp
                    if "no C++ compiler" in str(err) or "ninja" in str(err):
                        raise
                    logger.info("Building the %s with OpenMP failed (%s); retrying single-threaded", self.label, err)
                    self._module = self._build(openmp=False)
            except Exception as err:  # noqa: BLE001 - any build/import problem means "use the torch path"
                self._error = f"{type(err).__name__}: {err}"
                self._module = None
                logger.warning("%s unavailable, falling back to plain torch: %s", self.label, self._error)
            self._attempted = True
            return self._module

    def _disabled(self) -> bool:
        if os.environ.get(self.disable_env, "").strip().lower() not in ("1", "true", "yes", "on"):
            return False
        if not self._disabled_logged:
            self._disabled_logged = True
            logger.warning("%s disabled by %s", self.label, self.disable_env)
        return True

    def available(self) -> bool:
        """Whether the extension can be used (builds it on the first call)."""
        return not self._disabled() and self._load() is not None

    def unavailable_reason(self) -> str | None:
        if self._disabled():
            return f"{self.disable_env} is set"
        self._load()
        return self._error

    def module(self) -> Any:
        """The loaded module, or None when unavailable."""
        return self._load() if self.available() else None
