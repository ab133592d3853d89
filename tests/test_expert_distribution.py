"""Expert distribution recording: the collectors of each mode, the scheduler's control, the endpoints and dumps."""

from __future__ import annotations

import asyncio
import csv
import os
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import requests
import torch

from sglang.srt.eplb.collectors import (
    PassInfo,
    PerPassCollector,
    PerTokenCollector,
    StatCollector,
    build_collector,
    moe_shape,
)
from sglang.srt.eplb.dump_files import DUMP_DIR_ENV, write_dump
from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
from sglang.srt.forward_batch import ForwardMode
from sglang.srt.managers.expert_record_client import expert_distribution
from sglang.srt.managers.io_struct import ExpertDistributionReq
from sglang.srt.managers.scheduler.expert_record import NO_MODE_MESSAGE, ExpertRecordControl
from sglang.srt.server_args import ServerArgs
from tests.server_fixtures import running_server

START = "Start recording the expert distribution.\n"
STOP = "Stop recording the expert distribution.\n"
DUMP = "Dump expert distribution record.\n"


def _read_csv(pt_path: Path) -> list[list[str]]:
    with open(pt_path.with_suffix(".csv")) as f:
        return list(csv.reader(f))


def _feed(collector, passes: list[dict[int, torch.Tensor]]) -> None:
    for i, layers in enumerate(passes):
        collector.begin_pass(PassInfo(forward_pass_id=10 + i))
        for layer_id, ids in layers.items():
            collector(layer_id, ids)
        collector.end_pass()


def _expected_counts(passes: list[dict[int, torch.Tensor]], num_layers: int, num_experts: int) -> torch.Tensor:
    expected = torch.zeros((num_layers, num_experts), dtype=torch.int64)
    for layers in passes:
        for layer_id, ids in layers.items():
            for e in ids.flatten().tolist():
                if 0 <= e < num_experts:
                    expected[layer_id, e] += 1
    return expected


PASSES = [
    {0: torch.tensor([[0, 1], [1, 2], [3, 0]]), 1: torch.tensor([[2, 3], [2, 1], [0, 3]]),
     2: torch.tensor([[1, 0], [1, 3], [2, 1]])},
    {0: torch.tensor([[3, 2]]), 1: torch.tensor([[3, 0]]), 2: torch.tensor([[1, 2]])},
]


# ---- collectors ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["stat", "stat_approx"])
def test_stat_counts_sum_to_tokens_layers_topk(mode):
    collector = build_collector(mode, num_layers=3, num_experts=4)
    _feed(collector, PASSES)
    data = collector.dump_data()
    counts = data["logical_count"]
    assert counts.dtype == torch.int64 and counts.shape == (3, 4)
    assert torch.equal(counts, _expected_counts(PASSES, 3, 4))
    assert int(counts.sum()) == (3 + 1) * 3 * 2  # tokens x layers x top_k
    assert data["mode"] == mode and data["num_forward_passes"] == 2 and data["rank"] == 0
    header, rows = collector.csv_rows(data)
    assert header == ["layer_id", "expert_id", "count"] and len(rows) == 12
    assert sum(r[2] for r in rows) == 24 and rows[1] == [0, 1, int(counts[0, 1])]


def test_stat_ignores_padding_and_keeps_last_buffer_size_passes():
    collector = StatCollector(num_layers=1, num_experts=3, buffer_size=2)
    _feed(collector, [{0: torch.tensor([[0, 0]])}, {0: torch.tensor([[1, -1]])}, {0: torch.tensor([[2, 5]])}])
    assert collector.dump_data()["logical_count"].tolist() == [[0, 1, 1]]  # the first pass left the window


def test_reports_outside_a_pass_join_the_dump_and_reset_clears():
    collector = StatCollector(num_layers=2, num_experts=2)
    collector(1, torch.tensor([[1], [1]]))
    collector(7, torch.tensor([[0]]))  # no such layer: ignored, not raised
    assert collector.dump_data()["logical_count"].tolist() == [[0, 0], [0, 2]]
    collector.reset()
    assert collector.dump_data()["logical_count"].sum() == 0


