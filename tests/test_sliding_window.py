"""Sliding-window attention in the compiled CPU kernels (decode and extend) and the torch fallback, against a torch
reference with transformers' window semantics: the query at position p sees the keys at p - W + 1 .. p."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from sglang.srt.layers import cpu_ops
from sglang.srt.layers.attention.masked import attend, decode_key_mask, extend_mask
from tests.test_extend_attention import make_batch

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ toolchain for the CPU kernels")


def window_mask(prefix: int, extend: int, window: int) -> torch.Tensor:
    """transformers' sliding-window causal mask (masking_utils: kv_idx > q_idx - window, kv_idx <= q_idx)."""
    q_idx = torch.arange(prefix, prefix + extend)[:, None]
    kv_idx = torch.arange(prefix + extend)[None, :]
    return (kv_idx <= q_idx) & (kv_idx > q_idx - window)


def extend_reference(q, k_cache, v_cache, rows, extend_lens, prefix_lens, scale, window):
    out = torch.zeros(q.shape, dtype=torch.float32)
    start = 0
    for b, (ext, pre) in enumerate(zip(extend_lens, prefix_lens)):
        idx = rows[b, : pre + ext]
        keys = k_cache[idx].float().transpose(0, 1).unsqueeze(0)
        values = v_cache[idx].float().transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q[start : start + ext].transpose(0, 1).unsqueeze(0), keys, values,
                                           attn_mask=window_mask(pre, ext, window), scale=scale,
                                           enable_gqa=q.shape[1] != k_cache.shape[1])
        out[start : start + ext] = o[0].transpose(0, 1)
        start += ext
    return out


def run_extend(q, k_cache, v_cache, rows, extend_lens, prefix_lens, scale, window):
    ext = torch.tensor(extend_lens, dtype=torch.int64)
    return cpu_ops.extend_attention(q, k_cache, v_cache, rows, torch.cumsum(ext, 0) - ext, ext,
                                    torch.tensor(prefix_lens, dtype=torch.int64), scale, window)


def decode_batch(heads, kv_heads, dim, lens, seed=0, kv_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    slots, width = 600, max(lens) + 3
    k = torch.randn(slots, kv_heads, dim, generator=gen).to(kv_dtype)
    v = torch.randn(slots, kv_heads, dim, generator=gen).to(kv_dtype)
    q = torch.randn(len(lens), heads, dim, generator=gen)
    idx = torch.randint(0, slots, (len(lens), width), generator=gen)
    return q, k, v, idx, torch.tensor(lens, dtype=torch.int64)


def decode_reference(q, k, v, idx, lens, scale, window):
    outs = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        first = max(0, n - window)  # the new token at position n - 1 sees positions n - window .. n - 1
        sel = idx[b, first:n]
        keys, values = k[sel].float().transpose(0, 1), v[sel].float().transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(
            q[b : b + 1].unsqueeze(2), keys.unsqueeze(0), values.unsqueeze(0), scale=scale,
            enable_gqa=q.shape[1] != k.shape[1])[0, :, 0])
    return torch.stack(outs)


# Windows of one token, inside a 64-key block, exactly a block, across blocks, and longer than every sequence;
# prefixes that start mid-block and tasks of 32 rows whose windows start in different blocks.
EXTEND_CASES = [
    (9, 3, 64, [130, 7, 1, 64], [0, 0, 0, 0]),
    (9, 3, 64, [20, 1, 300, 2], [400, 33, 64, 127]),
    (6, 2, 80, [70, 3], [10, 61]),
    (2, 1, 36, [40, 9], [3, 0]),  # not a multiple of 8 channels: the portable value loop
]


@pytest.mark.parametrize("window", [1, 5, 63, 64, 100, 1000])
@pytest.mark.parametrize("heads,kv_heads,dim,extend_lens,prefix_lens", EXTEND_CASES)
def test_extend_kernel_window(heads, kv_heads, dim, extend_lens, prefix_lens, window):
    q, k, v, rows = make_batch(heads, kv_heads, dim, extend_lens, prefix_lens, seed=dim + window, head_major=True)
    out = run_extend(q, k, v, rows, extend_lens, prefix_lens, dim**-0.5, window)
    expected = extend_reference(q, k, v, rows, extend_lens, prefix_lens, dim**-0.5, window)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("bf16_dots", [True, False])
