"""Speculative decoding with a draft model (--speculative-algorithm STANDALONE): greedy and seeded outputs equal plain
decoding token for token, a draft equal to the target has every draft token accepted, both KV pools are clean
afterwards, and bad flags or drafts are refused at startup naming the flag."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from sglang import Engine
from sglang.srt.server_args import ServerArgs, prepare_server_args
from sglang.srt.speculative.draft_model import DraftModel
from tests.conftest import save_tiny_llama
from tests.server_fixtures import running_server
from tests.test_speculative_ngram import assert_clean, assert_refused, generate, spec_accept_lengths

STEPS = 3


def spec_flags(algorithm: str) -> tuple[str, ...]:
    """A chain of STEPS draft tokens per step with `algorithm`, SGLang's flags spelled out."""
    return ("--speculative-algorithm", algorithm, "--speculative-num-steps", str(STEPS), "--speculative-eagle-topk",
            "1", "--speculative-num-draft-tokens", str(STEPS + 1))


SPEC_FLAGS = spec_flags("STANDALONE")
COMMON = ("--max-total-tokens", "4096", "--dtype", "float32")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n",
           "Alice went to the market to buy apples, bread and milk.", "1, 2, 3, 4, 5, 6, 7, 8",
           "Roses are red, violets are blue", "SELECT name FROM users WHERE", "Once upon a time", "Hello"]


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_tokenizer) -> SimpleNamespace:
    return target_and_draft(tmp_path_factory, smollm2_tokenizer)


def target_and_draft(tmp_path_factory, smollm2_tokenizer) -> SimpleNamespace:
    """A two-layer tiny random Llama (the target) and a draft made from it by perturbing its weights, so that the
    draft agrees with the target on some tokens and not on others."""
    from transformers import LlamaForCausalLM

    target = save_tiny_llama(tmp_path_factory.mktemp("spec-target"), smollm2_tokenizer,
                             max_position_embeddings=512, num_hidden_layers=2)
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.weight"):
                param.add_(torch.randn(param.shape, generator=gen) * param.std() * 0.6)
    draft = str(tmp_path_factory.mktemp("spec-draft"))
    model.save_pretrained(draft)
    smollm2_tokenizer.save_pretrained(draft)
    return SimpleNamespace(target=target, draft=draft)


@pytest.fixture(scope="module")
def servers(models):
    with running_server(*COMMON, model=models.target) as plain, \
            running_server(*COMMON, *SPEC_FLAGS, "--speculative-draft-model-path", models.draft, "--enable-metrics",
                           "--decode-log-interval", "5", model=models.target) as spec:
        yield plain, spec


def cases() -> list[tuple[str, dict, bool]]:
    """(prompt, sampling params, streamed): plain greedy runs and the cuts speculation must respect."""
    base = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    out = [(p, base, False) for p in PROMPTS]
    out += [(PROMPTS[0], {**base, "max_new_tokens": STEPS - 1}, False),
            (PROMPTS[1], {**base, "max_new_tokens": 1}, False),
            (PROMPTS[2], {**base, "max_new_tokens": 40}, True),
            (PROMPTS[3], {**base, "json_schema": json.dumps(SCHEMA), "max_new_tokens": 40}, False)]
    return out


