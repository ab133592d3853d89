"""The batched sampler on synthetic logits: filters, penalties, masks, seeds and logprobs.

Statistical checks draw many samples of one distribution as many rows of one batch (each row its own seed),
so every check is deterministic, and compare the empirical histogram with the expected distribution."""

import math
import random
from types import SimpleNamespace

import pytest
import torch

import sglang.srt.layers.sampler as sampler_module
from sglang.srt.constrained.base_grammar_backend import allocate_bitmask
from sglang.srt.layers.sampler import Sampler, compute_logprobs, get_token_ids_logprobs, get_top_logprobs
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams

N_DRAWS = 20000


def params_of(**kw) -> SamplingParams:
    p = SamplingParams.from_dict(kw)
    p.normalize(None)
    p.verify(None)
    return p


def make_req(params: SamplingParams | None = None, seed: int = 0, prompt=(1, 2, 3), output=(), stop_ids=()):
    return SimpleNamespace(
        sampling_params=params or params_of(),
        origin_input_ids=list(prompt),
        output_ids=list(output),
        stop_token_ids=set(stop_ids),
        sampling_seed=seed,
        penalty_state=None,
        return_logprob=False,
    )


def run(logits: torch.Tensor, reqs: list, **kw):
    info = SamplingBatchInfo.from_reqs(reqs, logits.shape[1], "cpu")
    return Sampler()(logits, info, **kw)


def synthetic_logits(vocab: int, seed: int, scale: float = 1.5) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale


def draw(row_logits: torch.Tensor, n: int = N_DRAWS, seed_base: int = 0, **params) -> torch.Tensor:
    """n samples of one distribution: n rows sharing one params object, each row with its own seed."""
    p = params_of(**params)
    reqs = [make_req(p, seed=seed_base + i) for i in range(n)]
    return run(row_logits.expand(n, -1).contiguous(), reqs).next_token_ids


