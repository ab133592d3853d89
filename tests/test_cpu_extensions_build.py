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
