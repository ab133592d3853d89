"""The compiled packer (csrc/gguf_pack.h): GGUF Q4_0 / Q4_1 / Q8_0 blocks as stored, stacked along N, written straight
into the kernels' row groups, bit for bit what the torch re-layout makes of the same rows (Q4_0 after its exact
conversion to Q4_1); and the file's pages dropped from the process once packed."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from sglang.srt.layers.quantization import gguf_blocks as gb
from sglang.srt.model_loader.gguf_reader import mapped_page_dropper, q4_0_as_q4_1, read_gguf_block_tensors

pytestmark = pytest.mark.skipif(not gb.kernels_available(),
                                reason=f"GGUF kernels unavailable: {gb.kernels_unavailable_reason()}")

STORED_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def stored(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random bytes as stored blocks [n, k / 32 * block bytes] (every byte pattern is a valid block to re-lay)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, k // 32 * STORED_BYTES[qtype]), dtype=np.uint8)


def torch_packed(target: str, parts: list[tuple[str, np.ndarray]], k: int) -> torch.Tensor:
    with np.errstate(over="ignore", invalid="ignore"):  # random scales: -8 d overflows fp16, NaN scales stay NaN
        raws = [q4_0_as_q4_1(raw) if qtype == "Q4_0" else raw for qtype, raw in parts]
    stacked = torch.from_numpy(np.concatenate(raws))
    return gb.pack_raw_torch(target, stacked, stacked.shape[0], k)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("n,k", [(1, 32), (16, 64), (17, 96), (40, 128), (203, 576)])
def test_one_matrix_packs_as_the_torch_relayout(qtype, n, k):
    raw = stored(qtype, n, k, seed=n * 31 + k)
    target = gb.PACKED_FROM[qtype][1]
    packed = gb.pack_stored(target, [(qtype, torch.from_numpy(raw))], k)
    assert packed is not None
    assert torch.equal(packed, torch_packed(target, [(qtype, raw)], k))
    if qtype != "Q4_0":  # pack_raw itself takes the compiled path
        assert torch.equal(gb.pack_raw(qtype, raw, n, k), packed)
        assert torch.equal(gb.GGUFQuantWeight(qtype, raw, n, k).raw(), torch.from_numpy(raw))


def test_stacked_parts_of_mixed_q4_types_pack_as_their_concatenation():
    k = 160
    parts = [("Q4_0", stored("Q4_0", 21, k, 1)), ("Q4_1", stored("Q4_1", 5, k, 2)), ("Q4_0", stored("Q4_0", 16, k, 3))]
    packed = gb.pack_stored("Q4_1", [(q, torch.from_numpy(r)) for q, r in parts], k)
    assert packed is not None
    assert torch.equal(packed, torch_packed("Q4_1", parts, k))
    q8 = [("Q8_0", stored("Q8_0", 7, k, 4)), ("Q8_0", stored("Q8_0", 9, k, 5))]
    packed = gb.pack_stored("Q8_0", [(q, torch.from_numpy(r)) for q, r in q8], k)
    assert packed is not None
    assert torch.equal(packed, torch_packed("Q8_0", q8, k))


def test_every_fp16_scale_of_q4_0_gets_the_numpy_offset():
    """m = fp16(-8 d) for all 65,536 fp16 bit patterns of d: normal, subnormal (rounded), overflowing to infinity,
    infinities and NaNs, as numpy's float16 arithmetic makes them."""
    k = 32
    d = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    raw = np.zeros((d.size, 18), dtype=np.uint8)
    raw[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    raw[:, 2:] = np.random.default_rng(0).integers(0, 256, (d.size, 16), dtype=np.uint8)
    expected = torch_packed("Q4_1", [("Q4_0", raw)], k)
    packed = gb.pack_stored("Q4_1", [("Q4_0", torch.from_numpy(raw))], k)
    assert packed is not None
    assert torch.equal(packed, expected)


def test_strided_rows_are_read_in_place():
    """A view of rows with a stride (e.g. every other row of a file's matrix) packs as its copy."""
    k = 64
    raw = torch.from_numpy(stored("Q8_0", 34, k, 7))
    view = raw[::2]
    packed = gb.pack_stored("Q8_0", [("Q8_0", view)], k)
    assert packed is not None
    assert torch.equal(packed, gb.pack_raw_torch("Q8_0", view.contiguous(), view.shape[0], k))


def test_types_not_packed_as_the_target_are_left_to_the_converters():
    k = 64
    q4 = torch.from_numpy(stored("Q4_1", 4, k, 0))
    assert gb.pack_stored("Q8_0", [("Q4_1", q4)], k) is None
    assert gb.pack_stored("Q4_1", [("Q5_0", q4)], k) is None
    assert gb.pack_stored("Q4_1", [], k) is None


def test_bad_parts_are_refused():
    ext = gb.kernel_module()
    q4 = torch.from_numpy(stored("Q4_1", 4, 64, 0))
    with pytest.raises(RuntimeError, match="uint8 CPU matrix"):
        ext.pack_blocks([q4[:, :30]], [3], True, 64)  # rows shorter than K / 32 blocks
    with pytest.raises(RuntimeError, match="not packed as Q8_0"):
        ext.pack_blocks([q4], [3], False, 64)
    with pytest.raises(RuntimeError, match="one type per part"):
        ext.pack_blocks([q4], [3, 3], True, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ext.pack_blocks([q4], [3], True, 48)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_rows_read_back_from_the_packed_blocks(monkeypatch, kernels, qtype):
    """dequantize_rows reads a run of rows from the row groups, with the kernels or without (unpacking only the
    groups that hold them); the values are the reference dequantizer's."""
    if not kernels:
        monkeypatch.setattr(gb, "kernel_module", lambda: None)
    k = 96
    raw = stored(qtype, 45, k, 9)
    scales = [0.01, -0.08] if qtype == "Q4_1" else [0.01]  # finite fp16 d (and m)
    raw.reshape(45, -1, STORED_BYTES[qtype])[..., : 2 * len(scales)] = np.frombuffer(
        np.float16(scales).tobytes(), dtype=np.uint8)
    w = gb.GGUFQuantWeight(qtype, raw, 45, k)
    whole = gb.dequantize_raw(qtype, torch.from_numpy(raw), 45, k)
    assert torch.equal(w.dequantize(), whole)
    assert torch.equal(w.dequantize_rows(16, 29), whole[16:])
    assert torch.equal(w.dequantize_rows(16, 5), whole[16:21])
    assert torch.equal(w.dequantize_rows(0, 45), whole)
    assert torch.equal(w.dequantize_rows(32, 0), whole[:0])
    for start, count in ((8, 4), (16, 30), (-16, 4)):
        with pytest.raises(ValueError, match="run of rows"):
            w.dequantize_rows(start, count)


def _mapped_rss_kb(path: str) -> int:
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0] and line.count(" ") >= 5:  # a mapping's header line
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps")
def test_packed_tensors_leave_the_mapped_file_and_copies_stay(tmp_path):
    """mapped_page_dropper drops the file's pages of a tensor from the process (they read the same again, from the
    file), and does nothing to memory outside the mapping (a copy keeps its bytes)."""
    import gguf

    path = str(tmp_path / "blocks.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    rng = np.random.default_rng(0)
    for i in range(2):
        raw = rng.integers(0, 256, (512, 4096 // 32 * 34), dtype=np.uint8)  # 2.2 MB of Q8_0 blocks each
        writer.add_tensor(f"t{i}", raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    tensors = read_gguf_block_tensors(path)
    drop = mapped_page_dropper(tensors)
    first, second = tensors["t0"][1], tensors["t1"][1]
    expected = first.copy()
    assert int(first.sum()) + int(second.sum()) > 0  # both read: their pages are mapped in
    before = _mapped_rss_kb(os.path.realpath(path))
    assert before >= 2 * first.nbytes // 1024 - 8
    drop(first.ctypes.data, first.nbytes)
    assert _mapped_rss_kb(os.path.realpath(path)) <= before - first.nbytes // 1024 + 8
    assert np.array_equal(first, expected)  # read again from the file
    drop(expected.ctypes.data, expected.nbytes)  # not in the mapping: left alone
    assert np.array_equal(expected, np.asarray(read_gguf_block_tensors(path)["t0"][1]))
