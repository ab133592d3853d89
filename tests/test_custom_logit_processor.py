"""Custom logit processors (--enable-custom-logit-processor): serialization, per-request application in a shared
batch, per-request state through custom_params and `__req__`, and clear 400s for bad or failing processors."""

from __future__ import annotations

import json
import tempfile
from concurrent.futures import ThreadPoolExecutor

import dill
import pytest
import requests
import torch

from sglang.srt.sampling.custom_logit_batch import CustomLogitProcessors
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor, DisallowedTokensLogitsProcessor
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils import kill_process_tree
from sglang.test.test_utils import DEFAULT_SMALL_MODEL_NAME_FOR_TEST, find_free_port, popen_launch_server

PROMPT = "Question: Is Paris the capital of France? Answer:"


# Processors are defined inside functions: dill then serializes the class by value, as for a client's script.
def force_token_processor() -> str:
    class ForceToken(CustomLogitProcessor):
        def __call__(self, logits, custom_param_list=None):
            for i, params in enumerate(custom_param_list):
                logits[i, :] = -float("inf")
                logits[i, params["token_id"]] = 0.0
            return logits

    return ForceToken.to_str()


def counting_processor() -> str:
    """Samples normally for `delay` steps, then forces `token_id`, then always the previous output id + 1: it keeps
    state in its custom_params and reads the request's output through `__req__`."""

    class CountUp(CustomLogitProcessor):
        def __call__(self, logits, custom_param_list=None):
            for i, params in enumerate(custom_param_list):
                if params["delay"] > 0:
                    params["delay"] -= 1
                    continue
                req = params["__req__"]
                token = params["token_id"] if params["delay"] == 0 else req.output_ids[-1] + 1
                params["delay"] = -1
                logits[i, :] = -float("inf")
                logits[i, token] = 0.0
            return logits

    return CountUp.to_str()


def raising_processor() -> str:
    class Broken(CustomLogitProcessor):
        def __call__(self, logits, custom_param_list=None):
            raise RuntimeError("boom from the client")

    return Broken.to_str()


# ---- without a server ---------------------------------------------------------------------------------------
def test_to_str_round_trips_and_bad_strings_say_what_is_wrong():
    processor = CustomLogitProcessor.from_str(force_token_processor())
    logits = processor(torch.zeros(2, 10), [{"token_id": 3}, {"token_id": 7}])
    assert logits.argmax(-1).tolist() == [3, 7]
    assert isinstance(CustomLogitProcessor.from_str(DisallowedTokensLogitsProcessor().to_str()),
                      DisallowedTokensLogitsProcessor)
    bad = {
        "not json": "not valid JSON",
        json.dumps([1]): "must be a JSON object",
        json.dumps({"callable": "zz"}): "not a hex string",
        json.dumps({"callable": "00ff"}): "could not be deserialized",
        json.dumps({"callable": dill.dumps(42).hex()}): "must hold a CustomLogitProcessor",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message):
            CustomLogitProcessor.from_str(text)


def _req(processor: str | None, custom_params: dict | None):
    from sglang.srt.managers.schedule_batch import Req

    params = SamplingParams(custom_params=custom_params)
    return Req("r", [1, 2, 3], params, stop_token_ids=set(), sampling_seed=0, custom_logit_processor=processor)


def test_each_processor_sees_only_its_rows_and_a_failure_stays_in_its_rows():
    force, broken = force_token_processor(), raising_processor()
    reqs = [_req(force, {"token_id": 4}), _req(None, None), _req(broken, None), _req(force, {"token_id": 9})]
    assert reqs[0].sampling_params.custom_params["__req__"] is reqs[0]  # the request itself, as SGLang passes it
    groups = CustomLogitProcessors.from_reqs(reqs)
    assert groups is not None and sorted(g.rows for g in groups.groups) == [[0, 3], [2]]
    logits = torch.randn(4, 16)
    before = logits.clone()
    groups.apply(logits)
    assert logits[0].argmax() == 4 and logits[3].argmax() == 9
    assert torch.equal(logits[1], before[1]) and torch.equal(logits[2], before[2])
    assert list(groups.failures) == [2] and "boom from the client" in groups.failures[2]


# ---- a server with the flag ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    url = f"http://127.0.0.1:{find_free_port()}"
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = popen_launch_server(DEFAULT_SMALL_MODEL_NAME_FOR_TEST, url, other_args=[
            "--enable-custom-logit-processor", "--max-total-tokens", 4096], return_stdout_stderr=(out, err))
        try:
            yield url, err
        finally:
            kill_process_tree(proc.pid)


