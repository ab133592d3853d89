"""A loaded model's weights in 2 MB pages (sglang/huge_pages.py): held tensors found through the objects modules
hold, moved with their views and values intact, the K/V pool kept in 4 KB pages. (The server's scheduler holding its
weights in huge pages: test_native_server.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from sglang import huge_pages

MB = 1 << 20
HUGE_PAGES = huge_pages.kernel_mode() in ("madvise", "always")


class Method:  # as a linear method holds its blocks: an object with a tensor inside another object
    def __init__(self, blocks: torch.Tensor) -> None:
        self.weight = type("Blocks", (), {})()
        self.weight.packed = blocks


def tiny_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 64))
    model[0].method = Method(torch.randint(-128, 127, (4096, 1024), dtype=torch.int8))
    model[0].rows = model[0].weight[:512]  # a view that must keep sharing the weight's storage
    model[1].tied = model[0].weight  # the same tensor object again
    return model


def test_kernel_mode_reads_the_bracketed_choice(tmp_path):
    for text, mode in [("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
                       ("always madvise [never]\n", "never"), ("", None)]:
        (tmp_path / "enabled").write_text(text)
        assert huge_pages.kernel_mode(str(tmp_path / "enabled")) == mode
    assert huge_pages.kernel_mode(str(tmp_path / "missing")) is None


def test_held_tensors_reach_into_the_objects_modules_hold():
    model = tiny_model()
    held = {id(t) for t in huge_pages.held_tensors(model)}
    for t in (model[0].weight, model[0].bias, model[1].weight, model[0].method.weight.packed, model[0].rows):
        assert id(t) in held


def test_moved_tensors_keep_values_views_and_sharing():
    model = tiny_model()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    blocks = model[0].method.weight.packed.clone()
    old_ptr = model[0].weight.data_ptr()
    moved = huge_pages.move_to_huge_pages(huge_pages.held_tensors(model))
    assert moved >= model[0].weight.nbytes + blocks.nbytes
    assert model[0].weight.data_ptr() != old_ptr
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name
    assert torch.equal(model[0].method.weight.packed, blocks)
    assert model[0].rows.data_ptr() == model[0].weight.data_ptr()  # the view moved with its base
    assert model[1].tied is model[0].weight
    with torch.no_grad():
        model[0].weight[0, 0] = 5.0
    assert model[0].rows[0, 0].item() == 5.0
    assert isinstance(model[0].weight, nn.Parameter)
    x = torch.randn(3, 1024)
    assert model(x).shape == (3, 64)


PROBE = """
import torch, sys
from torch import nn
from sglang import huge_pages
model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])  # 64 MB of float32 weights
print(huge_pages.move_weights(model), file=sys.stderr)
print(huge_pages.anon_huge_bytes())
"""


def probe(env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not HUGE_PAGES, reason=f"transparent huge pages unavailable ({huge_pages.kernel_mode()})")
def test_moved_weights_are_backed_by_huge_pages():
    # of 64 MB: the pages that straddle the ends may stay 4 KB
    assert probe({"THP_MEM_ALLOC_ENABLE": "0", huge_pages.ENV: "1"}) >= 56 * MB


@pytest.mark.skipif(huge_pages.kernel_mode() != "madvise", reason="only the madvise mode leaves the choice to us")
def test_small_models_keep_their_pages_unless_asked(monkeypatch):
    assert probe({"THP_MEM_ALLOC_ENABLE": "0", huge_pages.ENV: ""}) < 8 * MB  # 64 MB of weights: below the bound
    model = nn.Sequential(nn.Linear(1024, 1024))
    monkeypatch.delenv(huge_pages.ENV, raising=False)
    assert huge_pages.move_weights(model).startswith("weights in the allocator's pages (0.00 GB, below 1 GiB")


@pytest.mark.parametrize("env", ["", "0"])
def test_weights_left_in_place_still_hand_back_what_loading_freed(monkeypatch, env):
    """Loading frees a checkpoint's raw blocks and released float copies; a model whose weights stay in the
    allocator's pages hands the heap's free pages back as one whose weights move does."""
    trims: list[bool] = []
    monkeypatch.setattr(huge_pages, "release_free_heap", lambda: trims.append(True))
    if env:
        monkeypatch.setenv(huge_pages.ENV, env)
    else:
        monkeypatch.delenv(huge_pages.ENV, raising=False)
    assert huge_pages.move_weights(nn.Sequential(nn.Linear(1024, 1024))).startswith("weights in the allocator's pages")
    assert trims


@pytest.mark.skipif(huge_pages.kernel_mode() != "madvise", reason="only the madvise mode leaves the choice to us")
def test_the_environment_can_keep_the_allocators_pages():
    assert probe({"THP_MEM_ALLOC_ENABLE": "0", huge_pages.ENV: "0"}) < 8 * MB


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


@pytest.mark.skipif(not HUGE_PAGES, reason=f"transparent huge pages unavailable ({huge_pages.kernel_mode()})")
def test_kv_pool_stays_in_small_pages_where_torch_asks_for_huge_ones():
    # 32 stretches touched: 64 MB resident in 2 MB pages, 32 x 4 KB in small ones
    out = subprocess.run([sys.executable, "-c", POOL_PROBE], env={**os.environ, "THP_MEM_ALLOC_ENABLE": "1"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) < 8 * MB
