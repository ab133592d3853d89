"""Speculative decoding with an EAGLE-3 head (--speculative-algorithm EAGLE3): heads built here in the published
layout (config.json with draft_vocab_size; fc, midlayer.*, norm, lm_head, d2t, t2d in model.safetensors) draft from
three of the served model's layers. The head's proposals equal an independent plain-torch computation of the
published math, the served model captures exactly transformers' hidden states of those layers, greedy outputs equal
plain decoding token for token, both KV pools return to idle, and a malformed head or --speculative-token-map is a
startup error naming the tensor or the flag."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F

from sglang import Engine
from sglang.srt.server_args import ServerArgs
from tests.conftest import save_tiny_llama
from tests.server_fixtures import running_server
from tests.test_speculative_eagle import check_draft_slots
from tests.test_speculative_ngram import assert_clean, assert_refused, generate
from tests.test_speculative_standalone import (
    COMMON,
    PROMPTS,
    SCHEMA,
    STEPS,
    assert_engine_idle,
    greedy_cases_match,
    spec_flags,
)

LAYERS = 8  # the served model's; SGLang's default capture reads the inputs of layers 2, 4 and 5
CAPTURED = (2, 4, 5)
DRAFT_VOCAB = 1024
HEAD_HEADS = 2  # the head's attention heads, each with its own K/V head


def save_eagle3_head(path: Path, config, weights: dict, hot: torch.Tensor, maps: bool = True,
                     **config_extra) -> str:
    """An EAGLE-3 head in its published layout: config.json (LlamaForCausalLMEagle3, one layer, draft_vocab_size)
    and `weights` plus d2t (draft id -> target id offset) and t2d (target ids in the draft vocabulary)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    head_config = config.to_dict()
    head_config.update({"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
                        "draft_vocab_size": len(hot), "target_hidden_size": config.hidden_size,
                        "num_key_value_heads": HEAD_HEADS, "num_attention_heads": HEAD_HEADS,
                        "tie_word_embeddings": False, **config_extra})
    (path / "config.json").write_text(json.dumps(head_config))
    tensors = dict(weights)
    if maps:
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[hot] = True
        tensors.update(d2t=hot - torch.arange(len(hot)), t2d=t2d)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path / "model.safetensors"))
    return str(path)


def head_weights(hidden: int, intermediate: int, draft_vocab: int, gen: torch.Generator) -> dict:
    """Random weights of every tensor of the layout (norm weights near 1)."""
    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * 0.2

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(hidden, generator=gen)

    return {"fc.weight": mat(hidden, 3 * hidden),
            "midlayer.self_attn.q_proj.weight": mat(hidden, 2 * hidden),
            "midlayer.self_attn.k_proj.weight": mat(hidden, 2 * hidden),
            "midlayer.self_attn.v_proj.weight": mat(hidden, 2 * hidden),
            "midlayer.self_attn.o_proj.weight": mat(hidden, hidden),
            "midlayer.mlp.gate_proj.weight": mat(intermediate, hidden),
            "midlayer.mlp.up_proj.weight": mat(intermediate, hidden),
            "midlayer.mlp.down_proj.weight": mat(hidden, intermediate),
            "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
            "midlayer.post_attention_layernorm.weight": norm(), "norm.weight": norm(),
            "lm_head.weight": mat(draft_vocab, hidden) * 5}


def copy_weights(hidden: int, intermediate: int, embed_rows: torch.Tensor) -> dict:
    """A head that proposes its input token again: each query and key is the normed token embedding (scaled so that
    a row attends to its own token), the value is that embedding, fc and the MLP add nothing, and the LM head is
    the served model's embedding rows of the draft vocabulary. It is right wherever the served model repeats."""
    eye, zero = torch.eye(hidden), torch.zeros(hidden, hidden)
    weights = {name: torch.ones(hidden) for name in ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                                                     "midlayer.post_attention_layernorm.weight", "norm.weight")}
    weights.update({"fc.weight": torch.zeros(hidden, 3 * hidden),
                    "midlayer.self_attn.q_proj.weight": torch.cat([40 * eye, zero], 1),
                    "midlayer.self_attn.k_proj.weight": torch.cat([eye, zero], 1),
                    "midlayer.self_attn.v_proj.weight": torch.cat([eye, zero], 1),
                    "midlayer.self_attn.o_proj.weight": 10 * eye,
                    "midlayer.mlp.gate_proj.weight": torch.zeros(intermediate, hidden),
                    "midlayer.mlp.up_proj.weight": torch.zeros(intermediate, hidden),
                    "midlayer.mlp.down_proj.weight": torch.zeros(hidden, intermediate),
                    "lm_head.weight": embed_rows.clone()})
    return weights