def test_per_pass_keeps_one_record_per_forward_pass():
    collector = PerPassCollector(num_layers=3, num_experts=4)
    _feed(collector, PASSES)
    data = collector.dump_data()
    assert [r["forward_pass_id"] for r in data["records"]] == [10, 11]
    for record, layers in zip(data["records"], PASSES):
        assert torch.equal(record["global_physical_count"], _expected_counts([layers], 3, 4))
    assert torch.equal(data["last_physical_to_logical_map"], torch.arange(4).repeat(3, 1))
    header, rows = collector.csv_rows(data)
    assert header == ["forward_pass_id", "layer_id", "expert_id", "count"]
    assert sum(r[3] for r in rows) == 24 and all(r[3] > 0 for r in rows)


def test_per_token_keeps_every_tokens_choices():
    collector = PerTokenCollector(num_layers=3, num_experts=4)
    info = PassInfo(forward_pass_id=5, forward_mode=int(ForwardMode.EXTEND), input_ids=[7, 8, 9],
                    positions=[0, 1, 2], extend_seq_lens=[2, 1], rids=["a", "a", "b"])
    collector.begin_pass(info)
    collector(0, PASSES[0][0])
    collector(2, PASSES[0][2])  # layer 1 is dense in this model
    collector.end_pass()
    (record,) = collector.dump_data()["records"]
    topk = record["topk_ids_of_layer"]
    assert topk.shape == (3, 3, 2)  # [num_layers, num_tokens, top_k]
    assert torch.equal(topk[0], PASSES[0][0].int()) and torch.equal(topk[2], PASSES[0][2].int())
    assert (topk[1] == -1).all()
    assert record["rids"] == ["a", "a", "b"] and record["positions"] == [0, 1, 2]
    assert record["input_ids"] == [7, 8, 9] and record["forward_pass_id"] == 5
    header, rows = collector.csv_rows(collector.dump_data() | {"records": [record]})
    assert header == ["forward_pass_id", "token_index", "rid", "position", "layer_id", "k", "expert_id"]
    assert len(rows) == 3 * 2 * 2 and [5, 2, "b", 2, 0, 1, 0] in rows


def test_dense_model_records_nothing():
    collector = build_collector("stat", num_layers=30, num_experts=0)
    collector(0, torch.tensor([[0, 1]]))
    counts = collector.dump_data()["logical_count"]
    assert counts.shape == (30, 0)
    assert collector.csv_rows(collector.dump_data())[1] == []


def test_moe_shape_reads_the_config():
    from transformers import LlamaConfig, MixtralConfig, Qwen2MoeConfig

    assert moe_shape(Qwen2MoeConfig(num_hidden_layers=3, num_experts=6)) == (3, 6)
    assert moe_shape(MixtralConfig(num_hidden_layers=2, num_local_experts=8)) == (2, 8)
    assert moe_shape(LlamaConfig(num_hidden_layers=4)) == (4, 0)


def test_mode_is_validated_at_startup():
    with pytest.raises(ValueError, match="--expert-distribution-recorder-mode"):
        ServerArgs(model_path="m", expert_distribution_recorder_mode="counts").validate()
    args = ServerArgs(model_path="m", expert_distribution_recorder_mode="per_pass")
    args.validate()
    assert args.expert_distribution_recorder_buffer_size == 1000
    assert ServerArgs(model_path="m").expert_distribution_recorder_buffer_size is None


# ---- scheduler control (in-process) ----------------------------------------------------------------------
@pytest.fixture
def recorder():
    rec = get_global_expert_distribution_recorder()
    yield rec
    rec.recording = False
    rec.attach(None)


def test_scheduler_control_records_between_start_and_stop(recorder, tmp_path, monkeypatch):
    from transformers import Qwen2MoeConfig

    monkeypatch.setenv(DUMP_DIR_ENV, str(tmp_path / "dumps"))
    control = ExpertRecordControl("stat", Qwen2MoeConfig(num_hidden_layers=3, num_experts=4), 1000)
    batch = SimpleNamespace(reqs=[])
    forward_batch = SimpleNamespace(forward_mode=ForwardMode.DECODE)

    def run_pass(i: int) -> None:  # what the scheduler loop does around runner.forward
        control.begin_pass(i, batch, forward_batch)
        for layer_id, ids in PASSES[i % 2].items():
            recorder.on_select_experts(layer_id, ids)
        control.end_pass()

    run_pass(0)  # not recording yet
    assert control.handle(ExpertDistributionReq("start_record")).success
    run_pass(1)
    run_pass(2)
    assert control.handle(ExpertDistributionReq("stop_record")).success
    run_pass(3)  # stopped
    out = control.handle(ExpertDistributionReq("dump_record"))
    path = Path(out.message)
    assert out.success and path.parent == tmp_path / "dumps" and path.name.startswith("expert_distribution_recorder_")
    data = torch.load(path)
    assert torch.equal(data["logical_count"], _expected_counts([PASSES[1], PASSES[0]], 3, 4))
    assert data["num_forward_passes"] == 2
    rows = _read_csv(path)
    assert rows[0] == ["layer_id", "expert_id", "count"] and sum(int(r[2]) for r in rows[1:]) == 24
    # A dump starts a new window.
    assert torch.load(write_dump(control.collector))["logical_count"].sum() == 0


