"""Where a C++ compiler and ninja are present, every compiled CPU extension builds.

The kernels' tests skip where their extension is unavailable (no toolchain), so without this a source that stops
compiling would turn them all into skips and leave the suite green.
"""

from __future__ import annotations

import pytest

from sglang.srt.layers import cpu_extension, cpu_ops
from sglang.srt.layers.quantization import gguf_blocks
from sglang.srt.model_executor import fused_cpu_decode

EXTENSIONS = {
    "CPU decode kernels (cpu_ops.cpp)": cpu_ops._EXTENSION,
    "GGUF kernels (gguf_linear.cpp)": gguf_blocks._EXTENSION,
    "fused decode step (decode_stack.cpp)": fused_cpu_decode._EXTENSION,
}


@pytest.mark.parametrize("name", sorted(EXTENSIONS))
def test_extension_builds_where_a_toolchain_is_present(name, monkeypatch):
    import torch.utils.cpp_extension as cpp_ext

    if cpu_extension.compiler() is None or not cpp_ext.is_ninja_available():
        pytest.skip("no C++ compiler or ninja on this machine")
    extension = EXTENSIONS[name]
    monkeypatch.delenv(extension.disable_env, raising=False)
    assert extension.available(), f"{name}: {extension.unavailable_reason()}"


def test_build_extensions_lists_every_extension():
    import importlib

    from sglang.srt.layers.build_extensions import EXTENSIONS as BUILT

    assert {id(importlib.import_module(m)._EXTENSION) for m in BUILT.values()} == {id(e) for e in EXTENSIONS.values()}


def test_build_extensions_command_builds_all_and_reports_failures_without_failing():
    import subprocess
    import sys

    import torch.utils.cpp_extension as cpp_ext

    from sglang.srt.layers.build_extensions import finish_build, start_build

    if cpu_extension.compiler() is None or not cpp_ext.is_ninja_available():
        pytest.skip("no C++ compiler or ninja on this machine")
    proc = subprocess.run([sys.executable, "-m", "sglang.srt.layers.build_extensions"], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("CPU extension ")]
    assert len(lines) == 3 and all(": ready (" in line for line in lines), proc.stdout
    missing = finish_build("missing", start_build("sglang.no_such_module", {}))
    assert not missing.ok and "No module named 'sglang.no_such_module'" in missing.reason