def histogram(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double()


def assert_matches(tokens: torch.Tensor, probs: torch.Tensor):
    """Chi-square goodness of fit (bins with expected count < 5 merged) plus a total-variation bound."""
    n = tokens.numel()
    probs = probs.double() / probs.double().sum()
    observed = histogram(tokens, probs.numel())
    assert observed[probs == 0].sum() == 0, "sampled a token of probability zero"
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = max(int(keep.sum()) - 1, 1)
    assert stat < dof + 6 * math.sqrt(2 * dof), f"chi2={stat:.1f} with {dof} degrees of freedom"
    tv = 0.5 * float((observed / n - probs).abs().sum())
    # The total variation of n honest draws is about 0.5 * sum_i sqrt(2 p_i (1 - p_i) / (pi n)).
    typical_tv = 0.5 * float((2 * probs * (1 - probs) / (math.pi * n)).sqrt().sum())
    assert tv < max(0.03, 1.5 * typical_tv), f"total variation {tv:.4f} (typical {typical_tv:.4f})"


# ---- greedy ----------------------------------------------------------------------------------------------
def test_greedy_is_exact_argmax():
    logits = torch.randn(16, 500, generator=torch.Generator().manual_seed(0))
    reqs = [make_req(params_of(temperature=0), seed=i) for i in range(8)]
    reqs += [make_req(params_of(top_k=1, temperature=0.7), seed=i) for i in range(8)]
    out = run(logits, reqs)
    assert torch.equal(out.next_token_ids, logits.argmax(dim=-1))
    assert out.next_token_ids.dtype == torch.int64


def test_greedy_rows_exact_in_a_mixed_batch():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    greedy = params_of(temperature=0)
    reqs = [make_req(greedy if i % 2 == 0 else params_of(top_p=0.8), seed=i) for i in range(6)]
    out = run(logits, reqs)
    assert torch.equal(out.next_token_ids[0::2], logits[0::2].argmax(dim=-1))


def test_all_greedy_batch_takes_the_argmax_path_only(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the sampling path must not run for an all-greedy batch")

    monkeypatch.setattr(Sampler, "_sample", forbidden)
    reqs = [make_req(params_of(temperature=0), seed=i) for i in range(4)]
    info = SamplingBatchInfo.from_reqs(reqs, 100, "cpu")
    assert info.is_all_greedy and not info.modifies_logits()
    assert info.temperatures is None and info.sampled_rows is None
    logits = torch.randn(4, 100)
    assert torch.equal(Sampler()(logits, info).next_token_ids, logits.argmax(dim=-1))


def test_no_sort_when_no_row_needs_top_k_or_top_p(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("top-k/top-p filtering must be skipped")

    monkeypatch.setattr(sampler_module, "_top_k_top_p_thresholds", forbidden)
    # Greedy rows have top_k=1 internally; they must not force the filter on the sampled rows.
    reqs = [make_req(params_of(temperature=0), seed=0), make_req(params_of(temperature=0.7, min_p=0.1), seed=1)]
    info = SamplingBatchInfo.from_reqs(reqs, 50, "cpu")
    assert not info.need_top_k and not info.need_top_p and info.need_min_p
    Sampler()(torch.randn(2, 50), info)


# ---- temperature, top-k, top-p, min-p -----------------------------------------------------------------
def test_temperature_matches_softmax_and_sharpens():
    logits = synthetic_logits(64, seed=2)
    max_freq = {}
    for t in (0.5, 1.0, 2.0):
        tokens = draw(logits, temperature=t)
        assert_matches(tokens, torch.softmax(logits / t, dim=-1))
        max_freq[t] = float((tokens == logits.argmax()).double().mean())
    assert max_freq[0.5] > max_freq[1.0] > max_freq[2.0]


def test_temperature_is_not_ignored():
    # Guards the statistical check itself: T=1 samples must not pass as T=0.5 samples.
    logits = synthetic_logits(64, seed=2)
    tokens = draw(logits, temperature=1.0)
    with pytest.raises(AssertionError):
        assert_matches(tokens, torch.softmax(logits / 0.5, dim=-1))


def test_top_k_stays_in_top_k_and_renormalizes():
    logits = synthetic_logits(100, seed=3)
    k = 5
    top = logits.topk(k).indices
    tokens = draw(logits, top_k=k)
    assert torch.isin(tokens, top).all()
    expected = torch.zeros(100)
    expected[top] = torch.softmax(logits[top], dim=-1)
    assert_matches(tokens, expected)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, ids = probs.double().sort(descending=True)
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    return ids[mass_before <= top_p]


@pytest.mark.parametrize(
    "vocab,scale,top_p",
    [
        (1000, 3.0, 0.7),  # peaked: the nucleus fits in the first partial sort
        (1000, 0.3, 0.9),  # flat: the nucleus needs the full sort
        (600, 1.0, 0.95),
    ],
)
def test_top_p_stays_in_nucleus_and_renormalizes(vocab, scale, top_p):
    logits = synthetic_logits(vocab, seed=4, scale=scale)
    probs = torch.softmax(logits, dim=-1)
    keep = nucleus(probs, top_p)
    tokens = draw(logits, top_p=top_p)
    assert torch.isin(tokens, keep).all()
    expected = torch.zeros(vocab)
    expected[keep] = probs[keep]
    assert_matches(tokens, expected)


def test_top_k_and_top_p_together():
    logits = synthetic_logits(300, seed=5, scale=2.0)
    probs = torch.softmax(logits, dim=-1)
    keep = nucleus(probs, 0.9)
    keep = keep[:20]  # nucleus ids are in descending probability order
    tokens = draw(logits, top_p=0.9, top_k=20)
    assert torch.isin(tokens, keep).all()
    expected = torch.zeros(300)
    expected[keep] = probs[keep]
    assert_matches(tokens, expected)


def test_min_p_drops_tokens_below_fraction_of_max():
    logits = synthetic_logits(200, seed=6, scale=2.0)
    probs = torch.softmax(logits, dim=-1)
    min_p = 0.2
    keep = probs >= min_p * probs.max()
    tokens = draw(logits, min_p=min_p)
    assert keep[tokens].all()
    assert_matches(tokens, torch.where(keep, probs, torch.zeros_like(probs)))


def test_rows_without_filters_are_unaffected_by_filtered_rows():
    logits = synthetic_logits(80, seed=7)
    n = N_DRAWS
    plain, filtered = params_of(), params_of(top_k=3, top_p=0.5, min_p=0.3)
    reqs = [make_req(plain if i % 2 == 0 else filtered, seed=i) for i in range(2 * n)]
    out = run(logits.expand(2 * n, -1).contiguous(), reqs).next_token_ids
    assert_matches(out[0::2], torch.softmax(logits, dim=-1))
    assert torch.isin(out[1::2], logits.topk(3).indices).all()


# ---- penalties, logit_bias, min_new_tokens, vocab mask ----------------------------------------------------
def processed(logits: torch.Tensor, reqs: list) -> torch.Tensor:
    info = SamplingBatchInfo.from_reqs(reqs, logits.shape[1], "cpu")
    out = logits.clone()
    info.apply_logit_processing(out)
    return out


def test_penalties_exact_adjusted_logits():
    vocab = 20
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(8)) * 3
    reqs = [
        make_req(params_of(repetition_penalty=1.5), prompt=[1, 2], output=[2, 3, 3]),
        make_req(params_of(frequency_penalty=0.5, presence_penalty=0.25), prompt=[4], output=[5, 5, 6, 5]),
        make_req(params_of(), prompt=[1, 5], output=[5, 5]),
        make_req(params_of(repetition_penalty=0.8, frequency_penalty=-0.5), prompt=[7], output=[8, 8]),
    ]
    got = processed(logits, reqs)

    want = logits.clone()
    for tok in (1, 2, 3):
        x = want[0, tok]
        want[0, tok] = x / 1.5 if x > 0 else x * 1.5
    want[1, 5] -= 0.5 * 3 + 0.25
    want[1, 6] -= 0.5 * 1 + 0.25
    for tok in (7, 8):
        x = want[3, tok]
        want[3, tok] = x / 0.8 if x > 0 else x * 0.8
    want[3, 8] += 0.5 * 2
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_repetition_penalty_sign_handling():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    req = make_req(params_of(repetition_penalty=2.0), prompt=[0], output=[1])
    torch.testing.assert_close(processed(logits, [req]), torch.tensor([[1.0, -4.0, 2.0, -2.0]]))


def test_penalty_state_is_incremental_and_matches_a_rebuild():
    vocab = 30
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(9))
    p = params_of(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.3)
    req = make_req(p, prompt=[1, 2, 2], output=[3])
    processed(logits, [req])
    state = req.penalty_state
    assert state is not None and state.counted_len == 1
    req.output_ids += [3, 4, 1, 4, 4]
    incremental = processed(logits, [req])
    assert req.penalty_state is state and state.counted_len == 6
    fresh = make_req(p, prompt=[1, 2, 2], output=req.output_ids)
    torch.testing.assert_close(incremental, processed(logits, [fresh]), rtol=0, atol=0)
    # After a retraction the scheduler drops the state; it is rebuilt from the tokens.
    req.penalty_state = None
    torch.testing.assert_close(processed(logits, [req]), incremental, rtol=0, atol=0)


def test_frequency_and_presence_shift_the_distribution():
    vocab = 8
    logits = torch.zeros(vocab)
    n = N_DRAWS
    p = params_of(frequency_penalty=0.5, presence_penalty=0.4)
    reqs = [make_req(p, seed=i, output=[0, 0, 0, 1]) for i in range(n)]
    tokens = run(logits.expand(n, -1).contiguous(), reqs).next_token_ids
    adjusted = logits.clone()
    adjusted[0] -= 0.5 * 3 + 0.4
    adjusted[1] -= 0.5 * 1 + 0.4
    assert_matches(tokens, torch.softmax(adjusted, dim=-1))
    freq = histogram(tokens, vocab) / n
    assert freq[0] < freq[1] < freq[2:].min()


def test_repetition_penalty_shifts_the_distribution():
    vocab = 10
    logits = torch.full((vocab,), 1.0)
    n = N_DRAWS
    p = params_of(repetition_penalty=2.0)
    reqs = [make_req(p, seed=i, prompt=[0], output=[1]) for i in range(n)]
    tokens = run(logits.expand(n, -1).contiguous(), reqs).next_token_ids
    adjusted = logits.clone()
    adjusted[[0, 1]] = 0.5
    assert_matches(tokens, torch.softmax(adjusted, dim=-1))


def test_logit_bias_forces_and_bans():
    vocab = 50
    logits = synthetic_logits(vocab, seed=10)
    best = int(logits.argmax())
    forced = draw(logits, n=2000, logit_bias={"17": 100})
    assert (forced == 17).all()
    banned = draw(logits, n=N_DRAWS, temperature=0.5, logit_bias={str(best): -100})
    assert not (banned == best).any()
    greedy = run(logits.unsqueeze(0), [make_req(params_of(temperature=0, logit_bias={str(best): -100}))])
    assert int(greedy.next_token_ids[0]) != best


def test_logit_bias_exact_and_applied_before_penalties():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5]])
    req = make_req(params_of(logit_bias={"0": 3, "2": 2.5}, repetition_penalty=2.0), prompt=[0, 2], output=[])
    # token 0: (1 + 3) / 2 = 2 ; token 2: (-1 + 2.5) / 2 = 0.75
    torch.testing.assert_close(processed(logits, [req]), torch.tensor([[2.0, 2.0, 0.75, 0.5]]))


