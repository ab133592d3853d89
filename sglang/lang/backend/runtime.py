"""`Runtime(**server_args)`: start an SGLang server in a subprocess and use it as a frontend backend."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
from typing import Any, Optional, Union

import requests

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.utils import wait_until_healthy


def _serve(server_args: Any) -> None:
    from sglang.srt.entrypoints.http_server import launch_server

    launch_server(server_args)


class Runtime:
    """A server owned by this object: `.endpoint` is its `RuntimeEndpoint`; `.shutdown()` stops it."""

    def __init__(self, log_level: str = "error", launch_timeout: float = 600.0, **kwargs: Any) -> None:
        from sglang.srt.server_args import ServerArgs
        from sglang.test.test_utils import find_free_port

        kwargs.setdefault("host", "127.0.0.1")
        if "port" not in kwargs:
            kwargs["port"] = find_free_port()
        self.server_args = ServerArgs(log_level=log_level, **kwargs)
        self.server_args.validate()
        self.url = self.server_args.url()
        self.generate_url = self.url + "/generate"
        # spawn: the server must not inherit this process's threads or torch state.
        self.pid: Optional[int] = None
        proc = mp.get_context("spawn").Process(target=_serve, args=(self.server_args,), daemon=False)
        proc.start()
        self._proc = proc
        self.pid = proc.pid
        try:
            self._wait_ready(launch_timeout)
            self.endpoint = RuntimeEndpoint(self.url, api_key=self.server_args.api_key)
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self, timeout: float) -> None:
        def exit_reason() -> Optional[str]:
            if self._proc.is_alive():
                return None
            return (f"The server process exited with code {self._proc.exitcode} during startup; "
                    "run with log_level='info' to see why")

        wait_until_healthy(self.url, timeout, exit_reason)

    def shutdown(self) -> None:
        if self.pid is not None:
            from sglang.utils import stop_process_tree

            # SIGTERM first: the server stops its workers and removes its socket and temporary folders itself.
            stop_process_tree(self.pid)
            self._proc.join(timeout=30)
            self.pid = None

    def cache_prefix(self, prefix: str) -> None:
        self.endpoint.cache_prefix(prefix)

    def get_tokenizer(self):
        from transformers import AutoTokenizer

        from sglang.srt.model_loader.resolve import resolve_model_path

        return AutoTokenizer.from_pretrained(resolve_model_path(self.server_args.tokenizer_path))

    def _body(self, prompt: Union[str, list[str]], sampling_params: Optional[dict], return_logprob: bool,
              logprob_start_len: Optional[int], top_logprobs_num: Optional[int], **extra: Any) -> dict:
        body = {"text": prompt, "sampling_params": sampling_params or {}, "return_logprob": return_logprob,
                "logprob_start_len": logprob_start_len, "top_logprobs_num": top_logprobs_num}
        body.update({k: v for k, v in extra.items() if v is not None})
        return {k: v for k, v in body.items() if v is not None}

    def generate(self, prompt: Union[str, list[str]], sampling_params: Optional[dict] = None,
                 return_logprob: bool = False, logprob_start_len: Optional[int] = None,
                 top_logprobs_num: Optional[int] = None, **extra: Any) -> str:
        """The /generate response as a JSON string (as upstream's Runtime returns it)."""
        body = self._body(prompt, sampling_params, return_logprob, logprob_start_len, top_logprobs_num, **extra)
        resp = requests.post(self.generate_url, json=body, timeout=600)
        return json.dumps(resp.json())

    async def async_generate(self, prompt: str, sampling_params: Optional[dict] = None, **extra: Any):
        """Stream the text increments of one prompt."""
        body = self._body(prompt, sampling_params, False, None, None, stream=True, **extra)
        loop = asyncio.get_running_loop()
        resp = await loop.run_in_executor(None, lambda: requests.post(self.generate_url, json=body, stream=True,
                                                                       timeout=600))
        pos = 0
        lines = resp.iter_lines()
        while True:
            line = await loop.run_in_executor(None, next, lines, None)
            if line is None or line == b"data: [DONE]":
                break
            if line.startswith(b"data:"):
                data = json.loads(line[5:])
                yield data["text"][pos:]
                pos = len(data["text"])

    def encode(self, prompt: Union[str, list[str]]) -> str:
        resp = requests.post(self.url + "/encode", json={"text": prompt}, timeout=600)
        return json.dumps(resp.json())

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
