"""API-key authentication: Bearer auth on /v1/* in OpenAI's error shape, /health and /metrics open
unless protected, the API docs off unless asked for."""

import httpx
import pytest

from selfspec import Engine
from selfspec.serving.server import create_app
from tests.test_server import MODEL, LiveServer

KEY = "sk-test-123"


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Engine.from_pretrained(str(tiny_checkpoint))


@pytest.fixture(scope="module")
def live(engine):
    s = LiveServer(engine, api_key=KEY)
    yield s
    s.close()


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    assert r.json()["error"] == {
        "message": r.json()["error"]["message"],
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }


@pytest.mark.parametrize("headers", [{}, auth("wrong"), {"Authorization": KEY}, {"Authorization": "Basic " + KEY}])
def test_v1_needs_the_key(live, headers):
    assert_401(httpx.get(live.url("/v1/models"), headers=headers))
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert_401(httpx.post(live.url("/v1/completions"), json=body, headers=headers))
    assert_401(httpx.post(live.url("/v1/nonexistent"), json=body, headers=headers))


def test_the_key_opens_v1_and_the_openai_client_works(live):
    from openai import AuthenticationError, OpenAI

    assert httpx.get(live.url("/v1/models"), headers=auth()).status_code == 200
    client = OpenAI(base_url=live.url("/v1"), api_key=KEY)
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=live.url("/v1"), api_key="nope").models.list()


def test_health_and_metrics_open_by_default_docs_off(live):
    assert httpx.get(live.url("/health")).status_code == 200
    assert httpx.get(live.url("/metrics")).status_code == 200
    for path in ("/docs", "/redoc", "/openapi.json"):
        r = httpx.get(live.url(path), headers=auth())
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


def test_protect_health_metrics_and_docs(engine):
    s = LiveServer(engine, api_key=KEY, protect=("health", "metrics", "docs"), docs=True)
    try:
        for path in ("/health", "/metrics", "/docs", "/openapi.json"):
            assert_401(httpx.get(s.url(path)))
            assert httpx.get(s.url(path), headers=auth()).status_code == 200
    finally:
        s.close()


def test_docs_when_asked_for_without_a_key(engine):
    s = LiveServer(engine, docs=True)
    try:
        assert httpx.get(s.url("/docs")).status_code == 200
        assert "/v1/completions" in httpx.get(s.url("/openapi.json")).json()["paths"]
        assert httpx.get(s.url("/v1/models")).status_code == 200  # no key configured: open
    finally:
        s.close()


def test_bad_protect_options_fail_at_once(engine):
    with pytest.raises(ValueError, match="needs an API key"):
        create_app(engine, protect=("health",))
    with pytest.raises(ValueError, match="cannot protect"):
        create_app(engine, api_key=KEY, protect=("everything",))