def test_min_new_tokens_masks_stop_ids_until_reached():
    vocab = 40
    logits = synthetic_logits(vocab, seed=11)
    logits[[0, 5]] += 8.0  # the stop ids dominate the distribution
    stop_ids = {0, 5, 999}  # ids outside the vocabulary are ignored
    p = params_of(min_new_tokens=4)
    n = 4000
    before = [make_req(p, seed=i, output=[9, 9], stop_ids=stop_ids) for i in range(n)]
    tokens = run(logits.expand(n, -1).contiguous(), before).next_token_ids
    assert not torch.isin(tokens, torch.tensor([0, 5])).any()
    greedy_before = make_req(params_of(min_new_tokens=4, temperature=0), output=[9], stop_ids=stop_ids)
    assert int(run(logits.unsqueeze(0), [greedy_before]).next_token_ids[0]) not in (0, 5)
    after = [make_req(p, seed=i, output=[9, 9, 9, 9], stop_ids=stop_ids) for i in range(n)]
    tokens = run(logits.expand(n, -1).contiguous(), after).next_token_ids
    assert float(torch.isin(tokens, torch.tensor([0, 5])).double().mean()) > 0.9


def test_grammar_bitmask_is_respected():
    vocab, n = 60, 4000
    logits = synthetic_logits(vocab, seed=12)
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[[3, 11, 42, 59]] = True
    reqs = [make_req(params_of(), seed=i) for i in range(n)] + [make_req(params_of(temperature=0))]
    info = SamplingBatchInfo.from_reqs(reqs, vocab, "cpu")
    bitmask = allocate_bitmask(n + 1, vocab)
    bitmask[:, 0] = int(sum(1 << i for i in (3, 11)))
    bitmask[:, 1] = int((1 << (42 - 32)) | (1 << (59 - 32)))
    info.grammar_bitmask, info.grammar_rows = bitmask, list(range(n + 1))
    tokens = Sampler()(logits.expand(n + 1, -1).contiguous(), info).next_token_ids
    assert allowed[tokens].all()
    assert int(tokens[-1]) == int(torch.where(allowed, logits, float("-inf")).argmax())
    expected = torch.where(allowed, torch.softmax(logits, dim=-1), torch.zeros(vocab))
    assert_matches(tokens[:-1], expected)


