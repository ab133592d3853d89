"""Speculative decoding with an EAGLE head (--speculative-algorithm EAGLE): heads built here in the published EAGLE-1
layout (config.json + fc / layers.0 weights) draft from the served model's hidden states; greedy outputs equal plain
decoding token for token, a head fitted to the served model has most drafts accepted, the head's KV pool is back to
idle afterwards, and a head that does not fit the served model is refused at startup naming the flag."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from sglang import Engine
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.args import check_speculative_args
from tests.conftest import save_tiny_llama
from tests.server_fixtures import running_server
from tests.test_speculative_ngram import assert_clean, generate
from tests.test_speculative_standalone import COMMON, PROMPTS, STEPS, assert_engine_idle, greedy_cases_match, spec_flags

SPEC_FLAGS = spec_flags("EAGLE")


def save_eagle_head(path: Path, config, fc: torch.Tensor, fc_bias: torch.Tensor, layer_state: dict,
                    extra: Optional[dict] = None) -> str:
    """An EAGLE-1 head in its published layout: config.json (architectures LlamaForCausalLMEagle, one layer) and
    fc.weight / fc.bias / layers.0.* (and `extra` weights) in model.safetensors."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    head_config = config.to_dict()
    head_config.update(architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1)
    (path / "config.json").write_text(json.dumps(head_config))
    weights = {"fc.weight": fc, "fc.bias": fc_bias}
    weights.update({f"layers.0.{name}": tensor for name, tensor in layer_state.items()})
    weights.update(extra or {})
    save_file({name: t.contiguous() for name, t in weights.items()}, str(path / "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_tokenizer) -> SimpleNamespace:
    """A one-layer tiny random Llama (the target) whose embedding rows have unit RMS, so that its layer's input
    norm (weight 1) leaves them as they are; a random EAGLE head; and a head fitted to the target: its layer is the
    target's layer and fc passes the token embedding through, so it computes the target's next-token choice from
    the tokens it has seen (all but the first: its rows pair token i+1 with position i)."""
    from transformers import LlamaForCausalLM

    target = save_tiny_llama(tmp_path_factory.mktemp("eagle-target"), smollm2_tokenizer,
                             max_position_embeddings=512, num_hidden_layers=1)
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.div_(embed.pow(2).mean(-1, keepdim=True).sqrt())
    model.save_pretrained(target)
    config = model.config
    hidden = config.hidden_size
    target_layer = {name: t.clone() for name, t in model.model.layers[0].state_dict().items()}
    fitted = save_eagle_head(tmp_path_factory.mktemp("eagle-fitted"), config,
                             torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1),
                             torch.zeros(hidden), target_layer)
    gen = torch.Generator().manual_seed(3)
    random_layer = {name: torch.randn(t.shape, generator=gen) * (0.2 if t.dim() > 1 else 1.0)
                    for name, t in target_layer.items()}
    random_head = save_eagle_head(tmp_path_factory.mktemp("eagle-random"), config,
                                  torch.randn(hidden, 2 * hidden, generator=gen) * 0.2,
                                  torch.randn(hidden, generator=gen) * 0.1, random_layer)
    return SimpleNamespace(target=target, fitted=fitted, random=random_head, config=config)


@pytest.fixture(scope="module")
def servers(models):
    """The plain server and one whose random head drafts."""
    with running_server(*COMMON, model=models.target) as plain, \
            running_server(*COMMON, *SPEC_FLAGS, "--speculative-draft-model-path", models.random,
                           model=models.target) as spec:
        yield SimpleNamespace(plain=plain, spec=spec)


@pytest.fixture(scope="module")
def fitted_engine(models):
    """The fitted head drafting in-process (its internal state shows the head's KV pool); prompts longer than 16
    tokens prefill in chunks, whose hidden states the head reads as one sequence."""
    engine = Engine(model_path=models.target, dtype="float32", max_total_tokens=4096, speculative_algorithm="EAGLE",
                    speculative_draft_model_path=models.fitted, speculative_num_steps=STEPS, decode_log_interval=1,
                    chunked_prefill_size=16)
    yield engine
    engine.shutdown()


def test_greedy_equals_plain_decoding(servers):
    got = greedy_cases_match(servers.plain, servers.spec)
    constrained = got[len(PROMPTS) + 3]["text"]  # follows the schema (cut by max_new_tokens)
    assert constrained.startswith("{") and '"name"' in constrained
    for g in got:
        meta = g["meta_info"]
        if meta["completion_tokens"] > 1:
            assert meta["spec_verify_ct"] > 0
    assert_clean(servers.spec)


def test_fitted_head_accepts_drafts(servers, fitted_engine):
    """The fitted head predicts the served model's choices: outputs equal plain decoding and most verify steps keep
    draft tokens; with cuts by stop string and max_new_tokens in one batch, both pools return to idle."""
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    accepted = verify = 0
    for prompt in [*PROMPTS[:4], " ".join(PROMPTS)]:
        want = generate(servers.plain, prompt, params)
        got = fitted_engine.generate(prompt=prompt, sampling_params=params)
        assert got["output_ids"] == want["output_ids"], prompt
        meta = got["meta_info"]
        # every decode forward is counted once; each gains its accepted draft tokens plus one
        assert meta["spec_verify_ct"] + meta["spec_accepted_draft_tokens"] == meta["completion_tokens"] - 1
        accepted += meta["spec_accepted_draft_tokens"]
        verify += meta["spec_verify_ct"]
    assert accepted > verify, (accepted, verify)
    assert 1.0 < fitted_engine.get_internal_state()["spec_accept_length"] <= STEPS + 1
    assert_engine_idle(fitted_engine)
    batch = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (5, 30, 30, 2, 1, 17, 24, 9)]
    text = generate(servers.plain, PROMPTS[2], batch[2])["text"]
    batch[2] = {**batch[2], "stop": [text[len(text) // 2:][:2]]}
    want = [generate(servers.plain, p, q) for p, q in zip(PROMPTS, batch)]
    got = fitted_engine.generate(prompt=PROMPTS, sampling_params=batch)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert got[2]["meta_info"]["finish_reason"]["type"] == "stop"
    assert sum(o["meta_info"]["spec_accepted_draft_tokens"] for o in got) > 0
    assert_engine_idle(fitted_engine)


def test_fitted_head_drafts_trees(servers, models):
    """With --speculative-eagle-topk 2 the fitted head drafts trees (its beams carry their own hidden states):
    greedy and seeded outputs in one batch equal plain decoding, drafts are accepted, the pools end idle."""
    engine = Engine(model_path=models.target, dtype="float32", max_total_tokens=4096, speculative_algorithm="EAGLE",
                    speculative_draft_model_path=models.fitted, speculative_num_steps=STEPS, speculative_eagle_topk=2,
                    speculative_num_draft_tokens=7, chunked_prefill_size=16)
    try:
        jobs = [(p, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}) for p in PROMPTS[:5]]
        jobs += [(p, {"temperature": 0.7, "top_k": 4, "max_new_tokens": 24, "sampling_seed": 3 + i,
                      "ignore_eos": True}) for i, p in enumerate(PROMPTS[5:8])]
        want = [generate(servers.plain, p, q) for p, q in jobs]
        got = engine.generate(prompt=[p for p, _ in jobs], sampling_params=[q for _, q in jobs])
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        meta = [o["meta_info"] for o in got]
        assert sum(m["spec_accepted_draft_tokens"] for m in meta) > sum(m["spec_verify_ct"] for m in meta)
        assert_engine_idle(engine)
    finally:
        engine.shutdown()


def test_seeded_sampling_equals_plain_decoding(servers, fitted_engine):
    """Seeded sampled requests mixed with a greedy one in one batch: each position's token is plain decoding's draw,
    so the outputs are the plain server's."""
    jobs = [(p, {"temperature": 0.7, "top_k": 4, "max_new_tokens": 24, "sampling_seed": 11 + i, "ignore_eos": True})
            for i, p in enumerate(PROMPTS[:4])]
    jobs += [(PROMPTS[5], {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})]
    with ThreadPoolExecutor(len(jobs)) as pool:
        want = list(pool.map(lambda c: generate(servers.plain, *c), jobs))
    got = fitted_engine.generate(prompt=[p for p, _ in jobs], sampling_params=[q for _, q in jobs])
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert sum(o["meta_info"]["spec_accepted_draft_tokens"] for o in got) > 0  # speculation ran in this batch
    assert_engine_idle(fitted_engine)


def test_hidden_log_spans():
    """Prompt chunks continue a row's span where it ends, decode rows extend or overwrite it (a verify step's
    rejected rows are rewritten), and any other write starts a new span (a new request in the row)."""
    from sglang.srt.forward_batch import ForwardMode
    from sglang.srt.speculative.hidden_log import HiddenLog

    def extend(row: int, prefix: int, n: int, value: float):
        return SimpleNamespace(forward_mode=ForwardMode.EXTEND, req_pool_indices=torch.tensor([row]),
                               extend_prefix_lens_cpu=[prefix], extend_seq_lens_cpu=[n]), torch.full((n, 2), value)

    def decode(rows: list[int], positions: list[int], values: list[float]):
        return (SimpleNamespace(forward_mode=ForwardMode.DECODE, req_pool_indices=torch.tensor(rows),
                                positions=torch.tensor(positions)), torch.tensor(values)[:, None].repeat(1, 2))

    log = HiddenLog()
    log.record(*extend(1, 0, 3, 1.0))
    log.record(*extend(1, 3, 2, 2.0))  # the next chunk of the same prompt
    log.record(*decode([1, 1, 1, 2], [5, 6, 7, 4], [3.0, 4.0, 5.0, 9.0]))  # three verify rows of row 1, one of row 2
    log.record(*decode([1, 1], [6, 7], [6.0, 7.0]))  # positions 6, 7 recomputed after a rejection
    assert log.first(1, 8) == 0 and log.first(1, 9) is None
    assert log.get(1, 0, 8)[:, 0].tolist() == [1, 1, 1, 2, 2, 3, 6, 7]
    assert log.first(2, 5) == 4  # row 2 has a hidden state from position 4 only
    log.record(*extend(1, 4, 3, 8.0))  # a new request in row 1 whose first 4 tokens came from the prefix cache
    assert log.first(1, 7) == 4 and log.get(1, 4, 7)[:, 0].tolist() == [8, 8, 8]
    log.record(*decode([2], [9], [1.0]))  # a gap in row 2: its span restarts there
    assert log.first(2, 10) == 9
    log.drop(2)
    assert log.first(2, 10) is None
    # a tree's verify step: row 1's main path at positions 7, 8; a branch ran in spare row 5 at 7, 8 and was accepted
    log.record(*decode([1, 5, 1, 5, 1], [6, 7, 7, 8, 8], [10.0, 21.0, 11.0, 22.0, 12.0]))
    log.adopt(1, [7, 8], [5, 5])
    assert log.get(1, 6, 9)[:, 0].tolist() == [10, 21, 22]


class DecodingReq:
    """What the head reads of a request: its tokens, its row in the served model's memory, its draft state."""

    def __init__(self, origin_input_ids: list[int], output_ids: list[int]) -> None:
        self.origin_input_ids, self.output_ids = origin_input_ids, output_ids
        self.spec_state, self.req_pool_idx = None, 1

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids



def check_draft_slots(draft, req, base: int, kept: int) -> None:
    """A chain of STEPS drafted after a catch-up of `base` tokens holds base + STEPS - 1 draft KV slots; settling
    `kept` tokens leaves the catch-up's, releasing the request none."""
    assert draft.used_tokens() == base + STEPS - 1
    draft.settle(req, kept)
    assert draft.used_tokens() == base
    draft.release(req)
    assert draft.used_tokens() == 0 and draft.idle_error() is None and req.spec_state is None

def reference_chain(models, ids: list[int], target_hidden: torch.Tensor, start: int, steps: int) -> list[int]:
    """The head's greedy chain computed with transformers' decoder layer (input norm the identity), recomputing the
    whole causal sequence of pairs (token i+1, hidden i) at positions i >= start for every draft token."""
    from safetensors.torch import load_file
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer as HFLayer
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    weights = load_file(str(Path(models.random) / "model.safetensors"))
    config = models.config
    config._attn_implementation = "eager"
    layer = HFLayer(config, 0).eval()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in weights.items() if k.startswith("layers.0.")})
    layer.input_layernorm = torch.nn.Identity()
    rotary = LlamaRotaryEmbedding(config)
    from transformers import LlamaForCausalLM

    embed = LlamaForCausalLM.from_pretrained(models.target, dtype=torch.float32).model.embed_tokens.weight.detach()
    tokens, hiddens = list(ids[start + 1 :]), [h for h in target_hidden[start : len(ids) - 1]]
    chain: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            x = torch.nn.functional.linear(torch.cat([embed[tokens], torch.stack(hiddens)], -1), weights["fc.weight"],
                                           weights["fc.bias"])[None]
            n = x.shape[1]
            positions = torch.arange(start, start + n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = layer(x, attention_mask=mask, position_ids=positions,
                        position_embeddings=rotary(x, positions))
            out = out[0] if isinstance(out, tuple) else out
            last = out[0, -1]
            chain.append(int((embed @ last).argmax()))
            tokens.append(chain[-1])
            hiddens.append(last)
    return chain


def test_head_proposals_match_reference(models, tmp_path):
    """The head's proposals are its greedy chain as transformers computes it from the served model's final hidden
    states, from the first position or from a later one (a prefix served from the radix cache), in one catch-up
    forward or several; a proposal holds the catch-up rows and the draft rows, verification frees the draft rows,
    release frees everything."""
    from types import SimpleNamespace as Runner

    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from sglang.srt.model_loader.loader import load_model
    from sglang.srt.speculative.eagle_draft import EagleDraft

    hf = LlamaForCausalLM.from_pretrained(models.target, dtype=torch.float32).eval()
    target = Runner(model=load_model(models.target, torch.float32, "cpu"), hf_config=models.config,
                    dtype=torch.float32, device=torch.device("cpu"), arithmetic=None, decode_plan=None,
                    hidden_sink=None)
    args = ServerArgs(model_path=models.target, dtype="float32", speculative_algorithm="EAGLE",
                      speculative_draft_model_path=models.random, speculative_num_steps=STEPS)
    args.validate()
    draft = EagleDraft.load_eagle(args, target, context_len=512, target_tokens=256, max_requests=2)
    assert target.hidden_sink == draft.hidden.record
    ids = list(range(100, 120))
    with torch.no_grad():
        hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    for start, chunk in ((0, 4096), (5, 4096), (0, 6)):  # chunk 6: the catch-up in forwards of at most 6 rows
        draft.chunk = chunk
        req = DecodingReq(ids[:-1], [ids[-1]])
        draft.hidden.drop(1)
        draft.hidden.write(1, start, hidden[start : len(ids) - 1])
        [proposal] = draft.propose([req], [STEPS])
        assert proposal == reference_chain(models, ids, hidden, start, STEPS), start
        check_draft_slots(draft, req, len(ids) - 1 - start, 2)
    # a head with its own embedding and LM head (here the served model's tied embedding) drafts the same chain
    weights = load_file(str(Path(models.random) / "model.safetensors"))
    layer = {name[len("layers.0."):]: t for name, t in weights.items() if name.startswith("layers.0.")}
    embed = hf.model.embed_tokens.weight.detach()
    own = save_eagle_head(tmp_path / "own", models.config, weights["fc.weight"], weights["fc.bias"], layer,
                          extra={"embed_tokens.weight": embed, "lm_head.weight": embed.clone()})
    args.speculative_draft_model_path = own
    draft = EagleDraft.load_eagle(args, target, context_len=512, target_tokens=256, max_requests=2)
    assert "own embedding, own LM head" in draft.description
    req = DecodingReq(ids[:-1], [ids[-1]])
    draft.hidden.write(1, 0, hidden[: len(ids) - 1])
    assert draft.propose([req], [STEPS]) == [reference_chain(models, ids, hidden, 0, STEPS)]


def test_mismatched_heads_are_refused(models, tmp_path):
    from transformers import LlamaConfig

    wide = LlamaConfig(**{**models.config.to_dict(), "hidden_size": 48})
    wide_head = save_eagle_head(tmp_path / "wide", wide, torch.zeros(48, 96), torch.zeros(48), _layer_of(wide))
    config = models.config
    size = config.hidden_size
    wrong_fc = save_eagle_head(tmp_path / "wrong-fc", config, torch.zeros(size, size), torch.zeros(size),
                               _layer_of(config))
    (tmp_path / "not-eagle").mkdir()
    (tmp_path / "not-eagle" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    for head, message in ((wide_head, "hidden size"), (wrong_fc, "fc.weight"), (str(tmp_path / "not-eagle"),
                                                                               "not an EAGLE head")):
        with pytest.raises(Exception, match=f"--speculative-draft-model-path .*{message}"):
            Engine(model_path=models.target, dtype="float32", max_total_tokens=1024, speculative_algorithm="EAGLE",
                   speculative_draft_model_path=head)


def _layer_of(config) -> dict:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return dict(LlamaDecoderLayer(config, 0).state_dict())


@pytest.mark.parametrize("argv, message", [
    ({"speculative_algorithm": "EAGLE"}, "--speculative-draft-model-path"),
    ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "d", "speculative_eagle_topk": -1},
     "--speculative-eagle-topk"),
    ({"speculative_algorithm": "NEXTN", "speculative_draft_model_path": "d"}, "not supported yet"),
])
def test_flag_validation(argv, message):
    with pytest.raises(ValueError, match=message):
        check_speculative_args(ServerArgs(model_path="m", **argv))


def test_eagle_defaults():
    args = ServerArgs(model_path="m", speculative_algorithm="eagle", speculative_draft_model_path="d")
    check_speculative_args(args)
    assert (args.speculative_algorithm, args.speculative_num_steps, args.speculative_num_draft_tokens) == \
        ("EAGLE", 3, 4)
