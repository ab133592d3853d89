"""--api-key on every route but health and metrics, checked route by route from the server's own route table, so
a route added later cannot be left open by mistake."""

from __future__ import annotations

import re

import pytest
import requests

from tests.server_fixtures import running_server

KEY = "sk-test-0123456789"
UNPROTECTED = ("/health", "/health_generate", "/metrics")


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    storage = tmp_path_factory.mktemp("auth-storage")
    with running_server("--api-key", KEY, "--log-level", "error", "--enable-metrics", "--dtype", "float32",
                        "--file-storage-path", str(storage), model=tiny_llama_dir) as url:
        yield url


def _routes(url: str) -> list[tuple[str, str]]:
    """Every (method, path) the app serves, path parameters filled in; the route table is read with the key."""
    table = requests.get(f"{url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"})
    assert table.status_code == 200
    routes = [(method.upper(), re.sub(r"\{[^}]+\}", "x", path))
              for path, ops in table.json()["paths"].items() for method in ops]
    return routes + [("GET", "/openapi.json"), ("GET", "/docs")]


def test_every_route_but_health_and_metrics_needs_the_key(server):
    routes = _routes(server)
    assert len(routes) > 40
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Bearer {KEY}x"}):
            r = requests.request(method, f"{server}{path}", headers=headers, json={}, timeout=60)
            if path in UNPROTECTED:
                assert r.status_code != 401, (method, path)
            else:
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert r.json() == {"error": "Unauthorized"}
        r = requests.request(method, f"{server}{path}", headers={"Authorization": f"Bearer {KEY}"}, json={},
                             timeout=60)
        assert r.status_code != 401, (method, path)
        assert r.status_code < 500, (method, path, r.text[:200])


def test_cors_preflight_is_answered_without_the_key(server):
    r = requests.options(f"{server}/v1/chat/completions", headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] in ("*", "http://example.com")
