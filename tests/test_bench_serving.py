"""sglang.bench_serving: dataset samplers and metrics offline, then short runs against a real SmolLM2 server."""

import asyncio
import json
import math

import pytest

from sglang import bench_serving as bs
from sglang.test.test_utils import find_free_port


# ---- datasets --------------------------------------------------------------------------------------------
def test_random_ids_exact_lengths(smollm2_tokenizer):
    rows = bs.sample_random_ids_requests(32, 8, 5, 1.0, smollm2_tokenizer, seed=3)
    assert len(rows) == 5
    special = set(smollm2_tokenizer.all_special_ids)
    for row in rows:
        assert isinstance(row.prompt, list) and len(row.prompt) == row.prompt_len == 32
        assert row.output_len == 8
        assert all(isinstance(t, int) and 0 <= t < smollm2_tokenizer.vocab_size and t not in special
                   for t in row.prompt)
    again = bs.sample_random_ids_requests(32, 8, 5, 1.0, smollm2_tokenizer, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in rows]


def test_random_ids_range_ratio(smollm2_tokenizer):
    rows = bs.sample_random_ids_requests(40, 20, 50, 0.5, smollm2_tokenizer)
    assert all(20 <= r.prompt_len <= 40 and len(r.prompt) == r.prompt_len for r in rows)
    assert all(10 <= r.output_len <= 20 for r in rows)
    assert len({r.prompt_len for r in rows}) > 1


def test_random_text(smollm2_tokenizer, tmp_path):
    rows = bs.sample_random_requests(24, 6, 4, 1.0, smollm2_tokenizer)
    assert len(rows) == 4 and all(isinstance(r.prompt, str) and r.prompt and r.output_len == 6 for r in rows)
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": "Tell me about cats."},
                                                   {"from": "gpt", "value": "Cats are small felines."}]}]))
    rows = bs.sample_random_requests(24, 6, 3, 1.0, smollm2_tokenizer, dataset_path=str(path))
    assert len(rows) == 3 and all("cats" in r.prompt for r in rows)
    ids = bs.sample_random_requests(24, 6, 3, 1.0, smollm2_tokenizer, return_text=False)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == 24 for r in ids)


def test_generated_shared_prefix(smollm2_tokenizer):
    rows = bs.sample_generated_shared_prefix_requests(3, 4, 48, 12, 7, smollm2_tokenizer, seed=5)
    assert len(rows) == 12 and all(r.output_len == 7 and isinstance(r.prompt, str) for r in rows)
    groups = {}
    for r in rows:
        groups.setdefault(r.group, []).append(r.prompt)
    assert sorted(groups) == [0, 1, 2] and all(len(p) == 4 for p in groups.values())
    system_prompts = set()
    for prompts in groups.values():
        system = prompts[0].split("\n\n")[0]
        system_prompts.add(system)
        assert all(p.startswith(system + "\n\n") for p in prompts)
        assert len(set(prompts)) == 4  # distinct questions
    assert len(system_prompts) == 3
    assert [r.group for r in rows] != sorted(r.group for r in rows)  # shuffled across groups
    ordered = bs.sample_generated_shared_prefix_requests(3, 4, 48, 12, 7, smollm2_tokenizer, seed=5, shuffle=False)
    assert [r.group for r in ordered] == sorted(r.group for r in ordered)


