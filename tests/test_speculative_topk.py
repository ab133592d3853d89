"""Draft trees from a draft model (--speculative-eagle-topk above 1): the proposal is the search SGLang's EAGLE runs
(top-k per beam, the best-scoring nodes kept), checked against transformers on the same draft; through the server,
greedy and seeded outputs equal plain decoding and both KV pools end idle."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.draft_model import DraftModel
from tests.server_fixtures import running_server
from tests.test_speculative_standalone import (
    COMMON,
    PROMPTS,
    DecodingReq,
    greedy_cases_match,
    seeded_sampling_matches,
    target_and_draft,
)

TOPK, STEPS, NODES = 3, 3, 7
TREE_FLAGS = ("--speculative-algorithm", "STANDALONE", "--speculative-eagle-topk", str(TOPK),
              "--speculative-num-steps", str(STEPS), "--speculative-num-draft-tokens", str(NODES + 1))


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_tokenizer) -> SimpleNamespace:
    return target_and_draft(tmp_path_factory, smollm2_tokenizer)


def reference_tree(model, ids: list[int], topk: int, steps: int, size: int) -> dict[tuple[int, ...], float]:
    """The search in transformers: each kept node's token path and score (sum of log-probabilities)."""
    def top(seq: list[int]) -> tuple[list[int], list[float]]:
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([seq])).logits[0, -1].float(), -1)
        values, index = logprobs.topk(topk)
        return index.tolist(), values.tolist()

    nodes: list[tuple[tuple[int, ...], float]] = []
    tokens, values = top(ids)
    nodes += [((t,), v) for t, v in zip(tokens, values)]
    beams = list(range(len(nodes)))
    for _ in range(1, steps):
        found = []
        for n in beams:
            path, score = nodes[n]
            tokens, values = top(ids + list(path))
            for t, v in zip(tokens, values):
                nodes.append((path + (t,), score + v))
                found.append((score + v, len(nodes) - 1))
        found.sort(key=lambda c: -c[0])
        beams = [n for _, n in found[:topk]]
    kept: dict[tuple[int, ...], float] = {}
    for path, score in sorted(nodes, key=lambda n: (-n[1], len(n[0]))):
        if len(kept) < size and (len(path) == 1 or path[:-1] in kept):
            kept[path] = score
    return kept


def test_tree_proposals_match_transformers(models, smollm2_tokenizer):
    from transformers import LlamaForCausalLM

    reference = LlamaForCausalLM.from_pretrained(models.draft, dtype=torch.float32).eval()
    args = ServerArgs(model_path=models.target, dtype="float32", speculative_algorithm="STANDALONE",
                      speculative_draft_model_path=models.draft, speculative_num_steps=STEPS,
                      speculative_eagle_topk=TOPK, speculative_num_draft_tokens=NODES + 1)
    args.validate()
    draft = DraftModel.load(args, len(smollm2_tokenizer), smollm2_tokenizer, target_tokens=256, max_requests=2)
    rows = draft.mem.req_to_token_pool.available_size()
    reqs = [DecodingReq(smollm2_tokenizer.encode(p), [7]) for p in PROMPTS[1:3]]
    trees = draft.propose_trees(reqs, [STEPS, 2])
    for req, tree, steps in zip(reqs, trees, [STEPS, 2]):
        want = reference_tree(reference, req.all_ids(), TOPK, steps, min(NODES, TOPK * steps))
        got = {tuple(tree.tokens[n] for n in tree.path_to(i)): i for i in range(len(tree))}
        assert set(got) == set(want)
        assert tree.depth() <= steps and len(tree) == len(want)
        assert all(tree.parents[i] < i for i in range(len(tree)))
    # only the catch-ups stay: the beams' rows and slots are back
    assert draft.used_tokens() == sum(r.seqlen for r in reqs)
    assert draft.mem.req_to_token_pool.available_size() == rows - 2
    # the next proposal catches up the accepted tokens first
    reqs[0].output_ids += [trees[0].tokens[0], 5]
    [again, _] = draft.propose_trees(reqs[:1], [STEPS]) + [None]
    want = reference_tree(reference, reqs[0].all_ids(), TOPK, STEPS, NODES)
    assert {tuple(again.tokens[n] for n in again.path_to(i)) for i in range(len(again))} == set(want)
    for req in reqs:
        draft.release(req)
    assert draft.idle_error() is None


@pytest.fixture(scope="module")
def servers(models):
    with running_server(*COMMON, model=models.target) as plain, \
            running_server(*COMMON, *TREE_FLAGS, "--speculative-draft-model-path", models.draft,
                           model=models.target) as spec:
        yield plain, spec


def test_greedy_and_seeded_outputs_equal_plain_decoding(servers):
    plain, spec = servers
    got = greedy_cases_match(plain, spec)
    assert sum(g["meta_info"]["spec_accepted_draft_tokens"] for g in got) > 0
    seeded_sampling_matches(plain, spec, first_seed=5)