def test_without_mode_the_calls_are_refused(recorder):
    control = ExpertRecordControl(None, None, None)
    out = control.handle(ExpertDistributionReq("start_record"))
    assert not out.success and "--expert-distribution-recorder-mode" in out.message
    assert not recorder.recording
    tm = SimpleNamespace(server_args=ServerArgs(model_path="m"))
    with pytest.raises(ValueError, match="--expert-distribution-recorder-mode"):
        asyncio.run(expert_distribution(tm, "start_record"))
    with pytest.raises(ValueError, match="Unknown expert distribution action"):
        asyncio.run(expert_distribution(tm, "pause_record"))
    assert NO_MODE_MESSAGE.startswith("Expert distribution recording is off")


# ---- server on the default (dense) model ----------------------------------------------------------------
@pytest.fixture(scope="module")
def stat_server(tmp_path_factory):
    dump_dir = tmp_path_factory.mktemp("expert_dumps")
    with mock.patch.dict(os.environ, {DUMP_DIR_ENV: str(dump_dir)}):
        with running_server("--expert-distribution-recorder-mode", "stat") as url:
            yield url, dump_dir


def test_endpoints_answer_the_texts_and_dump_files(stat_server):
    url, dump_dir = stat_server
    before = set(dump_dir.glob("*.pt"))
    for method in (requests.get, requests.post):
        r = method(f"{url}/start_expert_distribution_record")
        assert (r.status_code, r.text) == (200, START) and r.headers["content-type"].startswith("text/plain")
    gen = requests.post(f"{url}/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}})
    assert gen.status_code == 200
    r = requests.post(f"{url}/stop_expert_distribution_record")
    assert (r.status_code, r.text) == (200, STOP)
    r = requests.get(f"{url}/dump_expert_distribution_record")
    assert (r.status_code, r.text) == (200, DUMP)
    (path,) = set(dump_dir.glob("*.pt")) - before
    data = torch.load(path)
    assert data["mode"] == "stat" and data["num_forward_passes"] >= 1
    assert data["logical_count"].shape == (30, 0)  # SmolLM2 is dense: 30 layers, no experts
    assert _read_csv(path) == [["layer_id", "expert_id", "count"]]


def test_notebook_cell(stat_server):
    url, dump_dir = stat_server
    before = set(dump_dir.glob("*.pt"))
    response = requests.post(f"{url}/start_expert_distribution_record")
    assert str(response) == "<Response [200]>"
    data = {"text": "What is the capital of France?", "sampling_params": {"max_new_tokens": 8}}
    response = requests.post(f"{url}/generate", json=data)
    assert response.json()["meta_info"]["completion_tokens"] >= 1
    response = requests.post(f"{url}/stop_expert_distribution_record")
    assert str(response) == "<Response [200]>"
    response = requests.post(f"{url}/dump_expert_distribution_record")
    assert str(response) == "<Response [200]>"
    assert len(set(dump_dir.glob("*.pt")) - before) == 1


# ---- Engine, per_token: one record per forward pass --------------------------------------------------------
def test_engine_per_token_marks_forward_passes(tmp_path, monkeypatch, smollm2_tokenizer):
    from sglang.srt.entrypoints.engine import Engine

    monkeypatch.setenv(DUMP_DIR_ENV, str(tmp_path))
    prompt_ids = smollm2_tokenizer.encode("The capital of France is")
    with Engine(model_path="HuggingFaceTB/SmolLM2-135M-Instruct", expert_distribution_recorder_mode="per_token",
                disable_radix_cache=True) as engine:
        engine.start_expert_distribution_record()
        out = engine.generate(input_ids=prompt_ids, sampling_params={"max_new_tokens": 3, "ignore_eos": True})
        engine.stop_expert_distribution_record()
        path = Path(engine.dump_expert_distribution_record())
    assert path.parent == tmp_path and path.with_suffix(".csv").exists()
    records = torch.load(path)["records"]
    assert len(records) == 3  # the prefill and two decode steps (the last token is sampled, not run)
    prefill, decode = records[0], records[1]
    assert prefill["input_ids"] == prompt_ids and prefill["positions"] == list(range(len(prompt_ids)))
    assert prefill["forward_mode"] == int(ForwardMode.EXTEND) and decode["forward_mode"] == int(ForwardMode.DECODE)
    assert set(prefill["rids"]) == {out["meta_info"]["id"]} and decode["positions"] == [len(prompt_ids)]
    assert decode["input_ids"] == out["output_ids"][:1]
    assert prefill["topk_ids_of_layer"].shape == (30, len(prompt_ids), 0)
    assert records[1]["forward_pass_id"] > records[0]["forward_pass_id"]


# ---- a MoE model against transformers' router choices -------------------------------------------------------
def _has_qwen2_moe() -> bool:
    from sglang.srt.models.registry import MODEL_REGISTRY

    return "Qwen2MoeForCausalLM" in MODEL_REGISTRY


@pytest.mark.skipif(not _has_qwen2_moe(), reason="Qwen2MoeForCausalLM is not implemented")
def test_qwen2_moe_counts_match_transformers_router(tmp_path, smollm2_tokenizer):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen2MoeConfig(
        vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False,
        max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
    )
    model = Qwen2MoeForCausalLM(config).eval()
    model_dir = tmp_path / "qwen2moe"
    model.save_pretrained(model_dir)
    smollm2_tokenizer.save_pretrained(model_dir)
    dump_dir = tmp_path / "dumps"
    prompts = [smollm2_tokenizer.encode(t) for t in ("Paris is", "One two three four", "Why do cats purr?")]
    max_new = 5

    with mock.patch.dict(os.environ, {DUMP_DIR_ENV: str(dump_dir)}):
        with running_server("--expert-distribution-recorder-mode", "stat", "--dtype", "float32",
                            "--disable-radix-cache", model=str(model_dir)) as url:
            assert requests.post(f"{url}/start_expert_distribution_record").text == START
            outs = requests.post(f"{url}/generate", json={
                "input_ids": prompts, "sampling_params": {"max_new_tokens": max_new, "temperature": 0,
                                                          "ignore_eos": True},
            }).json()
            assert requests.post(f"{url}/stop_expert_distribution_record").text == STOP
            assert requests.post(f"{url}/dump_expert_distribution_record").text == DUMP
            (path,) = dump_dir.glob("*.pt")
            # Notebook 004's cell, unchanged but for the server it talks to (a MoE model here too).
            port = url.rsplit(":", 1)[1]
            response = requests.post(f"http://localhost:{port}/start_expert_distribution_record")
            assert str(response) == "<Response [200]>"
            response = requests.post(f"http://localhost:{port}/generate",
                                     json={"text": "What is the capital of France?"})
            cell_out = response.json()
            response = requests.post(f"http://localhost:{port}/stop_expert_distribution_record")
            response = requests.post(f"http://localhost:{port}/dump_expert_distribution_record")
            assert str(response) == "<Response [200]>"
    (cell_path,) = set(dump_dir.glob("*.pt")) - {path}
    cell_tokens = cell_out["meta_info"]["prompt_tokens"] + cell_out["meta_info"]["completion_tokens"] - 1
    assert int(torch.load(cell_path)["logical_count"].sum()) == cell_tokens * 2 * config.num_experts_per_tok
    counts = torch.load(path)["logical_count"]

    expected = torch.zeros((2, 8), dtype=torch.int64)
    hooks = []
    for layer_id, layer in enumerate(model.model.layers):
        def hook(_module, _inputs, output, layer_id=layer_id):
            if isinstance(output, tuple):  # transformers 5: (router_logits, scores, top-k indices)
                ids = output[-1]
            else:  # a plain Linear gate: the router logits
                ids = output.reshape(-1, output.shape[-1]).topk(config.num_experts_per_tok, dim=-1).indices
            expected[layer_id] += torch.bincount(ids.flatten(), minlength=8)
        hooks.append(layer.mlp.gate.register_forward_hook(hook))
    num_tokens = 0
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            # Every prompt token and every generated token but the last runs through the model once.
            run = prompt + out["output_ids"][:-1]
            num_tokens += len(run)
            model(torch.tensor([run]))
    for h in hooks:
        h.remove()
    assert int(counts.sum()) == num_tokens * 2 * config.num_experts_per_tok
    assert torch.equal(counts, expected)
