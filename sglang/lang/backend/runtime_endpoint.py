"""`RuntimeEndpoint`: the frontend backend for a running SGLang server, over its native HTTP API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Optional, Union

import requests

from sglang.global_config import global_config
from sglang.lang.backend.native_backend import NativeBackend
from sglang.lang.chat_template import chat_template_registry, get_chat_template, get_chat_template_by_model_path

# Connecting must be quick (a server that is down fails at once); reading may take a long generation.
_CONNECT_TIMEOUT = 10.0


class RuntimeEndpoint(NativeBackend):
    def __init__(self, base_url: str, api_key: Optional[str] = None, verify: Any = None,
                 chat_template_name: Optional[str] = None) -> None:
        super().__init__()
        self.base_url = base_url.rstrip("/")
        self.api_key, self.verify = api_key, verify
        self.model_info = self._get("/get_model_info")
        if chat_template_name:
            self.chat_template = get_chat_template(chat_template_name)
        else:
            self.chat_template = self._server_chat_template() or get_chat_template_by_model_path(
                self.model_info["model_path"])

    def _server_chat_template(self):
        """The server's own template when it was started with a `--chat-template` this registry knows."""
        try:
            name = self._get("/get_server_info").get("chat_template")
        except RuntimeError:
            return None
        if isinstance(name, str) and name in chat_template_registry:
            return chat_template_registry[name]
        return None

    def get_model_name(self) -> str:
        return self.model_info["model_path"]

    # ---- HTTP -------------------------------------------------------------------------------------
    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json; charset=utf-8"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _request(self, method: str, path: str, body: Any = None, stream: bool = False) -> requests.Response:
        url = self.base_url + path
        try:
            resp = requests.request(
                method, url, data=None if body is None else json.dumps(body).encode("utf-8"),
                headers=self._headers(), verify=self.verify, stream=stream,
                timeout=(_CONNECT_TIMEOUT, global_config.request_timeout),
            )
        except requests.exceptions.ConnectionError as e:
            raise ConnectionError(f"Cannot reach the SGLang server at {self.base_url}: is it running? ({e})") from e
        except requests.exceptions.Timeout as e:
            raise TimeoutError(f"The SGLang server at {self.base_url} did not answer {path} in time") from e
        if resp.status_code != 200:
            try:
                detail = resp.json()
            except ValueError:
                detail = resp.text
            raise RuntimeError(f"{method} {path} failed with HTTP {resp.status_code}: {detail}")
        return resp

    def _get(self, path: str) -> Any:
        return self._request("GET", path).json()

    def _generate_raw(self, body: dict) -> Union[dict, list]:
        return self._request("POST", "/generate", body).json()

    def _generate_stream_raw(self, body: dict) -> Iterator[dict]:
        resp = self._request("POST", "/generate", body, stream=True)
        try:
            for line in resp.iter_lines(decode_unicode=False):
                line = line.decode("utf-8")
                if not line.startswith("data:"):
                    continue
                if line.strip() == "data: [DONE]":
                    break
                yield json.loads(line[5:].strip())
        finally:
            resp.close()

    # ---- control ----------------------------------------------------------------------------------
    def flush_cache(self) -> Any:
        return self._request("POST", "/flush_cache").text

    def get_server_info(self) -> dict:
        return self._get("/get_server_info")