def captured_states(hf, ids: list[int]) -> torch.Tensor:
    """transformers' residual stream entering layers CAPTURED, concatenated: [len(ids), 3 * hidden]."""
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([states[i][0] for i in CAPTURED], dim=-1)


def scaled_tiny_target(directory, tokenizer, layers: int, scale: float) -> tuple[Any, Any]:
    """(directory, transformers model) of a tiny random Llama of `layers` layers whose projections are scaled by
    `scale`, so that its greedy outputs vary and sometimes repeat a token."""
    from transformers import LlamaForCausalLM

    target = save_tiny_llama(directory, tokenizer, max_position_embeddings=512, num_hidden_layers=layers)
    hf = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("proj.weight"):
                param.mul_(scale)
    hf.save_pretrained(target)
    return target, hf


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_tokenizer) -> SimpleNamespace:
    """An eight-layer tiny random Llama (the served model; its projections scaled up so that its greedy outputs vary
    and sometimes repeat a token) and a random EAGLE-3 head over a random 1024-token draft vocabulary."""
    target, hf = scaled_tiny_target(tmp_path_factory.mktemp("eagle3-target"), smollm2_tokenizer, LAYERS, 8)
    config = hf.config
    gen = torch.Generator().manual_seed(5)
    hot = torch.randperm(config.vocab_size, generator=gen)[:DRAFT_VOCAB].sort().values
    random_head = save_eagle3_head(tmp_path_factory.mktemp("eagle3-random"), config,
                                   head_weights(config.hidden_size, config.intermediate_size, DRAFT_VOCAB, gen), hot)
    return SimpleNamespace(target=target, hf=hf, config=config, random=random_head, hot=hot)


@pytest.fixture(scope="module")
def servers(models):
    """The plain server and one whose random EAGLE-3 head drafts."""
    with running_server(*COMMON, model=models.target) as plain, \
            running_server(*COMMON, *spec_flags("EAGLE3"), "--speculative-draft-model-path", models.random,
                           model=models.target) as spec:
        yield SimpleNamespace(plain=plain, spec=spec)