def test_caller_logits_are_not_modified():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(13))
    before = logits.clone()
    reqs = [
        make_req(params_of(repetition_penalty=1.5, logit_bias={"3": 5}), output=[1, 2], stop_ids={4}),
        make_req(params_of(temperature=0.7, min_new_tokens=3, top_p=0.5), stop_ids={4}),
    ]
    run(logits, reqs, return_logprob=True, top_logprobs_nums=[2, 2])
    assert torch.equal(logits, before)


# ---- seeds ---------------------------------------------------------------------------------------------
VOCAB_SEEDED = 1000


def fake_model(tokens: list[int]) -> torch.Tensor:
    """Logits that depend only on the sequence, like a model would (and not on the batch)."""
    key = 0
    for t in tokens:
        key = (key * 1_000_003 + t + 1) % (1 << 61)
    return torch.randn(VOCAB_SEEDED, generator=torch.Generator().manual_seed(key)) * 2.0


def generate(reqs: list, steps: int) -> None:
    sampler = Sampler()
    for _ in range(steps):
        logits = torch.stack([fake_model(r.origin_input_ids + r.output_ids) for r in reqs])
        info = SamplingBatchInfo.from_reqs(reqs, VOCAB_SEEDED, "cpu")
        for r, token in zip(reqs, sampler(logits, info).next_token_ids.tolist()):
            r.output_ids.append(token)


TARGET_PARAMS = dict(temperature=0.9, top_p=0.95, frequency_penalty=0.3, repetition_penalty=1.1)


def target_req(seed: int = 1234):
    return make_req(params_of(**TARGET_PARAMS), seed=seed, prompt=[5, 6, 7])


def companions(rng: random.Random, count: int) -> list:
    """Other requests with other settings; their seeds stand for the random ones the scheduler draws."""
    kinds = [dict(temperature=0), dict(top_k=3), dict(top_k=700, temperature=1.3), dict(top_p=0.5),
             dict(min_p=0.1), dict(), dict(presence_penalty=1.0, logit_bias={"7": 3})]
    return [
        make_req(params_of(**rng.choice(kinds)), seed=rng.randrange(1 << 62), prompt=[rng.randrange(1000)])
        for _ in range(count)
    ]