def test_sharegpt(smollm2_tokenizer, tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": "What is the capital of France?"},
                           {"from": "gpt", "value": "The capital of France is Paris, a large city."}]},
        {"conversations": [{"role": "user", "content": "Write a haiku about the sea, please."},
                           {"role": "assistant", "content": "Waves fold into foam, the tide keeps its slow promise."}]},
        {"conversations": [{"from": "human", "value": "Only one turn here."}]},
        {"conversations": [{"from": "human", "value": "Summarize the plot of Hamlet in two sentences."},
                           {"from": "gpt", "value": "A prince avenges his father. Nearly everyone dies."}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    rows = bs.sample_sharegpt_requests(str(path), 10, smollm2_tokenizer)
    assert len(rows) == 3  # the single-turn conversation is skipped
    by_prompt = {r.prompt: r for r in rows}
    paris = by_prompt["What is the capital of France?"]
    assert paris.prompt_len == len(smollm2_tokenizer.encode("What is the capital of France?"))
    assert paris.output_len == len(smollm2_tokenizer.encode("The capital of France is Paris, a large city.",
                                                            add_special_tokens=False))
    fixed = bs.sample_sharegpt_requests(str(path), 2, smollm2_tokenizer, fixed_output_len=5)
    assert len(fixed) == 2 and all(r.output_len == 5 for r in fixed)
    assert bs.sample_sharegpt_requests(str(path), 10, smollm2_tokenizer, context_len=12) == []


# ---- metrics ---------------------------------------------------------------------------------------------
def test_calculate_metrics():
    outs = [
        bs.RequestFuncOutput(success=True, latency=1.0, ttft=0.2, itl=[0.1, 0.3], prompt_len=10, output_len=5,
                             cached_tokens=4),
        bs.RequestFuncOutput(success=True, latency=2.0, ttft=0.5, itl=[0.5], prompt_len=20, output_len=4,
                             cached_tokens=0),
        bs.RequestFuncOutput(success=True, latency=0.4, ttft=0.4, itl=[], prompt_len=6, output_len=1,
                             cached_tokens=2),
        bs.RequestFuncOutput(success=False, error="HTTP 500"),
    ]
    m = bs.calculate_metrics(outs, duration=4.0)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens, m.total_cached_tokens) == (36, 10, 6)
    assert m.cache_hit_rate == pytest.approx(6 / 36)
    assert m.request_throughput == pytest.approx(0.75)
    assert m.input_throughput == pytest.approx(9.0) and m.output_throughput == pytest.approx(2.5)
    assert m.total_throughput == pytest.approx(11.5)
    assert m.concurrency == pytest.approx(3.4 / 4.0)
    assert m.mean_e2e_latency_ms == pytest.approx(3400 / 3) and m.median_e2e_latency_ms == pytest.approx(1000)
    assert m.p99_e2e_latency_ms == pytest.approx(1000 + 0.98 * 1000)  # linear interpolation, numpy style
    assert m.mean_ttft_ms == pytest.approx(1100 / 3) and m.median_ttft_ms == pytest.approx(400)
    assert m.p99_ttft_ms == pytest.approx(400 + 0.98 * 100)
    # TPOT = (e2e - ttft) / (output_len - 1), only for requests with more than one output token.
    tpots = [0.8 / 4 * 1000, 1.5 / 3 * 1000]
    assert m.mean_tpot_ms == pytest.approx(sum(tpots) / 2) and m.median_tpot_ms == pytest.approx(sum(tpots) / 2)
    assert m.p99_tpot_ms == pytest.approx(tpots[0] + 0.99 * (tpots[1] - tpots[0]))
    assert m.mean_itl_ms == pytest.approx(300) and m.median_itl_ms == pytest.approx(300)
    assert m.max_itl_ms == pytest.approx(500) and m.p99_itl_ms == pytest.approx(300 + 0.98 * 200)


def test_calculate_metrics_without_cache_info_or_successes():
    m = bs.calculate_metrics([bs.RequestFuncOutput(success=True, latency=1.0, ttft=0.5, prompt_len=3,
                                                   output_len=2)], 1.0)
    assert m.cache_hit_rate is None and m.total_cached_tokens is None
    empty = bs.calculate_metrics([bs.RequestFuncOutput(error="boom")], 2.0)
    assert empty.completed == 0 and empty.failed == 1 and empty.mean_ttft_ms == 0.0
    assert all(not math.isnan(v) for v in vars(empty).values() if isinstance(v, float))


def test_parser_defaults():
    args = bs.get_parser().parse_args([])
    assert args.backend == "sglang" and args.num_prompts == 1000 and math.isinf(args.request_rate)
    assert (args.random_input_len, args.random_output_len, args.random_range_ratio) == (1024, 1024, 0.0)
    assert (args.seed, args.warmup_requests, args.max_concurrency) == (1, 1, None)
    assert (args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len) == (64, 16, 2048)
    assert bs.resolve_base_url(args) == "http://127.0.0.1:30000"
    assert bs.resolve_base_url(bs.get_parser().parse_args(["--backend", "vllm"])) == "http://127.0.0.1:8000"


def test_unreachable_server_fails_requests_without_crashing(smollm2_tokenizer):
    url = f"http://127.0.0.1:{find_free_port()}"
    rows = bs.sample_random_ids_requests(8, 2, 3, 1.0, smollm2_tokenizer)
    outputs, _ = asyncio.run(bs.benchmark(
        backend="vllm", api_url=f"{url}/v1/completions", base_url=url, model="m", tokenizer=smollm2_tokenizer,
        input_requests=rows, request_rate=float("inf"), max_concurrency=2, disable_tqdm=True, warmup_requests=0))
    assert len(outputs) == 3 and not any(o.success for o in outputs) and all(o.error for o in outputs)


# ---- against a real server -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_url(smollm2_server):
    return smollm2_server


def _read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("backend,extra", [
    ("sglang", []),
    ("sglang-oai", []),
    ("sglang-oai-chat", ["--disable-stream"]),
])
def test_random_ids_run(base_url, backend, extra, tmp_path, capsys):
    out_file = tmp_path / "results.jsonl"
    num = 6 if backend != "sglang-oai-chat" else 3
    result = bs.main([
        "--backend", backend, "--base-url", base_url, "--dataset-name", "random-ids", "--num-prompts", str(num),
        "--random-input-len", "32", "--random-output-len", "8", "--random-range-ratio", "1.0",
        "--max-concurrency", "4", "--disable-tqdm", "--output-file", str(out_file), *extra,
    ])
    assert result["completed"] == num and result["failed"] == 0
    assert result["total_output_tokens"] == num * 8  # ignore_eos: every request runs to max tokens
    if backend != "sglang-oai-chat":
        assert result["total_input_tokens"] == num * 32  # token ids are sent as they are
    assert result["mean_ttft_ms"] > 0 and result["mean_e2e_latency_ms"] >= result["mean_ttft_ms"]
    if "--disable-stream" in extra:
        assert result["mean_ttft_ms"] == pytest.approx(result["mean_e2e_latency_ms"])
    else:
        assert result["mean_itl_ms"] > 0 and result["mean_tpot_ms"] > 0
    assert result["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    lines = _read_lines(out_file)
    assert len(lines) == 1 and lines[0]["backend"] == backend and lines[0]["completed"] == num
    assert lines[0]["request_rate"] == "inf" and lines[0]["max_concurrency"] == 4 and lines[0]["date"]
    printed = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in printed
    assert f"{'Successful requests:':<40} {num:<10}" in printed
    assert "Mean TTFT (ms):" in printed and "P99 ITL (ms):" in printed


def test_generated_shared_prefix_run(base_url, tmp_path, capsys):
    out_file = tmp_path / "results.jsonl"
    args = ["--backend", "sglang", "--base-url", base_url, "--dataset-name", "generated-shared-prefix",
            "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "64",
            "--gsp-question-len", "16", "--gsp-output-len", "6", "--max-concurrency", "1", "--flush-cache",
            "--disable-tqdm", "--output-file", str(out_file)]
    result = bs.main(args)
    assert result["completed"] == 6 and result["failed"] == 0 and result["num_prompts"] == 6
    assert result["total_output_tokens"] == 6 * 6
    assert result["cache_hit_rate"] is not None and 0 < result["cache_hit_rate"] < 1
    assert "Cache hit rate:" in capsys.readouterr().out
    assert len(_read_lines(out_file)) == 1