# ---- the head against the published math --------------------------------------------------------------------------
def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x [n, heads, dim] (rotate-half pairing, as Llama's checkpoints use)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions[:, None].float() * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    half = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
    return x * cos + half * sin


def reference_chain(w: dict, config, embed: torch.Tensor, hot: torch.Tensor, ids: list[int],
                    captured: torch.Tensor, start: int, steps: int) -> list[int]:
    """The head's greedy chain from plain torch: rows pair token i+1 with the captured states at position i
    (i >= start; fc maps them to the head's width) and then each draft token with the head's previous output;
    the whole causal sequence is recomputed for every draft token."""
    eps, theta = config.rms_norm_eps, config.rope_parameters["rope_theta"]
    head_dim = config.hidden_size // HEAD_HEADS
    tokens = list(ids[start + 1 :])
    states = [F.linear(c, w["fc.weight"]) for c in captured[start : len(ids) - 1]]
    chain: list[int] = []
    for _ in range(steps):
        n = len(tokens)
        h = torch.stack(states)
        x = torch.cat([rms(embed[tokens], w["midlayer.input_layernorm.weight"], eps),
                       rms(h, w["midlayer.hidden_norm.weight"], eps)], -1)
        positions = torch.arange(start, start + n)
        q, k, v = (F.linear(x, w[f"midlayer.self_attn.{p}_proj.weight"]).view(n, HEAD_HEADS, head_dim)
                   for p in "qkv")
        q, k = rope(q, positions, theta), rope(k, positions, theta)
        scores = torch.einsum("qhd,khd->hqk", q, k) / head_dim**0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
        r = F.linear(attn, w["midlayer.self_attn.o_proj.weight"]) + h
        m = rms(r, w["midlayer.post_attention_layernorm.weight"], eps)
        out = F.linear(F.silu(F.linear(m, w["midlayer.mlp.gate_proj.weight"])) *
                       F.linear(m, w["midlayer.mlp.up_proj.weight"]), w["midlayer.mlp.down_proj.weight"]) + r
        logits = F.linear(rms(out[-1], w["norm.weight"], eps), w["lm_head.weight"])
        chain.append(int(hot[logits.argmax()]))
        tokens.append(chain[-1])
        states.append(out[-1])
    return chain


class DecodingReq:
    """What the head reads of a request: its tokens, its row in the served model's memory, its draft state."""

    def __init__(self, ids: list[int], row: int) -> None:
        self.origin_input_ids, self.output_ids = ids[:-1], ids[-1:]
        self.spec_state, self.req_pool_idx = None, row

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids


def test_head_and_capture_match_reference(models):
    """The served model (a real runner) captures transformers' states of layers 2, 4, 5 through its hidden-state
    sink, in a prompt forward and in verify-like decode rows; the head's proposals from them, from the first
    position or a later one and in one catch-up forward or several, are the plain-torch chain; verification frees
    the draft rows and release everything."""
    from safetensors.torch import load_file

    from sglang.srt.mem_cache.memory_pools import build_memory_pools
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.speculative.draft_model import DraftModel
    from sglang.srt.speculative.eagle_draft import EagleDraft

    runner = ModelRunner(models.target, models.config, torch.float32, "cpu")
    mem = build_memory_pools(runner.kv_cache_spec(), runner.device, 512, 256, 0.5, 2, True)
    runner.bind_kv_pool(mem.kv_pool)
    args = ServerArgs(model_path=models.target, dtype="float32", speculative_algorithm="EAGLE3",
                      speculative_draft_model_path=models.random, speculative_num_steps=STEPS)
    args.validate()
    draft = EagleDraft.load_eagle(args, runner, context_len=512, target_tokens=256, max_requests=2)
    assert runner.model.model.layers_to_capture == CAPTURED and "1024 draft tokens" in draft.description
    ids = list(range(300, 330))
    want = captured_states(models.hf, ids)
    row = mem.req_to_token_pool.alloc()
    mem.req_to_token_pool.req_to_token[row, : len(ids)] = mem.alloc_slots(len(ids))
    feeder = DraftModel(runner, mem, 512, 4096, "served model")
    for parts in ([(row, 0, ids[:-4])], [(row, len(ids) - 4, ids[-4:])]):  # a prompt, then four verify-like rows
        forward_batch, _ = feeder._forward_batch(parts)
        runner.forward(forward_batch, None)
    got = draft.hidden.get(row, 0, len(ids))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    runner.model.model.layers_to_capture = ()  # as a model loaded by a weight update: its forward captures nothing,
    runner.forward(forward_batch, None)  # is not recorded, and has the capture set again for the next one
    assert runner.model.model.layers_to_capture == CAPTURED and draft.hidden.get(row, 0, len(ids)).equal(got)

    weights = load_file(str(Path(models.random) / "model.safetensors"))
    embed = models.hf.model.embed_tokens.weight.detach()
    for start, chunk in ((0, 4096), (6, 4096), (0, 7)):  # chunk 7: the catch-up in forwards of at most 7 rows
        draft.chunk = chunk
        req = DecodingReq(ids, row)
        draft.hidden.drop(row)
        draft.hidden.write(row, start, want[start : len(ids) - 1])
        [proposal] = draft.propose([req], [STEPS])
        assert proposal == reference_chain(weights, models.config, embed, models.hot, ids, want, start, STEPS)
        assert all(t in set(models.hot.tolist()) for t in proposal)
        check_draft_slots(draft, req, len(ids) - 1 - start, 1)


# ---- through the server and the engine ---------------------------------------------------------------------------
def test_greedy_equals_plain_decoding(servers):
    """Greedy cases (short, cut by max_new_tokens, streamed, a JSON schema, a stop string), all at once on the
    EAGLE3 server: the plain server's tokens, finish reasons and texts."""
    got = greedy_cases_match(servers.plain, servers.spec)
    constrained = got[len(PROMPTS) + 3]["text"]
    assert constrained.startswith("{") and '"name"' in constrained
    assert all(g["meta_info"]["spec_verify_ct"] > 0 for g in got if g["meta_info"]["completion_tokens"] > 1)
    assert_clean(servers.spec)


def test_copy_head_engine_with_token_map(servers, models, tmp_path):
    """A copying head without d2t, its draft ids from --speculative-token-map (a draft vocabulary holding the
    served model's outputs), in-process: outputs equal plain decoding (a JSON schema and a stop string among them,
    prompts longer than a prefill chunk), the head's proposals are accepted where the served model repeats a token
    and rejected elsewhere, and both KV pools end idle."""
    base = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    text = generate(servers.plain, PROMPTS[2], base)["text"]
    jobs = [(p, base) for p in [*PROMPTS, " ".join(PROMPTS)]]
    jobs += [(PROMPTS[2], {**base, "stop": [text[len(text) // 2 :][:3]]}),
             (PROMPTS[3], {**base, "json_schema": json.dumps(SCHEMA), "max_new_tokens": 40}),
             (PROMPTS[0], {**base, "max_new_tokens": 2})]
    want = [generate(servers.plain, p, q) for p, q in jobs]
    seen = sorted({t for w in want for t in w["output_ids"]})
    gen = torch.Generator().manual_seed(9)
    fill = [t for t in torch.randperm(models.config.vocab_size, generator=gen).tolist() if t not in set(seen)]
    hot = torch.tensor(sorted([*seen, *fill[: DRAFT_VOCAB - len(seen)]]))
    embed = models.hf.model.embed_tokens.weight.detach()
    config = models.config
    head = save_eagle3_head(tmp_path / "copy", config, copy_weights(config.hidden_size, config.intermediate_size,
                                                                    embed[hot]), hot, maps=False)
    token_map = tmp_path / "map.pt"
    torch.save(hot.tolist(), token_map)
    for topk in (1, 2):  # a chain, then a tree from the head's top 2 per step
        engine = Engine(model_path=models.target, dtype="float32", max_total_tokens=4096,
                        speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                        speculative_token_map=str(token_map), speculative_num_steps=STEPS,
                        speculative_eagle_topk=topk, chunked_prefill_size=16)
        try:
            got = []
            for part in (jobs[:6], jobs[6:]):  # at most 8 running requests: speculation stays on (SPEC_MAX_BATCH)
                got += engine.generate(prompt=[p for p, _ in part], sampling_params=[q for _, q in part])
            assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
            assert [g["text"] for g in got] == [w["text"] for w in want]
            assert got[-3]["meta_info"]["finish_reason"]["type"] == "stop"
            assert got[-2]["text"].startswith("{")
            repeats = sum(a == b for w in want for a, b in zip(w["output_ids"], w["output_ids"][1:]))
            accepted = sum(g["meta_info"]["spec_accepted_draft_tokens"] for g in got)
            proposed = sum(g["meta_info"]["spec_verify_ct"] for g in got) * STEPS
            assert repeats > 0 and 0 < accepted and (topk > 1 or accepted < proposed), (repeats, accepted, proposed)
            assert_engine_idle(engine)
        finally:
            engine.shutdown()


# ---- malformed heads and maps --------------------------------------------------------------------------------------
def _load(models, head: str, token_map: Optional[str] = None):
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.speculative.eagle3_head import load_eagle3_runner

    runner = ModelRunner(models.target, models.config, torch.float32, "cpu")
    return load_eagle3_runner(head, runner, token_map)


def test_token_map_overrides_d2t(models, tmp_path):
    """--speculative-token-map replaces the checkpoint's d2t; without either a reduced head is refused."""
    from safetensors.torch import load_file

    runner, _, layers = _load(models, models.random)
    assert runner.hot_ids.tolist() == models.hot.tolist() and layers == CAPTURED
    other = models.hot.flip(0)
    torch.save(other, tmp_path / "map.pt")
    runner, _, _ = _load(models, models.random, str(tmp_path / "map.pt"))
    assert runner.hot_ids.tolist() == other.tolist()
    weights = load_file(str(Path(models.random) / "model.safetensors"))
    bare = save_eagle3_head(tmp_path / "bare", models.config,
                            {k: v for k, v in weights.items() if k not in ("d2t", "t2d")}, models.hot, maps=False)
    with pytest.raises(ValueError, match="no d2t tensor .*--speculative-token-map"):
        _load(models, bare)


@pytest.mark.parametrize("case, message", [
    ("fc", "fc.weight is shape \\[32, 64\\], expected \\[32, 96\\]"),
    ("lm_head", "lm_head.weight is shape \\[1000, 32\\], expected \\[1024, 32\\]"),
    ("qkv", "midlayer.self_attn.q_proj.weight"),
    ("d2t", "d2t has shape \\[1000\\]"),
    ("d2t_range", "d2t: maps draft ids to token ids outside"),
    ("t2d", "t2d has shape \\[7\\]"),
    ("layers", "eagle_aux_hidden_state_layer_ids \\[1, 2, 7\\]"),
    ("arch", "not an EAGLE3 head"),
    ("map_length", "--speculative-token-map .*: 5 token ids, the head's draft vocabulary has 1024"),
    ("map_float", "--speculative-token-map .*: expected a 1-D list of integer token ids"),
    ("map_junk", "--speculative-token-map .*: cannot read it"),
])
def test_malformed_heads_and_maps_are_refused(models, tmp_path, case, message):
    from safetensors.torch import load_file

    weights = load_file(str(Path(models.random) / "model.safetensors"))
    hot, extra, token_map = models.hot, {}, None
    if case == "fc":
        weights["fc.weight"] = weights["fc.weight"][:, :64]
    elif case == "lm_head":
        weights["lm_head.weight"] = weights["lm_head.weight"][:1000]
    elif case == "qkv":
        weights["midlayer.self_attn.q_proj.weight"] = weights["midlayer.self_attn.q_proj.weight"][:, :32]
    elif case == "layers":
        extra = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 7]}}
    elif case == "arch":
        extra = {"architectures": ["LlamaForCausalLMEagle"]}
    elif case.startswith("map"):
        token_map = str(tmp_path / "map.pt")
        if case == "map_junk":
            Path(token_map).write_text("not a tensor")
        else:
            torch.save(torch.arange(5) if case == "map_length" else hot.float(), token_map)
    head = save_eagle3_head(tmp_path / "head", models.config, {k: v for k, v in weights.items()
                                                               if k not in ("d2t", "t2d")}, hot, **extra)
    if case in ("d2t", "d2t_range", "t2d"):  # rewrite the maps themselves
        from safetensors.torch import save_file

        tensors = load_file(str(Path(head) / "model.safetensors"))
        if case == "d2t":
            tensors["d2t"] = tensors["d2t"][:1000]
        elif case == "d2t_range":
            tensors["d2t"] = tensors["d2t"] + models.config.vocab_size
        else:
            tensors["t2d"] = tensors["t2d"][:7]
        save_file(tensors, str(Path(head) / "model.safetensors"))
    flag = "--speculative-token-map" if case.startswith("map") else "--speculative-draft-model-path"
    with pytest.raises(ValueError, match=f"{flag} .*{message}" if not case.startswith("map") else message):
        _load(models, head, token_map)


def test_startup_errors_through_the_engine(models, tmp_path):
    """A malformed token map fails the Engine's startup with the flag's message."""
    torch.save(torch.arange(5), tmp_path / "short.pt")
    with pytest.raises(Exception, match="--speculative-token-map .*5 token ids"):
        Engine(model_path=models.target, dtype="float32", max_total_tokens=1024, speculative_algorithm="EAGLE3",
               speculative_draft_model_path=models.random, speculative_token_map=str(tmp_path / "short.pt"))


@pytest.mark.parametrize("argv, message", [
    (["--speculative-algorithm", "EAGLE3"], "needs --speculative-draft-model-path"),
    (["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "d", "--speculative-token-map", "m.pt"],
     "--speculative-token-map is only used with --speculative-algorithm EAGLE3"),
    (["--speculative-token-map", "m.pt"], "--speculative-token-map is only used with"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d", "--speculative-token-map",
      "/nonexistent/map.pt"], "--speculative-token-map /nonexistent/map.pt: no such file"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d", "--speculative-eagle-topk", "2",
      "--speculative-num-steps", "2", "--speculative-num-draft-tokens", "20"], "--speculative-num-draft-tokens"),
])
def test_flag_validation(argv, message):
    assert_refused(argv, message)
