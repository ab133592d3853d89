"""The GGUF kernels and the fused decode step compiled without AVX2 (as on a CPU that lacks it) pass the same
kernel tests as the native build: the GGUF and fused-step test modules run again in a fresh process with
SGLANG_CPU_KERNELS_PORTABLE=1, which builds every extension from its portable code only. (The attention and
element-wise kernels' portable build: test_extend_attention.test_portable_build_without_simd.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sglang.srt.layers.build_extensions import build_env

ROOT = Path(__file__).resolve().parent.parent

# The kernel-level tests; those that load the whole packaged model check the loader more than the kernels and
# already run natively.
MODULES = ["tests/test_gguf_kernels.py", "tests/test_fused_decode.py"]
SKIP = "not model_runner and not tensor_table"

CHECK_BUILD = """
from sglang.srt.layers.quantization import gguf_blocks
from sglang.srt.model_executor import fused_cpu_decode
assert fused_cpu_decode.available(), fused_cpu_decode.unavailable_reason()
assert not gguf_blocks.kernel_module().has_avx2_path()
print("portable build")
"""


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=build_env(portable=True), cwd=ROOT,
                          capture_output=True, text=True, timeout=900)


def test_gguf_kernels_and_fused_step_without_simd():
    built = _run(["-c", CHECK_BUILD])
    assert built.returncode == 0 and "portable build" in built.stdout, built.stderr[-3000:]
    proc = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", *MODULES, "-k", SKIP])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary
