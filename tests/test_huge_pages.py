"""Large CPU tensors in 2 MB pages: `import sglang` asks PyTorch's allocator for transparent huge pages
(sglang/huge_pages.py) in its own process, unless torch allocated first, and in every process it starts; the
environment can say no. (The server's scheduler holding its weights in huge pages: test_native_server.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sglang import huge_pages

MB = 1 << 20

# Allocates 64 MB with torch after importing sglang, and prints the process's anonymous bytes in huge pages.
PROBE = ("import sglang, torch; from sglang.huge_pages import anon_huge_bytes; "
         "x = torch.ones(16 * 2**20); print(anon_huge_bytes())")


def probe(env_value: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != huge_pages.ENV}
    if env_value is not None:
        env[huge_pages.ENV] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_kernel_mode_reads_the_bracketed_choice(tmp_path):
    for text, mode in [("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
                       ("always madvise [never]\n", "never"), ("", None)]:
        (tmp_path / "enabled").write_text(text)
        assert huge_pages.kernel_mode(str(tmp_path / "enabled")) == mode
    assert huge_pages.kernel_mode(str(tmp_path / "missing")) is None


def test_import_sets_the_allocator_variable_unless_given():
    assert os.environ.get(huge_pages.ENV) is not None  # this process imported sglang
    code = f"import os, sglang; print(os.environ.get({huge_pages.ENV!r}))"
    for given, expected in [(None, "1"), ("0", "0")]:
        env = {k: v for k, v in os.environ.items() if k != huge_pages.ENV}
        if given is not None:
            env[huge_pages.ENV] = given
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert out.stdout.split()[-1] == expected


@pytest.mark.skipif(huge_pages.kernel_mode() not in ("madvise", "always"),
                    reason=f"transparent huge pages unavailable here ({huge_pages.kernel_mode()})")
def test_large_torch_tensors_land_in_huge_pages():
    assert probe(None) >= 32 * MB  # of the 64 MB tensor (the pages that straddle its ends may stay 4 KB)


@pytest.mark.skipif(huge_pages.kernel_mode() != "madvise", reason="only the madvise mode leaves the choice to torch")
def test_the_environment_can_keep_4_kb_pages():
    assert probe("0") < 8 * MB
    assert "4 KB pages" in subprocess.run(
        [sys.executable, "-c", "from sglang import huge_pages; print(huge_pages.describe())"],
        env={**os.environ, huge_pages.ENV: "0"}, capture_output=True, text=True, timeout=60).stdout


POOL_PROBE = """
import sglang, torch
from sglang.huge_pages import anon_huge_bytes
from sglang.srt.mem_cache.kv_pool import KVPool
pool = KVPool(32768, 2, 8, 64, torch.bfloat16)  # 2 layers x 8 heads x 4 MB per K or V head-major stretch
for layer in range(2):
    pool.k_buffer[layer][1:17] = 1.0  # one short request's tokens in every head's stretch
    pool.v_buffer[layer][1:17] = 1.0
print(anon_huge_bytes())
"""


@pytest.mark.skipif(huge_pages.kernel_mode() not in ("madvise", "always"),
                    reason=f"transparent huge pages unavailable here ({huge_pages.kernel_mode()})")
def test_kv_pool_stays_in_small_pages():
    # 32 stretches touched: 64 MB resident in 2 MB pages, 32 x 4 KB in small ones
    out = subprocess.run([sys.executable, "-c", POOL_PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) < 8 * MB
