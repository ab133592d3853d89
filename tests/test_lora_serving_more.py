"""Multi-LoRA serving beyond the basics: the grouped delta computation over a batch of four adapters and the base
model, the bounded adapter pool (--max-loaded-loras, lru/fifo eviction, pinned adapters), /v1/models, the OpenAI
routes, unloading an adapter while its requests run, and adapters across a live weight update."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import openai
import pytest
import requests
import torch

from sglang.srt.lora.adapter import LoraAdapterError, parse_lora_paths, parse_lora_specs
from sglang.srt.lora.manager import LoraManager
from sglang.srt.lora.pool import AdapterPool
from tests.test_lora import ATTN, TOL, hf_greedy, logits_of, merged, run, write_adapter
from tests.test_models import PagedCache, build_models, max_diff, prompt_of, tiny_config

MLP = ("gate_proj", "up_proj", "down_proj")


# ---- the grouped computation and the pool, on the model directly --------------------------------------------
@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """(config, transformers model, our model, adapter dirs): four adapters of ranks 4, 8, 16, 8 on different
    modules (one rsLoRA)."""
    root = tmp_path_factory.mktemp("lora-four")
    config = tiny_config("llama")
    reference, ours = build_models(root / "model", config)
    dirs = {"r4": write_adapter(root / "r4", config, rank=4, seed=41),
            "r8": write_adapter(root / "r8", config, modules=ATTN, rank=8, alpha=16.0, seed=42),
            "r16": write_adapter(root / "r16", config, modules=MLP + ("q_proj",), rank=16, seed=43, rslora=True),
            "kv": write_adapter(root / "kv", config, modules=("k_proj", "v_proj", "up_proj"), rank=8, seed=44)}
    return config, reference, ours, dirs


def test_a_batch_of_four_adapters_and_the_base_gives_each_row_its_own_result(four):
    config, reference, ours, dirs = four
    manager = LoraManager(ours, 16, None, 8, torch.float32)
    for name, path in dirs.items():
        manager.load(name, path)
    names = ["r16", None, "r4", "kv", "r8", "r4", None, "r16"]
    prompts = [prompt_of(5 + i, 60 + i) for i in range(len(names))]
    models = {None: reference, **{n: merged(reference, p) for n, p in dirs.items()}}
    cache = PagedCache(config, torch.float32, rows=len(names))
    logits = run(cache, ours, manager, list(enumerate(prompts)), names, all_logits=True)
    offset = 0
    for prompt, name in zip(prompts, names):
        assert max_diff(logits[offset : offset + len(prompt)], logits_of(models[name], prompt)) < TOL, name
        offset += len(prompt)
    for step in range(2):  # decode steps, the rows interleaved differently each time
        order = [7, 3, 0, 5, 1, 6, 2, 4] if step == 0 else [2, 4, 6, 0, 1, 3, 5, 7]
        for i in order:
            prompts[i].append((i * 31 + step) % config.vocab_size)
        out = run(cache, ours, manager, [(i, prompts[i][-1:]) for i in order], [names[i] for i in order])
        for row, i in enumerate(order):
            assert max_diff(out[row], logits_of(models[names[i]], prompts[i])[-1]) < TOL, names[i]
    # the adapters do differ from one another on the same prompt
    same = prompt_of(9, 99)
    outs = [run(PagedCache(config, torch.float32), ours, manager, [(0, same)], [n])[-1] for n in (None, *dirs)]
    assert min(max_diff(a, b) for i, a in enumerate(outs) for b in outs[i + 1:]) > 1e-2
    for name in dirs:
        manager.unload(name)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_peft_made_adapters_match_peft_model(tmp_path, family):
    """Adapters written by `peft` itself (random non-zero A and B), one batch mixing them: each row's logits are
    those of peft's PeftModel with that adapter active."""
    peft = pytest.importorskip("peft")
    import copy

    config = tiny_config(family)
    reference, ours = build_models(tmp_path / "model", config)
    specs = {"all8": (8, "all-linear", False), "attn16": (16, ["q_proj", "v_proj", "o_proj"], True),
             "mlp4": (4, ["gate_proj", "down_proj"], False)}
    manager = LoraManager(ours, 16, None, 4, torch.float32)
    peft_models = {}
    for name, (rank, targets, rslora) in specs.items():
        cfg = peft.LoraConfig(r=rank, lora_alpha=rank * 1.5, target_modules=targets, use_rslora=rslora,
                              init_lora_weights=False, task_type="CAUSAL_LM")
        torch.manual_seed(len(peft_models))
        model = peft.get_peft_model(copy.deepcopy(reference), cfg).eval()
        model.save_pretrained(str(tmp_path / name))
        manager.load(name, str(tmp_path / name))
        peft_models[name] = model
    names = ["attn16", None, "all8", "mlp4", "all8"]
    prompts = [prompt_of(6 + i, 80 + i) for i in range(len(names))]
    logits = run(PagedCache(config, torch.float32, rows=len(names)), ours, manager, list(enumerate(prompts)), names,
                 all_logits=True)
    offset = 0
    for prompt, name in zip(prompts, names):
        expected = logits_of(reference if name is None else peft_models[name], prompt)
        assert max_diff(logits[offset : offset + len(prompt)], expected) < TOL, name
        if name is not None:
            assert max_diff(expected, logits_of(reference, prompt)) > 0.1  # the adapter changes the output
        offset += len(prompt)


