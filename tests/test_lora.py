"""Multi-LoRA serving: PEFT adapters built here for tiny random Llamas, checked against transformers' model with
each adapter merged into its weights (W + scale * B @ A), through the model, a mixed batch, and a server."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import openai
import pytest
import requests
import torch
from safetensors.torch import save_file

from sglang.srt.lora.adapter import SUPPORTED_MODULES, LoraAdapterError
from sglang.srt.lora.cache_key import prefix_key
from sglang.srt.lora.layers import lora_rows
from sglang.srt.lora.manager import LoraManager
from sglang.srt.lora.request import openai_lora_path
from tests.test_models import PagedCache, build_models, max_diff, prompt_of, tiny_config

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
# The merged weights round differently from the separate low-rank product: float32 logits of a few units then
# differ by ~1e-4; a wrong slice, scale or row gives differences of tenths.
TOL = 1e-3


# ---- adapters written by hand, as PEFT saves them -----------------------------------------------------------
def module_shape(config, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a Llama projection."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}[module]


def write_adapter(path: Path, config, modules=SUPPORTED_MODULES, rank: int = 4, alpha: float = 8.0,
                  seed: int = 0, rslora: bool = False, std: float = 0.3) -> str:
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in modules:
            in_f, out_f = module_shape(config, module)
            block = "self_attn" if module in ATTN else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * std
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules),
        "use_rslora": rslora, "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM",
    }))
    return str(path)


def merged(reference, adapter_dir: str):
    """A copy of the transformers model with the adapter folded into its weights."""
    from safetensors.torch import load_file

    cfg = json.loads(Path(adapter_dir, "adapter_config.json").read_text())
    rank, alpha = cfg["r"], cfg["lora_alpha"]
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    tensors = load_file(str(Path(adapter_dir, "adapter_model.safetensors")))
    model = copy.deepcopy(reference)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            b = tensors[name.replace("lora_A", "lora_B")]
            target = name.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
            params[target] += scale * (b @ a)
    return model


def logits_of(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


# ---- the model with adapters ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(config, transformers model, our model with a LoRA manager holding adapters "a", "b", "attn" (rslora))."""
    root = tmp_path_factory.mktemp("lora-model")
    config = tiny_config("llama")
    reference, ours = build_models(root / "model", config)
    manager = LoraManager(ours, max_lora_rank=8, target_modules=None, max_loras_per_batch=4, dtype=torch.float32)
    dirs = {"a": write_adapter(root / "a", config, seed=1),
            "b": write_adapter(root / "b", config, rank=8, alpha=4.0, seed=2),
            "attn": write_adapter(root / "attn", config, modules=ATTN, seed=3, rslora=True)}
    for name, path in dirs.items():
        manager.load(name, path)
    return config, reference, ours, manager, dirs


def run(cache: PagedCache, model, manager, batch, names, all_logits=False) -> torch.Tensor:
    with lora_rows(manager.state, names, [len(tokens) for _, tokens in batch]):
        return cache.forward(model, batch, all_logits=all_logits)


@pytest.mark.parametrize("name", ["a", "b", "attn"])
def test_adapter_logits_equal_merged_model_prefill_and_decode(tiny, name):
    config, reference, ours, manager, dirs = tiny
    expected_model = merged(reference, dirs[name])
    prompt = prompt_of(11, 7)
    cache = PagedCache(config, torch.float32)
    logits = run(cache, ours, manager, [(0, prompt)], [name], all_logits=True)
    expected = logits_of(expected_model, prompt)
    assert max_diff(logits, expected) < TOL
    assert max_diff(logits, logits_of(reference, prompt)) > 0.1  # the adapter changes the output
    tokens = list(prompt)
    for _ in range(3):
        tokens.append(int(logits[-1].argmax()))
        logits = run(cache, ours, manager, [(0, tokens[-1:])], [name])
        assert max_diff(logits[0], logits_of(expected_model, tokens)[-1]) < TOL