def test_extend_kernel_window_bf16_kv(bf16_dots):
    """bf16 K/V: a windowed layer converts the rows to float32 (the bf16 dot products have no window)."""
    heads, kv_heads, dim, extend_lens, prefix_lens = 8, 2, 64, [90, 4], [40, 70]
    q, k, v, rows = make_batch(heads, kv_heads, dim, extend_lens, prefix_lens, kv_dtype=torch.bfloat16)
    previous = cpu_ops.set_extend_attention_bf16(bf16_dots)
    try:
        out = run_extend(q, k, v, rows, extend_lens, prefix_lens, dim**-0.5, 17)
    finally:
        cpu_ops.set_extend_attention_bf16(previous)
    expected = extend_reference(q, k, v, rows, extend_lens, prefix_lens, dim**-0.5, 17)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_window_at_least_the_sequence_changes_nothing():
    """A window no shorter than every sequence gives the unwindowed kernels' results bit for bit."""
    extend_lens, prefix_lens = [130, 7], [20, 64]
    q, k, v, rows = make_batch(9, 3, 64, extend_lens, prefix_lens)
    plain = run_extend(q, k, v, rows, extend_lens, prefix_lens, 0.125, 0)
    assert torch.equal(run_extend(q, k, v, rows, extend_lens, prefix_lens, 0.125, 150), plain)
    q, k, v, idx, lens = decode_batch(9, 3, 64, [1, 90, 33])
    plain = cpu_ops.paged_decode_attention(q, k, v, idx, lens, 0.125)
    assert torch.equal(cpu_ops.paged_decode_attention(q, k, v, idx, lens, 0.125, 90), plain)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 4, 33, 64, 200])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (2, 1, 36), (8, 2, 128)])
def test_decode_kernel_window(heads, kv_heads, dim, window, kv_dtype):
    q, k, v, idx, lens = decode_batch(heads, kv_heads, dim, [1, 90, 33, 2, 64, 130], seed=window + dim,
                                      kv_dtype=kv_dtype)
    out = cpu_ops.paged_decode_attention(q, k, v, idx, lens, dim**-0.5, window)
    torch.testing.assert_close(out, decode_reference(q, k, v, idx, lens, dim**-0.5, window), atol=2e-5, rtol=1e-4)


def test_kernels_reject_a_negative_window():
    q, k, v, idx, lens = decode_batch(2, 1, 32, [3])
    with pytest.raises(RuntimeError, match="window"):
        cpu_ops.paged_decode_attention(q, k, v, idx, lens, 1.0, -1)


def test_torch_masks_match_transformers_semantics():
    assert torch.equal(extend_mask(3, 4, 2, torch.device("cpu")), window_mask(3, 4, 2))
    assert torch.equal(extend_mask(0, 5, 0, torch.device("cpu")), window_mask(0, 5, 10**6))
    lens = torch.tensor([1, 4, 6])
    # the new token of a sequence of n tokens sits at position n - 1; padding past n is never seen
    expected = torch.stack([torch.cat([window_mask(n - 1, 1, 3)[0], torch.zeros(6 - n, dtype=torch.bool)])
                            for n in lens.tolist()])
    assert torch.equal(decode_key_mask(lens, 6, 3), expected)


def test_softcapped_attention_matches_eager_reference():
    """attend() with a soft cap follows transformers' eager attention: cap * tanh(s / cap), mask, softmax."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, n, 16, generator=gen) * 4 for h, n in ((4, 7), (2, 7), (2, 7)))
    mask = window_mask(0, 7, 3)
    scale, cap = 0.25, 2.0
    keys, values = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = torch.tanh(q @ keys.transpose(-1, -2) * scale / cap) * cap
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    torch.testing.assert_close(attend(q, k, v, mask, scale, cap), weights @ values, atol=1e-6, rtol=1e-5)
    uncapped = attend(q, k, v, mask, scale, None)
    assert not torch.allclose(uncapped, weights @ values, atol=1e-3)  # the cap is doing something here


PORTABLE_CHECK = """
import torch
from sglang.srt.layers import cpu_ops
from tests.test_extend_attention import make_batch
from tests.test_sliding_window import (EXTEND_CASES, decode_batch, decode_reference, extend_reference,
                                       run_extend)
assert cpu_ops.available()
for heads, kv_heads, dim, extend_lens, prefix_lens in EXTEND_CASES:
    q, k, v, rows = make_batch(heads, kv_heads, dim, extend_lens, prefix_lens, seed=dim)
    for window in (1, 63, 100):
        out = run_extend(q, k, v, rows, extend_lens, prefix_lens, dim ** -0.5, window)
        torch.testing.assert_close(out, extend_reference(q, k, v, rows, extend_lens, prefix_lens, dim ** -0.5,
                                                         window), atol=2e-5, rtol=1e-4)
q, k, v, idx, lens = decode_batch(9, 3, 64, [1, 90, 33, 130])
for window in (1, 33, 200):
    torch.testing.assert_close(cpu_ops.paged_decode_attention(q, k, v, idx, lens, 0.125, window),
                               decode_reference(q, k, v, idx, lens, 0.125, window), atol=2e-5, rtol=1e-4)
print("portable window ok")
"""


def test_portable_build_windows():
    """The kernels compiled without AVX2 apply the window the same way."""
    from sglang.srt.layers.build_extensions import build_env

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", PORTABLE_CHECK], env=build_env(portable=True), cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "portable window ok" in proc.stdout