def greedy_cases_match(plain: str, spec: str) -> list[dict]:
    """`cases()` plus a stop string the plain output contains, on the plain server one at a time and on the
    speculative one all at once: the same tokens, finish reasons and (unstreamed) texts. The speculative results."""
    want = [generate(plain, p, params) for p, params, _ in cases()]
    # a stop string the plain output contains, cut at the same token by the speculative server
    text = want[2]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stop_case = (PROMPTS[2], {"temperature": 0, "max_new_tokens": 24, "stop": [stop]}, False)
    all_cases = [*cases(), stop_case]
    want.append(generate(plain, *stop_case[:2]))
    assert want[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    with ThreadPoolExecutor(len(all_cases)) as pool:
        got = list(pool.map(lambda c: generate(spec, c[0], c[1], stream=c[2]), all_cases))
    for (prompt, params, stream), w, g in zip(all_cases, want, got):
        assert g["output_ids"] == w["output_ids"], (prompt, params)
        assert g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"]
        if not stream:
            assert g["text"] == w["text"]
    return got


def assert_engine_idle(engine: Engine) -> None:
    """Both KV pools back to idle (the served model's and the draft's), no invariant error."""
    state = engine.get_internal_state()
    assert state["invariant_error"] is None
    assert state["spec_draft_used_kv_tokens"] == 0
    assert state["free_kv_tokens"] + state["evictable_size"] == state["max_total_num_tokens"]


def test_greedy_equals_plain_decoding(servers):
    plain, spec = servers
    got = greedy_cases_match(plain, spec)
    assert got[len(PROMPTS) + 3]["text"].startswith('{ "name":')  # the constrained output follows the schema
    assert all(g["meta_info"]["spec_verify_ct"] > 0 for g in got if g["meta_info"]["completion_tokens"] > 1)
    assert sum(g["meta_info"]["spec_accepted_draft_tokens"] for g in got) > 0
    assert_clean(spec)


def test_sequential_requests_and_logprobs_match(servers):
    plain, spec = servers
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    extra = {"return_logprob": True, "top_logprobs_num": 2}
    accepted = rejected = 0
    for prompt in PROMPTS[:4]:
        want = generate(plain, prompt, params, **extra)
        got = generate(spec, prompt, params, **extra)
        assert got["output_ids"] == want["output_ids"], prompt
        w, g = want["meta_info"]["output_token_logprobs"], got["meta_info"]["output_token_logprobs"]
        assert [t[1] for t in g] == [t[1] for t in w]
        assert [t[0] for t in g] == pytest.approx([t[0] for t in w], abs=1e-3)
        meta = got["meta_info"]
        # every decode forward is counted once; each gains its accepted draft tokens plus one
        assert meta["spec_verify_ct"] + meta["spec_accepted_draft_tokens"] == meta["completion_tokens"] - 1
        accepted += meta["spec_accepted_draft_tokens"]
        rejected += meta["spec_verify_ct"] * STEPS - meta["spec_accepted_draft_tokens"]
    # the perturbed draft agrees with the target on some tokens, not all: acceptance and rejection both happen
    assert accepted > 0 and rejected > 0
    values = spec_accept_lengths(spec)
    assert values and 1.0 < values[0] <= STEPS + 1
    assert_clean(spec)


def test_seeded_sampling_equals_plain_decoding(servers):
    seeded_sampling_matches(*servers, first_seed=11)


def seeded_sampling_matches(plain: str, spec: str, first_seed: int) -> None:
    """Seeded sampled requests and a greedy one at once: the speculative server's outputs are the plain one's, with
    drafts accepted for the sampled ones, and its KV pool ends clean."""
    # top_k 2: a random model's next-token distribution is nearly flat; drafts are accepted only where it is not
    jobs = [(p, {"temperature": 1.0, "top_k": 2, "max_new_tokens": 24, "sampling_seed": first_seed + i,
                 "ignore_eos": True}) for i, p in enumerate(PROMPTS[:4])]
    jobs += [(PROMPTS[5], {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})]
    with ThreadPoolExecutor(len(jobs)) as pool:
        want = list(pool.map(lambda c: generate(plain, *c), jobs))
        got = list(pool.map(lambda c: generate(spec, *c), jobs))
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert sum(o["meta_info"]["spec_accepted_draft_tokens"] for o in got[:4]) > 0
    assert_clean(spec)


@pytest.fixture(scope="module")
def same_draft_engine(models):
    """The target drafting for itself: every greedy draft token must be accepted."""
    engine = Engine(model_path=models.target, dtype="float32", max_total_tokens=4096,
                    speculative_algorithm="STANDALONE", speculative_draft_model_path=models.target,
                    speculative_num_steps=STEPS, decode_log_interval=1)
    yield engine
    engine.shutdown()


def test_draft_equal_to_target_accepts_every_token(same_draft_engine):
    for max_new in (1, 2, STEPS + 1, 17, 40, 1 + 2 * (STEPS + 1)):
        out = same_draft_engine.generate(prompt=PROMPTS[0], sampling_params={
            "temperature": 0, "max_new_tokens": max_new, "ignore_eos": True})
        meta = out["meta_info"]
        assert meta["completion_tokens"] == max_new
        # each verify step gains its whole draft (as long as max_new_tokens allows) plus the bonus token
        assert meta["spec_verify_ct"] == math.ceil((max_new - 1) / (STEPS + 1)), max_new
        assert meta["spec_accepted_draft_tokens"] == max_new - 1 - meta["spec_verify_ct"]
    # the last decode step (of the last request) took a whole draft
    assert same_draft_engine.get_internal_state()["spec_accept_length"] == STEPS + 1
    # a batch with cuts by stop string and max_new_tokens, then both pools are back to idle
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (5, 30, 30, 2)]
    first = same_draft_engine.generate(prompt=PROMPTS[2], sampling_params=params[2])["text"]
    params[2]["stop"] = [first[len(first) // 2 : len(first) // 2 + 2]]
    outs = same_draft_engine.generate(prompt=PROMPTS[:4], sampling_params=params)
    assert outs[2]["meta_info"]["finish_reason"]["type"] == "stop"
    assert_engine_idle(same_draft_engine)


class DecodingReq:
    """What the draft model reads of a request: its tokens, and where it keeps its draft state."""

    def __init__(self, origin_input_ids: list[int], output_ids: list[int]) -> None:
        self.origin_input_ids, self.output_ids, self.spec_state = origin_input_ids, output_ids, None

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_draft_proposals_and_memory(models, smollm2_tokenizer):
    """Proposals are the draft model's greedy continuation (transformers on the same checkpoint), whether the
    catch-up runs in one forward or in chunks; a proposal holds the catch-up and the draft tokens run, verification
    keeps the accepted ones, release frees everything."""
    from transformers import LlamaForCausalLM

    reference = LlamaForCausalLM.from_pretrained(models.draft, dtype=torch.float32).eval()
    args = ServerArgs(model_path=models.target, dtype="float32", speculative_algorithm="STANDALONE",
                      speculative_draft_model_path=models.draft, speculative_num_steps=STEPS)
    args.validate()
    draft = DraftModel.load(args, len(smollm2_tokenizer), smollm2_tokenizer, target_tokens=256, max_requests=2)
    ids = smollm2_tokenizer.encode(PROMPTS[2])
    req = DecodingReq(ids, [7])
    base = len(ids) + 1
    [proposal] = draft.propose([req], [STEPS])
    assert proposal == hf_greedy(reference, ids + [7], STEPS)
    assert draft.used_tokens() == base + STEPS - 1
    draft.settle(req, 1)  # one draft token kept: its K/V stays, the others' slots return
    assert draft.used_tokens() == base + 1
    req.output_ids += [proposal[0], 5]
    [again] = draft.propose([req], [STEPS])
    assert again == hf_greedy(reference, req.all_ids(), STEPS)
    assert draft.used_tokens() == base + 2 + STEPS - 1
    draft.release(req)
    assert draft.used_tokens() == 0 and draft.idle_error() is None and req.spec_state is None
    draft.chunk = 5  # the prompt's catch-up in forwards of 5 tokens
    assert draft.propose([req], [STEPS]) == [again]
    draft.release(req)
    # a draft whose memory cannot hold the request proposes nothing for it and holds nothing
    req.origin_input_ids = list(range(300))
    assert draft.propose([req], [STEPS]) == [[]] and draft.used_tokens() == 0


def test_bad_draft_models_are_refused(models, tmp_path):
    with pytest.raises(Exception, match="--speculative-draft-model-path"):
        Engine(model_path=models.target, dtype="float32", max_total_tokens=1024, speculative_algorithm="STANDALONE",
               speculative_draft_model_path=str(tmp_path / "missing"))
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "other-vocab")
    with pytest.raises(Exception, match="--speculative-draft-model-path .*vocabulary"):
        Engine(model_path=models.target, dtype="float32", max_total_tokens=1024, speculative_algorithm="STANDALONE",
               speculative_draft_model_path=str(tmp_path / "other-vocab"))


@pytest.mark.parametrize("argv, message", [
    (["--speculative-algorithm", "STANDALONE"], "--speculative-draft-model-path"),
    (["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "d", "--speculative-eagle-topk",
      "0"], "--speculative-eagle-topk"),
    (["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "d", "--speculative-eagle-topk",
      "2", "--speculative-num-steps", "1", "--speculative-num-draft-tokens", "4"], "--speculative-num-draft-tokens"),
    (["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "d", "--speculative-num-steps",
      "0"], "--speculative-num-steps"),
    (["--speculative-algorithm", "NGRAM", "--speculative-draft-model-path", "d"], "--speculative-draft-model-path"),
])
def test_flag_validation(argv, message):
    assert_refused(argv, message)


def test_num_draft_tokens_follows_num_steps():
    def parsed(*argv: str) -> ServerArgs:
        args = prepare_server_args(["--model-path", "m", "--speculative-algorithm", "standalone",
                                    "--speculative-draft-model-path", "d", *argv])
        args.validate()
        return args

    args = parsed()
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (3, 1, 4)
    assert parsed("--speculative-num-steps", "5").speculative_num_draft_tokens == 6
    assert parsed("--speculative-num-draft-tokens", "6").speculative_num_steps == 5
    adjusted = parsed("--speculative-num-steps", "2", "--speculative-num-draft-tokens", "8")
    assert (adjusted.speculative_num_steps, adjusted.speculative_num_draft_tokens) == (2, 3)
    # a tree: its nodes plus one, 8 by default (at most the nodes the search scores: 2 + 2 * 2 * 2 here)
    tree = parsed("--speculative-eagle-topk", "2", "--speculative-num-steps", "3")
    assert (tree.speculative_num_steps, tree.speculative_eagle_topk, tree.speculative_num_draft_tokens) == (3, 2, 8)
    assert parsed("--speculative-eagle-topk", "2", "--speculative-num-steps", "3",
                  "--speculative-num-draft-tokens", "11").speculative_num_draft_tokens == 11
    assert parsed("--speculative-eagle-topk", "2", "--speculative-num-steps", "1").speculative_num_draft_tokens == 3