def test_pool_policies_and_pins():
    lru, fifo = AdapterPool(3, "lru"), AdapterPool(3, "fifo")
    for pool in (lru, fifo):
        pool.add("p", pinned=True)
        pool.add("a")
        pool.add("b")
        assert pool.full()
        pool.touch("a")
    assert lru.victim(()) == "b" and fifo.victim(()) == "a"
    assert lru.victim({"b"}) == "a" and lru.victim({"a", "b"}) is None  # never the pinned one
    lru.remove("p")
    assert "p" not in lru.pinned and lru.victim({"a", "b"}) is None and not lru.full()
    assert AdapterPool(None, "lru").full() is False
    with pytest.raises(ValueError, match="--lora-eviction-policy"):
        AdapterPool(2, "random")


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_manager_evicts_by_policy_and_reads_evicted_adapters_again(four, policy):
    config, reference, ours, dirs = four
    manager = LoraManager(ours, 16, None, 2, torch.float32, max_loaded_loras=3, eviction_policy=policy)
    manager.load("r8", dirs["r8"], pinned=True)
    manager.load("r4", dirs["r4"])
    manager.load("r16", dirs["r16"])
    assert manager.ensure_resident(["r4"], in_use=())  # used: the most recent under lru
    manager.load("kv", dirs["kv"])  # the pool is full: one unpinned adapter makes room
    evicted = "r16" if policy == "lru" else "r4"
    assert set(manager.adapters) == {"r8", "kv", ({"r4", "r16"} - {evicted}).pop()}
    assert set(manager.loaded()) == {"r8", "r4", "r16", "kv"}  # still served by name
    # bringing the evicted one back never evicts the pinned adapter nor one in use
    other = ({"r4", "r16"} - {evicted}).pop()
    assert manager.ensure_resident([evicted], in_use={other})
    assert set(manager.adapters) == {"r8", other, evicted}
    assert not manager.ensure_resident(["kv"], in_use={other, evicted})  # no room now: the request waits
    prompt = prompt_of(8, 7)
    logits = run(PagedCache(config, torch.float32), ours, manager, [(0, prompt)], [evicted], all_logits=True)
    assert max_diff(logits, logits_of(merged(reference, dirs[evicted]), prompt)) < TOL
    for name in list(manager.loaded()):
        manager.unload(name)
    assert manager.adapters == {} and len(manager.pool) == 0
    small = LoraManager(ours, 16, None, 1, torch.float32, max_loaded_loras=2, eviction_policy=policy)
    small.load("r8", dirs["r8"], pinned=True)
    with pytest.raises(LoraAdapterError, match="must leave room for one unpinned"):
        small.load("kv", dirs["kv"], pinned=True)
    small.load("kv", dirs["kv"])
    small.load("r4", dirs["r4"])  # evicts "kv", never the pinned "r8"
    assert set(small.adapters) == {"r8", "r4"} and set(small.loaded()) == {"r8", "kv", "r4"}


def test_lora_paths_json_form_and_flags():
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    specs = parse_lora_specs(["x=/p", "/q", '{"lora_name": "y", "lora_path": "/r", "pinned": true}'])
    assert [(s.name, s.path, s.pinned) for s in specs] == [("x", "/p", False), ("/q", "/q", False),
                                                          ("y", "/r", True)]
    assert parse_lora_paths(['{"lora_name": "y", "lora_path": "/r"}']) == {"y": "/r"}
    for bad in ['{"lora_name": "y"}', '{"lora_name": "y", "lora_path": "/r", "pinned": "yes"}', "{oops", "=/p"]:
        with pytest.raises(LoraAdapterError, match="--lora-paths"):
            parse_lora_specs([bad])
    args = prepare_server_args(["--model-path", "m", "--max-loaded-loras", "4", "--lora-eviction-policy", "fifo"])
    assert args.max_loaded_loras == 4 and args.lora_eviction_policy == "fifo"
    with pytest.raises(ValueError, match="--max-loaded-loras"):
        ServerArgs(model_path="m", max_loaded_loras=2, max_loras_per_batch=4).validate()
    with pytest.raises(SystemExit):
        prepare_server_args(["--model-path", "m", "--lora-eviction-policy", "random"])


