"""Checks SGLang's server tests run against a live server: logprob shapes, and no KV leak after a workload.

Re-exported by sglang.test.test_utils, where SGLang's tests import them from.
"""

from __future__ import annotations

import os
import tempfile
import time
import unittest
from collections.abc import Callable
from typing import Any

import requests


def run_logprob_check(self: unittest.TestCase, arg: tuple) -> None:
    """One /generate on `self.base_url` with arg = (input_len, output_len, temperature, logprob_start_len,
    return_logprob, top_logprobs_num) over the prompt ids 0..input_len-1; asserts the token counts, the lengths of
    the logprob lists, and (at temperature 0) that each output token is its step's top-1 (or tied with it)."""
    input_len, output_len, temperature, logprob_start_len, return_logprob, top_logprobs_num = arg
    response = requests.post(self.base_url + "/generate", json={  # type: ignore[attr-defined]
        "input_ids": list(range(input_len)),
        "sampling_params": {"temperature": temperature, "max_new_tokens": output_len, "ignore_eos": True},
        "return_logprob": return_logprob,
        "logprob_start_len": logprob_start_len,
        "top_logprobs_num": top_logprobs_num,
    })
    self.assertEqual(response.status_code, 200, response.text)
    meta = response.json()["meta_info"]
    self.assertEqual(meta["prompt_tokens"], input_len)
    self.assertEqual(meta["completion_tokens"], output_len)
    if not return_logprob:
        return
    self.assertEqual(len(meta["input_token_logprobs"]) + logprob_start_len, input_len)
    self.assertEqual(len(meta["output_token_logprobs"]), output_len)
    if not top_logprobs_num:
        return
    self.assertEqual(len(meta["input_top_logprobs"]) + logprob_start_len, input_len)
    self.assertEqual(len(meta["output_top_logprobs"]), output_len)
    for chosen, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        self.assertEqual(len(top), top_logprobs_num)
        if temperature == 0:
            # The chosen token is the first entry, or tied in logprob with the entries before it.
            rank = next((r for r, entry in enumerate(top) if list(entry) == list(chosen)), None)
            self.assertIsNotNone(rank, f"{chosen} is not among the top logprobs {top}")
            assert rank is not None
            self.assertTrue(all(top[r][0] == top[0][0] for r in range(rank + 1)), f"{chosen} is not top-1: {top}")


def run_and_check_memory_leak(
    workload_func: Callable[[str, str], Any],
    disable_radix_cache: bool,
    enable_mixed_chunk: bool,
    disable_overlap: bool,
    chunked_prefill_size: int,
    assert_has_abort: bool,
) -> None:
    """Start a server of DEFAULT_MODEL_NAME_FOR_TEST with debug logs, run `workload_func(base_url, model)`, wait
    for the server to go idle, and assert from its log that it started, reported no memory leak (the scheduler's
    idle invariant check), and (with `assert_has_abort`) aborted a request."""
    from sglang.srt.utils import kill_process_tree
    from sglang.test.test_utils import (
        DEFAULT_MODEL_NAME_FOR_TEST,
        DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH,
        find_free_port,
        popen_launch_server,
    )

    other_args = ["--chunked-prefill-size", chunked_prefill_size, "--log-level", "debug"]
    if disable_radix_cache:
        other_args.append("--disable-radix-cache")
    if enable_mixed_chunk:
        other_args.append("--enable-mixed-chunk")
    if disable_overlap:
        other_args.append("--disable-overlap-schedule")
    model = DEFAULT_MODEL_NAME_FOR_TEST
    base_url = f"http://127.0.0.1:{find_free_port()}"
    with tempfile.TemporaryDirectory(prefix="sglang-leak-check-") as folder:
        out_path, err_path = os.path.join(folder, "stdout.txt"), os.path.join(folder, "stderr.txt")
        with open(out_path, "w") as out, open(err_path, "w") as err:
            proc = popen_launch_server(model, base_url, timeout=DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH,
                                       other_args=other_args, return_stdout_stderr=(out, err))
            try:
                workload_func(base_url, model)
                _wait_idle_and_check(base_url)
            finally:
                kill_process_tree(proc.pid)
        lines = open(out_path).read().splitlines() + open(err_path).read().splitlines()
    assert any("Uvicorn running" in line or "fired up and ready" in line for line in lines), "no server started"
    leaks = [line for line in lines if "leak" in line]
    assert not leaks, leaks
    if assert_has_abort:
        assert any("Abort" in line for line in lines), "no request was aborted"


def _wait_idle_and_check(base_url: str, timeout: float = 60.0) -> None:
    """Wait until nothing runs or waits, then ask for the scheduler's state: an idle scheduler checks its memory
    invariant when asked (and logs a leak it finds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if requests.get(f"{base_url}/get_load", timeout=30).json()["load"] == 0:
            break
        time.sleep(0.2)
    requests.get(f"{base_url}/get_server_info", timeout=30).raise_for_status()