def generate(url: str, **body) -> requests.Response:
    body.setdefault("text", PROMPT)
    params = body.setdefault("sampling_params", {})
    for p in params if isinstance(params, list) else [params]:
        p.setdefault("temperature", 0)
        p.setdefault("max_new_tokens", 6)
    return requests.post(f"{url}/generate", json=body, timeout=120)


def test_startup_warns_that_client_code_runs(server):
    _, err = server
    err.seek(0)
    assert "executes code sent by clients" in err.read()


def test_a_forcing_processor_repeats_its_token(server):
    url, _ = server
    r = generate(url, custom_logit_processor=force_token_processor(),
                 sampling_params={"custom_params": {"token_id": 5}}, return_logprob=True)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == [5] * 6
    # Logprobs are taken from the processed logits: the forced token is certain.
    assert all(lp == pytest.approx(0.0) for lp, _, _ in out["meta_info"]["output_token_logprobs"])


def test_a_batch_with_and_without_a_processor(server):
    url, _ = server
    plain = generate(url).json()["output_ids"]
    r = generate(url, text=[PROMPT, PROMPT, PROMPT],
                 custom_logit_processor=[force_token_processor(), None, force_token_processor()],
                 sampling_params=[{"custom_params": {"token_id": 11}}, {}, {"custom_params": {"token_id": 23}}])
    assert r.status_code == 200, r.text
    outs = [o["output_ids"] for o in r.json()]
    assert outs == [[11] * 6, plain, [23] * 6]
    assert plain != [11] * 6

    def one(target):  # concurrent requests, so that they share decode batches
        if target is None:
            return generate(url).json()["output_ids"]
        return generate(url, custom_logit_processor=force_token_processor(),
                        sampling_params={"custom_params": {"token_id": target}}).json()["output_ids"]

    targets = [7, None, 31, None, 7]
    with ThreadPoolExecutor(len(targets)) as pool:
        results = list(pool.map(one, targets))
    assert results == [plain if t is None else [t] * 6 for t in targets]


def test_state_in_custom_params_and_the_request_itself(server):
    url, _ = server
    r = generate(url, custom_logit_processor=counting_processor(),
                 sampling_params={"custom_params": {"token_id": 100, "delay": 2}, "max_new_tokens": 7})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"][2:] == [100, 101, 102, 103, 104]


def test_disallowed_tokens_processor(server):
    url, _ = server
    first = generate(url).json()["output_ids"][0]
    r = generate(url, custom_logit_processor=DisallowedTokensLogitsProcessor().to_str(),
                 sampling_params={"custom_params": {"token_ids": [first]}})
    assert r.status_code == 200, r.text
    assert first not in r.json()["output_ids"]


def test_a_failing_processor_fails_its_request_alone(server):
    url, _ = server
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(generate, url, custom_logit_processor=raising_processor())
        good = pool.submit(generate, url)
        bad_r, good_r = bad.result(), good.result()
    assert bad_r.status_code == 400, bad_r.text
    message = bad_r.json()["error"]["message"]
    assert "custom_logit_processor" in message and "boom from the client" in message
    assert good_r.status_code == 200 and len(good_r.json()["output_ids"]) == 6
    assert requests.get(f"{url}/health_generate", timeout=60).status_code == 200


@pytest.mark.parametrize("processor, message", [
    ("not json", "not valid JSON"),
    (json.dumps({"callable": dill.dumps(42).hex()}), "must hold a CustomLogitProcessor"),
])
def test_a_bad_processor_string_is_400(server, processor, message):
    url, _ = server
    r = generate(url, custom_logit_processor=processor)
    assert r.status_code == 400, r.text
    assert "custom_logit_processor" in r.json()["error"]["message"] and message in r.json()["error"]["message"]


def test_a_list_of_processors_with_n_is_400(server):
    url, _ = server
    r = generate(url, custom_logit_processor=[force_token_processor()], sampling_params={"n": 2, "temperature": 1})
    assert r.status_code == 400
    assert "Cannot use list custom_logit_processor with parallel_sample_num > 1" in r.json()["error"]["message"]


# ---- a server without it ------------------------------------------------------------------------------------
def test_without_the_flag_a_processor_is_400_naming_the_field(smollm2_server):
    r = generate(smollm2_server, custom_logit_processor=force_token_processor(),
                 sampling_params={"custom_params": {"token_id": 5}})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "custom_logit_processor" in message and "--enable-custom-logit-processor" in message
