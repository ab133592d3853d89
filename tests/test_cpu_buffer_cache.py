"""The CPU allocator that keeps large freed buffers for reuse (layers/cpu_buffers.py, csrc/buffer_cache.h): which
blocks it keeps and hands out, its cap, that a reused block is written without page faults, and the setting."""

from __future__ import annotations

import resource

import pytest
import torch

from sglang.srt.layers import cpu_buffers, cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the CPU extension is not built")

MIB = 1 << 20


@pytest.fixture
def cache():
    """The allocator installed with a 256 MiB cap and 8 MiB blocks; the process's setting restored after."""
    before = cpu_ops.buffer_cache_stats()[4]
    cpu_ops.configure_buffer_cache(0, cpu_buffers.MIN_BYTES)  # start with nothing kept
    cpu_ops.configure_buffer_cache(256 * MIB, cpu_buffers.MIN_BYTES)
    yield
    cpu_ops.configure_buffer_cache(before, cpu_buffers.MIN_BYTES)


def block(mib: int) -> torch.Tensor:
    return torch.empty(mib * MIB, dtype=torch.uint8)


def kept() -> tuple[int, int]:
    stats = cpu_ops.buffer_cache_stats()
    return stats[0], stats[1]


def test_a_freed_large_block_serves_the_next_request_of_at_least_half_its_size(cache):
    first = block(64)
    address = first.data_ptr()
    del first
    assert kept() == (64 * MIB, 1)
    again = block(40)  # 40 MiB fits the 64 MiB block, and is more than half of it
    assert again.data_ptr() == address and kept() == (0, 0)
    again.fill_(7)
    assert int(again[-1]) == 7  # the whole request is usable
    del again
    small = block(20)  # less than half: a fresh block, the 64 MiB one stays kept
    assert small.data_ptr() != address and kept() == (64 * MIB, 1)
    del small
    assert kept() == (84 * MIB, 2)
    larger = block(65)  # larger than every kept block
    assert larger.data_ptr() != address
    del larger


def test_the_best_fitting_block_is_taken(cache):
    a, b = block(100), block(60)
    address_b = b.data_ptr()
    del a, b
    c = block(50)  # both fit; the 60 MiB block wastes less
    assert c.data_ptr() == address_b
    del c


def test_what_is_kept_stays_within_the_cap(cache):
    cpu_ops.configure_buffer_cache(100 * MIB, cpu_buffers.MIN_BYTES)
    a, b = block(60), block(50)
    address_b = b.data_ptr()
    del a  # kept
    del b  # kept, and the least recently freed (a) is handed back to stay within 100 MiB
    assert kept() == (50 * MIB, 1)
    c = block(50)
    assert c.data_ptr() == address_b
    del c
    too_large = block(101)  # larger than the cap: handed back when freed
    del too_large
    assert kept() == (50 * MIB, 1)
    cpu_ops.configure_buffer_cache(0, cpu_buffers.MIN_BYTES)  # cap 0 hands back everything kept at once
    assert kept() == (0, 0)


def test_small_blocks_stay_with_torchs_allocator(cache):
    before = cpu_ops.buffer_cache_stats()
    x = torch.randn(256, 256)
    y = (x @ x.t()).bfloat16() @ x.bfloat16()  # small blocks, some through raw_allocate in the GEMM libraries
    del x, y
    after = cpu_ops.buffer_cache_stats()
    assert after[:4] == before[:4]


def test_a_reused_block_is_written_without_page_faults(cache):
    first = block(64)
    first.fill_(1)
    del first
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    again = block(64)
    again.fill_(2)
    # a fresh 64 MiB block takes 16,384 faults of 4 KB pages (32 in huge pages); a kept one none
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults < 32
    assert int(again.sum()) == 2 * 64 * MIB
    del again


def test_results_through_kept_blocks_are_the_same(cache):
    torch.manual_seed(0)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    expected = a @ b
    reused = cpu_ops.buffer_cache_stats()[2]
    for _ in range(3):  # the 16 MiB products after the first come from the block the one before freed
        assert torch.equal(a @ b, expected)
    assert cpu_ops.buffer_cache_stats()[2] - reused == 2


@pytest.mark.parametrize("value, expected", [(None, cpu_buffers.CAP_BYTES), ("", cpu_buffers.CAP_BYTES),
                                             ("0", 0), ("512", 512 * MIB)])
def test_the_cap_setting(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(cpu_buffers.ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_buffers.ENV, value)
    assert cpu_buffers.cap_bytes() == expected


@pytest.mark.parametrize("value", ["-1", "1.5", "lots"])
def test_a_bad_cap_setting_is_refused(monkeypatch, value):
    monkeypatch.setenv(cpu_buffers.ENV, value)
    with pytest.raises(ValueError, match=cpu_buffers.ENV):
        cpu_buffers.cap_bytes()


def test_the_runner_says_what_it_keeps(monkeypatch, cache):
    monkeypatch.setenv(cpu_buffers.ENV, "300")
    line = cpu_buffers.reuse_large_buffers()
    assert "up to 0.29 GiB" in line and cpu_ops.buffer_cache_stats()[4] == 300 * MIB
    monkeypatch.setenv(cpu_buffers.ENV, "0")
    assert "go back to the system" in cpu_buffers.reuse_large_buffers()
    assert cpu_ops.buffer_cache_stats()[4] == 0