def test_batch_mixing_two_adapters_and_the_base_gives_each_row_its_own_result(tiny):
    config, reference, ours, manager, dirs = tiny
    prompts = [prompt_of(9, 11), prompt_of(5, 12), prompt_of(7, 13), prompt_of(6, 14)]
    names = ["a", None, "b", "a"]
    models = {None: reference, "a": merged(reference, dirs["a"]), "b": merged(reference, dirs["b"])}
    cache = PagedCache(config, torch.float32)
    logits = run(cache, ours, manager, list(enumerate(prompts)), names, all_logits=True)
    offset = 0
    for prompt, name in zip(prompts, names):
        rows = logits[offset : offset + len(prompt)]
        assert max_diff(rows, logits_of(models[name], prompt)) < TOL, name
        offset += len(prompt)
    # one decode step of the four sequences together, in another order
    order = [2, 0, 3, 1]
    for i in order:
        prompts[i].append((i * 17 + 3) % config.vocab_size)
    step = run(cache, ours, manager, [(i, prompts[i][-1:]) for i in order], [names[i] for i in order])
    for row, i in enumerate(order):
        assert max_diff(step[row], logits_of(models[names[i]], prompts[i])[-1]) < TOL
    # outside a LoRA forward every layer computes the base model
    cache2 = PagedCache(config, torch.float32)
    base = cache2.forward(ours, [(0, prompt_of(9, 11))], all_logits=True)
    assert max_diff(base, logits_of(reference, prompt_of(9, 11))) < TOL