# ---- through a server -----------------------------------------------------------------------------------------
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama_dir):
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("lora-serving-more")
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    return {"a": write_adapter(root / "a", config, rank=4, seed=51, std=0.5),
            "b": write_adapter(root / "b", config, modules=ATTN, rank=16, seed=52, std=0.5),
            "p": write_adapter(root / "p", config, modules=MLP, rank=8, seed=53, std=0.5),
            "c": write_adapter(root / "c", config, rank=8, seed=54, std=0.5)}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, adapters):
    from transformers import AutoModelForCausalLM

    from tests.server_fixtures import running_server

    pinned = json.dumps({"lora_name": "p", "lora_path": adapters["p"], "pinned": True})
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with running_server("--dtype", "float32", "--log-level", "warning", "--max-loras-per-batch", "2",
                        "--max-loaded-loras", "2", "--lora-eviction-policy", "lru", "--max-lora-rank", "16",
                        "--lora-paths", f"a={adapters['a']}", f"b={adapters['b']}", pinned,
                        model=tiny_llama_dir) as url:
        yield url, reference


def generate(url: str, **body) -> requests.Response:
    return requests.post(f"{url}/generate", json={"sampling_params": GREEDY, **body}, timeout=120)


def test_evicted_adapters_are_read_again_and_every_answer_is_right(server, adapters):
    url, reference = server
    ids = [9, 90, 900, 33, 4]
    expected = {n: hf_greedy(merged(reference, adapters[n]), ids) for n in ("a", "b", "p")}
    # two places in memory, one held by the pinned "p": "a" and "b" take turns in the other
    for name in ["a", "b", "a", "p", "b", "a"]:
        r = generate(url, input_ids=ids, lora_path=name)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == expected[name], name
    # a batch naming all three: the adapters that do not fit wait for a later batch, all answers are right
    batch = generate(url, input_ids=[ids] * 4, lora_path=["a", "b", "p", None]).json()
    assert [o["output_ids"] for o in batch] == [expected["a"], expected["b"], expected["p"], hf_greedy(reference, ids)]


def test_models_lists_the_adapters_and_follows_loads(server, adapters):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    base = client.models.list().data[0]
    cards = {m.id: m for m in client.models.list().data[1:]}
    assert set(cards) == {"a", "b", "p"}
    assert cards["a"].root == adapters["a"] and cards["a"].parent == base.id  # type: ignore[attr-defined]
    r = requests.post(f"{url}/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"]}, timeout=60)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert [m.id for m in client.models.list().data] == [base.id, "a", "b", "p", "c"]
    assert client.models.retrieve("c").root == adapters["c"]
    r = requests.post(f"{url}/load_lora_adapter", json={"lora_name": "d", "lora_path": adapters["c"],
                                                        "pinned": "yes"}, timeout=60)
    assert r.status_code == 400 and "pinned" in r.text
    r = requests.post(f"{url}/load_lora_adapter", json={"lora_name": "d", "lora_path": adapters["c"],
                                                        "pinned": True}, timeout=60)
    assert r.status_code == 400 and "--max-loaded-loras" in r.json()["error_message"]
    assert requests.post(f"{url}/unload_lora_adapter", json={"lora_name": "c"}, timeout=60).status_code == 200
    assert [m.id for m in client.models.list().data] == [base.id, "a", "b", "p"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("c")


def test_openai_routes_name_the_adapter(server, adapters):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    served = client.models.list().data[0].id
    native = generate(url, text="Once upon a time", lora_path="b",
                      sampling_params={"temperature": 0, "max_new_tokens": 6}).json()["text"]
    base = generate(url, text="Once upon a time",
                    sampling_params={"temperature": 0, "max_new_tokens": 6}).json()["text"]
    assert native != base
    for kwargs in ({"model": f"{served}:b"}, {"model": served, "extra_body": {"lora_path": "b"}}):
        text = client.completions.create(prompt="Once upon a time", max_tokens=6, temperature=0, **kwargs)
        assert text.choices[0].text == native, kwargs
    messages = [{"role": "user", "content": "Say hello"}]
    chat_native = client.chat.completions.create(model=served, messages=messages, max_tokens=6, temperature=0,
                                                 extra_body={"lora_path": "b"})
    chat_model = client.chat.completions.create(model=f"{served}:b", messages=messages, max_tokens=6, temperature=0)
    chat_base = client.chat.completions.create(model=served, messages=messages, max_tokens=6, temperature=0)
    assert chat_native.choices[0].message.content == chat_model.choices[0].message.content
    assert chat_model.choices[0].message.content != chat_base.choices[0].message.content
    for call in (lambda: client.completions.create(model=f"{served}:nope", prompt="Hi", max_tokens=2),
                 lambda: client.chat.completions.create(model=served, messages=messages, max_tokens=2,
                                                        extra_body={"lora_path": "nope"})):
        with pytest.raises(openai.BadRequestError, match="nope") as err:
            call()
        assert "lora_path" in str(err.value)


def test_unload_waits_for_the_requests_using_the_adapter(server, adapters):
    url, reference = server
    r = requests.post(f"{url}/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"]}, timeout=60)
    assert r.status_code == 200, r.text
    from tests.server_fixtures import stream_generate_in_thread

    ids = [5, 6, 7, 8]
    n = 200
    done: dict = {}
    body = {"input_ids": ids, "lora_path": "c", "sampling_params": {**GREEDY, "max_new_tokens": n}}
    thread = stream_generate_in_thread(url, body, done)
    still_running = "done_at" not in done
    r = requests.post(f"{url}/unload_lora_adapter", json={"lora_name": "c"}, timeout=120)
    unloaded_at = time.monotonic()
    thread.join(timeout=120)
    assert r.status_code == 200 and r.json()["success"] and "c" not in r.json()["loaded_adapters"], r.text
    last = done["last"]
    assert last["meta_info"]["completion_tokens"] == n and last["meta_info"]["finish_reason"]["type"] == "length"
    assert last["output_ids"][-5:] == hf_greedy(merged(reference, adapters["c"]), ids, n)[-5:]
    assert still_running and done["done_at"] <= unloaded_at  # the request ended before the unload answered
    r = generate(url, input_ids=ids, lora_path="c")
    assert r.status_code == 400 and "'c'" in r.text