def test_same_seed_same_tokens_regardless_of_batch():
    steps = 12
    alone = target_req()
    generate([alone], steps)

    rng = random.Random(0)
    in_batch = target_req()
    batch = companions(rng, 7)
    batch.insert(5, in_batch)
    generate(batch, steps)

    elsewhere = target_req()
    batch = companions(rng, 7)
    batch.insert(0, elsewhere)
    batch.append(target_req(seed=99))  # another request in the batch with the same params, another seed
    generate(batch, steps)

    assert len(alone.output_ids) == steps
    assert in_batch.output_ids == alone.output_ids
    assert elsewhere.output_ids == alone.output_ids


def test_ties_at_the_cut_do_not_make_a_row_depend_on_its_batch():
    # Coarse logits (as in bfloat16) tie a lot. A companion with a wider top-k changes how many columns
    # are sorted; the seeded row must still draw the same tokens.
    vocab, n = 1000, 300
    logits = (synthetic_logits(vocab, seed=17, scale=2.0) * 2).round() / 2
    target = params_of(top_k=300, top_p=0.9, temperature=0.8)
    wide = params_of(top_k=900)
    alone = run(logits.expand(n, -1).contiguous(), [make_req(target, seed=s) for s in range(n)]).next_token_ids
    mixed = [make_req(target, seed=s) if i % 2 else make_req(wide, seed=10**6 + s) for s in range(n) for i in (0, 1)]
    together = run(logits.expand(2 * n, -1).contiguous(), mixed).next_token_ids
    assert torch.equal(together[1::2], alone)


def test_different_seeds_give_different_tokens():
    reqs = [target_req(seed=s) for s in (1, 2, 3)]
    generate(reqs, 12)
    outputs = {tuple(r.output_ids) for r in reqs}
    assert len(outputs) == 3


def test_sampler_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    draw(synthetic_logits(50, seed=14), n=100, top_p=0.9)
    assert torch.equal(torch.rand(3), expected)


# ---- logprobs ------------------------------------------------------------------------------------------
def test_logprobs_of_chosen_top_and_requested_tokens():
    vocab = 100
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(15)) * 2
    reqs = [
        make_req(params_of(temperature=0), seed=0),
        make_req(params_of(temperature=0.5, frequency_penalty=1.0), seed=1, output=[3, 3]),
        make_req(params_of(top_k=10), seed=2),
        make_req(params_of(temperature=1.5, logit_bias={"9": 4}), seed=3),
    ]
    out = run(
        logits, reqs, return_logprob=True, top_logprobs_nums=[3, 0, 5, 1],
        token_ids_logprobs=[[1, 2], None, [7], [9, 0, 9]],
    )
    # Logprobs come from the processed logits, before temperature.
    lp = torch.log_softmax(processed(logits, reqs), dim=-1)
    chosen = out.next_token_ids
    torch.testing.assert_close(out.next_token_logprobs, lp.gather(1, chosen.unsqueeze(1)).squeeze(1))
    assert out.top_logprobs[1] is None
    for row, k in ((0, 3), (2, 5), (3, 1)):
        values, ids = out.top_logprobs[row]
        assert len(values) == len(ids) == k
        assert values == sorted(values, reverse=True)
        ref_values, ref_ids = lp[row].topk(k)
        assert ids == ref_ids.tolist()
        torch.testing.assert_close(torch.tensor(values), ref_values)
    assert out.token_ids_logprobs[1] is None
    torch.testing.assert_close(torch.tensor(out.token_ids_logprobs[0]), lp[0, [1, 2]])
    torch.testing.assert_close(torch.tensor(out.token_ids_logprobs[2]), lp[2, [7]])
    torch.testing.assert_close(torch.tensor(out.token_ids_logprobs[3]), lp[3, [9, 0, 9]])
    assert lp[1, 3] < torch.log_softmax(logits[1], dim=-1)[3]  # the penalty shows in the logprob


def test_logprobs_absent_unless_asked():
    out = run(torch.randn(2, 10), [make_req(), make_req(seed=1)])
    assert out.next_token_logprobs is None and out.top_logprobs is None and out.token_ids_logprobs is None


def test_logprob_helpers_for_prompt_rows():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(16)).to(torch.bfloat16)
    lp = compute_logprobs(logits)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, torch.log_softmax(logits.float(), dim=-1))
    tops = get_top_logprobs(lp, [2, 0, 40, 1, 0])
    assert tops[1] is None and tops[4] is None
    assert len(tops[2][1]) == 40 and tops[2][1] == lp[2].argsort(descending=True).tolist()
    ids = get_token_ids_logprobs(lp, [None, [3], [], [0, 39], None])
    assert ids[0] is None and ids[2] is None and ids[4] is None
    assert ids[3] == lp[3, [0, 39]].tolist()