def test_adapter_validation_errors(tiny, tmp_path):
    config, _, _, manager, dirs = tiny
    with pytest.raises(LoraAdapterError, match="above --max-lora-rank 8"):
        manager.load("big", write_adapter(tmp_path / "big", config, rank=16))
    cfg_path = Path(write_adapter(tmp_path / "unknown", config, modules=("q_proj",)), "adapter_config.json")
    cfg = json.loads(cfg_path.read_text())
    cfg["target_modules"] = ["q_proj", "embed_tokens"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(LoraAdapterError, match="unsupported LoRA target modules \\['embed_tokens'\\]"):
        manager.load("unknown", str(cfg_path.parent))
    wrong = tiny_config("llama", hidden_size=32, intermediate_size=64)
    with pytest.raises(LoraAdapterError, match="the base model expects"):
        manager.load("shape", write_adapter(tmp_path / "shape", wrong))
    with pytest.raises(LoraAdapterError, match="no adapter_config.json"):
        manager.load("missing", str(tmp_path))
    with pytest.raises(LoraAdapterError, match="already loaded"):
        manager.load("a", dirs["a"])
    with pytest.raises(LoraAdapterError, match="not loaded"):
        manager.unload("nope")
    assert "big" not in manager.loaded() and "shape" not in manager.loaded()
    only_attn = LoraManager(tiny[2], 8, ["q_proj", "v_proj"], 2, torch.float32)
    with pytest.raises(LoraAdapterError, match="not in --lora-target-modules"):
        only_attn.load("a", dirs["a"])


def test_prefix_keys_differ_per_adapter_and_admission_limit(tiny):
    *_, manager, _ = tiny

    class R:
        def __init__(self, uid):
            self.lora_uid = uid

    ids = [1, 2, 3]
    assert prefix_key(R(0), ids) == ids
    keys = {tuple(prefix_key(R(u), ids)) for u in (0, 1, 2)}
    assert len(keys) == 3
    limited = copy.copy(manager)
    limited.max_loras_per_batch = 2
    assert limited.admits("a", ["a", "b", None]) and limited.admits(None, ["a", "b"])
    assert not limited.admits("attn", ["a", "b"]) and limited.admits("attn", ["a", None])


def test_unloading_an_adapter_in_use_waits_for_its_requests(tiny):
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import LoRAUpdateResult, UnloadLoRAAdapterReqInput
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler.lora import LoraControl
    from sglang.srt.sampling.sampling_params import SamplingParams

    *_, manager, dirs = tiny
    manager.load("extra", dirs["a"])
    req = Req("r", [1, 2, 3], SamplingParams(), set(), 0, lora_path="extra")
    replies: list = []
    sched = SimpleNamespace(waiting=[req], running=[], chunked_req=None, grammar_queue=SimpleNamespace(pending=[]),
                            runner=SimpleNamespace(lora_state=None),
                            send_to_detokenizer=SimpleNamespace(send_pyobj=replies.append))
    control = LoraControl(sched, manager)  # type: ignore[arg-type]
    assert control.check_request(req) is None and req.lora_uid == manager.uids["extra"]
    assert control.handle(UnloadLoRAAdapterReqInput("extra")) is None  # answered once the request finished
    control.run_pending()
    assert replies == [] and "extra" in manager.loaded()
    late = Req("late", [1], SamplingParams(), set(), 0, lora_path="extra")
    assert "being unloaded" in (control.check_request(late) or "")
    sched.waiting = []
    control.run_pending()
    assert len(replies) == 1 and isinstance(replies[0], LoRAUpdateResult) and replies[0].success
    assert "extra" not in manager.loaded()
    unknown = Req("u", [1], SamplingParams(), set(), 0, lora_path="extra")
    assert "lora_path" in (control.check_request(unknown) or "")


def test_openai_model_field_names_the_adapter():
    class Req:
        def __init__(self, model, lora_path=None):
            self.model, self.lora_path = model, lora_path

    adapters = {"sql": "/x"}
    assert openai_lora_path(Req("base:sql"), "base", adapters) == "sql"
    assert openai_lora_path(Req("sql"), "base", adapters) == "sql"
    assert openai_lora_path(Req("base"), "base", adapters) is None
    assert openai_lora_path(Req("base:sql", lora_path="other"), "base", adapters) == "other"
    assert openai_lora_path(Req("gpt-4"), "base", {}) is None


# ---- through a server ----------------------------------------------------------------------------------------
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, tiny_llama_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.server_fixtures import running_server

    root = tmp_path_factory.mktemp("lora-adapters")
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    dirs = {"a": write_adapter(root / "a", config, seed=21, std=0.5),
            "b": write_adapter(root / "b", config, modules=("q_proj", "v_proj", "down_proj"), seed=22, std=0.5),
            "c": write_adapter(root / "c", config, seed=23, std=0.5)}
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with running_server("--dtype", "float32", "--log-level", "warning", "--max-loras-per-batch", "2",
                        "--lora-paths", f"a={dirs['a']}", f"b={dirs['b']}", model=tiny_llama_dir) as url:
        yield url, reference, dirs


def hf_greedy(model, ids: list[int], n: int = GREEDY["max_new_tokens"]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def generate(url: str, **body) -> requests.Response:
    return requests.post(f"{url}/generate", json={"sampling_params": GREEDY, **body}, timeout=60)


def test_server_greedy_with_lora_path_equals_merged_model_in_a_mixed_batch(lora_server):
    url, reference, dirs = lora_server
    prompts = [[5, 17, 300, 42, 9, 77], [8, 1000, 3, 3, 12], [400, 401, 402, 17]]
    paths = ["a", None, "b"]
    r = generate(url, input_ids=prompts, lora_path=paths)
    assert r.status_code == 200, r.text
    got = [o["output_ids"] for o in r.json()]
    models = {None: reference, "a": merged(reference, dirs["a"]), "b": merged(reference, dirs["b"])}
    expected = [hf_greedy(models[p], ids) for ids, p in zip(prompts, paths)]
    assert got == expected
    assert len({tuple(g) for g in got}) == 3
    single = generate(url, input_ids=prompts[0], lora_path="a").json()
    assert single["output_ids"] == expected[0]
    by_path = generate(url, input_ids=prompts[2], lora_path=dirs["b"]).json()  # a loaded adapter's path
    assert by_path["output_ids"] == expected[2]


def test_prefix_cache_hit_never_crosses_adapters(lora_server):
    url, _, _ = lora_server
    assert requests.post(f"{url}/flush_cache", timeout=30).status_code == 200
    prompt = list(range(100, 140))
    cached = []
    for path in [None, "a", "b", "a", None]:
        r = generate(url, input_ids=prompt, lora_path=path, sampling_params={**GREEDY, "max_new_tokens": 1})
        assert r.status_code == 200, r.text
        cached.append(r.json()["meta_info"]["cached_tokens"])
    assert cached[:3] == [0, 0, 0]
    assert cached[3] > 0 and cached[4] > 0


def test_dynamic_load_unload_and_server_info(lora_server):
    url, reference, dirs = lora_server
    r = requests.post(f"{url}/load_lora_adapter", json={"lora_name": "c", "lora_path": dirs["c"]}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["success"] and set(r.json()["loaded_adapters"]) == {"a", "b", "c"}
    assert r.json()["message"] and r.json()["error_message"] is None
    info = requests.get(f"{url}/get_server_info", timeout=30).json()
    assert set(info["loaded_lora_adapters"]) == {"a", "b", "c"}
    ids = [7, 70, 700, 7000]
    out = generate(url, input_ids=ids, lora_path="c").json()
    assert out["output_ids"] == hf_greedy(merged(reference, dirs["c"]), ids)
    # three adapters with --max-loras-per-batch 2: the third waits for a later batch, every row still right
    batch = generate(url, input_ids=[ids, ids, ids], lora_path=["a", "b", "c"]).json()
    assert [o["output_ids"] for o in batch] == [
        hf_greedy(merged(reference, dirs[p]), ids) for p in ("a", "b", "c")]
    # the OpenAI API names the adapter in `model`
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    model_name = info["served_model_name"]
    text = client.completions.create(model=f"{model_name}:c", prompt="Hello there", max_tokens=6, temperature=0)
    native = generate(url, text="Hello there", lora_path="c",
                      sampling_params={"temperature": 0, "max_new_tokens": 6}).json()
    assert text.choices[0].text == native["text"]
    r = requests.post(f"{url}/unload_lora_adapter", json={"lora_name": "c"}, timeout=60)
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"a", "b"}
    r = generate(url, input_ids=ids, lora_path="c")
    assert r.status_code == 400 and "lora_path" in r.text
    r = requests.post(f"{url}/unload_lora_adapter", json={"lora_name": "c"}, timeout=60)
    assert r.status_code == 400 and "not loaded" in r.json()["error_message"]


def test_server_error_cases(lora_server, tmp_path):
    url, _, dirs = lora_server
    r = generate(url, input_ids=[1, 2, 3], lora_path="nope")
    assert r.status_code == 400 and "lora_path" in r.text and "nope" in r.text
    r = generate(url, input_ids=[[1, 2], [3, 4]], lora_path=["a"])
    assert r.status_code == 400 and "lora_path" in r.text
    r = generate(url, input_ids=[1, 2], lora_path=5)
    assert r.status_code == 400 and "lora_path" in r.text
    r = requests.post(f"{url}/load_lora_adapter", json={"lora_name": "x"}, timeout=30)
    assert r.status_code == 400 and "lora_path" in r.text
    r = requests.post(f"{url}/load_lora_adapter", json={"lora_name": "a", "lora_path": dirs["a"]}, timeout=30)
    assert r.status_code == 400 and "already loaded" in r.json()["error_message"]
    big = write_adapter(tmp_path / "big", _config_like(url), rank=128)
    r = requests.post(f"{url}/load_lora_adapter", json={"lora_name": "big", "lora_path": big}, timeout=30)
    assert r.status_code == 400 and "--max-lora-rank" in r.json()["error_message"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match="lora_path"):
        client.completions.create(model="base:nope", prompt="Hi", max_tokens=2)


def _config_like(url: str):
    from transformers import AutoConfig

    info = requests.get(f"{url}/get_server_info", timeout=30).json()
    return AutoConfig.from_pretrained(info["model_path"])


def test_startup_refuses_a_bad_adapter(tiny_llama_dir, tmp_path):
    from transformers import AutoConfig

    from sglang import Engine

    config = AutoConfig.from_pretrained(tiny_llama_dir)
    big = write_adapter(tmp_path / "big", config, rank=8)
    with pytest.raises(Exception, match="above --max-lora-rank 4"):
        Engine(model_path=tiny_llama_dir, dtype="float32", lora_paths=[f"big={big}"], max_lora_rank=4,
               max_total_tokens=1024)


def test_engine_loads_an_adapter_and_generates_with_it(tiny_llama_dir, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from sglang import Engine

    config = AutoConfig.from_pretrained(tiny_llama_dir)
    path = write_adapter(tmp_path / "e", config, modules=("k_proj", "o_proj", "gate_proj", "up_proj"), seed=31,
                         std=0.5)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = [11, 22, 33, 44, 55]
    with Engine(model_path=tiny_llama_dir, dtype="float32", enable_lora=True, max_total_tokens=1024) as engine:
        result = engine.load_lora_adapter("e", path)
        assert result["success"] and result["loaded_adapters"] == {"e": path}
        out = engine.generate(input_ids=ids, sampling_params=GREEDY, lora_path="e")
        base = engine.generate(input_ids=ids, sampling_params=GREEDY)
        assert engine.unload_lora_adapter("e")["loaded_adapters"] == {}
    assert out["output_ids"] == hf_greedy(merged(reference, path), ids)
    assert base["output_ids"] == hf_greedy(reference, ids)
    assert out["output_ids"] != base["output_ids"]


def test_server_args_lora_flags():
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    args = prepare_server_args(["--model-path", "m", "--lora-paths", "x=/p", "/q", "--max-lora-rank", "16",
                                "--lora-target-modules", "q_proj", "v_proj", "--max-loras-per-batch", "3"])
    assert args.lora_paths == ["x=/p", "/q"] and args.max_lora_rank == 16
    assert args.lora_target_modules == ["q_proj", "v_proj"] and "lora_paths" not in args.not_applicable_settings()
    ServerArgs(model_path="m", enable_lora=True, tp_size=2).validate()  # LoRA under tensor parallelism
    for bad, flag in [(dict(enable_lora=True, speculative_algorithm="EAGLE"), "--speculative-algorithm"),
                      (dict(max_lora_rank=0), "--max-lora-rank"),
                      (dict(max_loras_per_batch=0), "--max-loras-per-batch")]:
        with pytest.raises(ValueError, match=flag):
            ServerArgs(model_path="m", **bad).validate()