def test_load_use_unload_reload_under_traffic(server, adapters):
    url, reference = server
    ids = [17, 71, 171]
    expected = {"a": hf_greedy(merged(reference, adapters["a"]), ids), None: hf_greedy(reference, ids)}
    wrong: list = []
    stop = threading.Event()

    def traffic(name) -> None:
        while not stop.is_set():
            r = generate(url, input_ids=ids, lora_path=name)
            if r.status_code != 200 or r.json()["output_ids"] != expected[name]:
                wrong.append((name, r.status_code, r.text[:200]))

    threads = [threading.Thread(target=traffic, args=(name,)) for name in ("a", None, "a")]
    for t in threads:
        t.start()
    try:
        c_expected = hf_greedy(merged(reference, adapters["c"]), ids)
        for _ in range(3):
            r = requests.post(f"{url}/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"]},
                              timeout=60)
            assert r.status_code == 200, r.text
            assert generate(url, input_ids=ids, lora_path="c").json()["output_ids"] == c_expected
            assert requests.post(f"{url}/unload_lora_adapter", json={"lora_name": "c"}, timeout=60).status_code == 200
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert wrong == []


def _perturbed_checkpoint(src: str, dst: Path, tokenizer) -> str:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(dst)
    tokenizer.save_pretrained(dst)
    return str(dst)


def test_adapters_serve_on_over_updated_weights(server, adapters, tiny_llama_dir, smollm2_tokenizer, tmp_path):
    from tests.server_fixtures import running_server

    url, _ = server
    new_dir = _perturbed_checkpoint(tiny_llama_dir, tmp_path / "new", smollm2_tokenizer)
    prompts = [[3, 30, 300, 7], [44, 4, 404]]
    names = ["a", "p"]
    before = [o["output_ids"] for o in generate(url, input_ids=prompts, lora_path=names).json()]
    r = requests.post(f"{url}/update_weights_from_disk", json={"model_path": new_dir}, timeout=120)
    try:
        assert r.status_code == 200 and r.json()["success"], r.text
        after = [o["output_ids"] for o in generate(url, input_ids=prompts, lora_path=names).json()]
        after_base = generate(url, input_ids=prompts[0]).json()["output_ids"]
    finally:
        restore = requests.post(f"{url}/update_weights_from_disk", json={"model_path": tiny_llama_dir}, timeout=120)
        assert restore.status_code == 200, restore.text
    assert after != before
    pinned = json.dumps({"lora_name": "p", "lora_path": adapters["p"], "pinned": True})
    with running_server("--dtype", "float32", "--log-level", "warning", "--max-lora-rank", "16",
                        "--lora-paths", f"a={adapters['a']}", pinned, model=new_dir) as fresh:
        assert [o["output_ids"] for o in generate(fresh, input_ids=prompts, lora_path=names).json()] == after
        assert generate(fresh, input_ids=prompts[0]).json()["output_ids"] == after_base
    # and back on the old weights, the adapters give what they gave before
    assert [o["output_ids"] for o in generate(url, input_ids=prompts, lora_path=names).json()] == before
