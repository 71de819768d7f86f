"""The HTTP server against a tiny model: the official openai client, streaming, simultaneous mixed
requests, a table of bad inputs, overload, a client that disconnects mid-stream, and /metrics."""

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from selfspec import Engine, SamplingParams
from selfspec.serving.runner import make_server
from selfspec.serving.server import create_app

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """The app under the same uvicorn server `selfspec serve` runs, in a thread. `server` takes
    make_server's options (timeouts); the rest go to create_app."""

    def __init__(self, engine, server: dict | None = None, **kw) -> None:
        self.app = create_app(engine, served_model_name=MODEL, **kw)
        self.port = free_port()
        self.server = make_server(self.app, port=self.port, log_level="error", **(server or {}))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            try:
                if httpx.get(self.url("/health"), timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        self.scheduler = self.app.state.scheduler

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_idle(self, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while self.scheduler.running or self.scheduler.waiting:
            assert time.time() < deadline, "requests still running"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Engine.from_pretrained(str(tiny_checkpoint))


@pytest.fixture(scope="module")
def live(engine):
    s = LiveServer(engine)
    yield s
    s.close()


def blocks_free_of_requests(live) -> bool:
    live.wait_idle()
    return live.scheduler.cache.num_used_blocks == len(live.scheduler.prefix)


def test_openai_client_completions_chat_and_streaming(live, engine):
    from openai import OpenAI

    client = OpenAI(base_url=live.url("/v1"), api_key="unused")
    assert [m.id for m in client.models.list().data] == [MODEL]
    c = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert c.choices[0].finish_reason in ("length", "stop") and c.usage.completion_tokens >= 1
    expected = engine.generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=8), chat=False, speculation=None
    )
    assert c.choices[0].text == expected.text
    messages = [{"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens > 0
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True)
    pieces = [ch.choices[0].delta.content or "" for ch in stream if ch.choices]
    assert "".join(pieces) == text
    spec = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body={"speculative": {"enabled": True, "draft_layers": 2, "num_speculative_tokens": 3}},
    )
    assert spec.choices[0].message.content == text  # lossless
    usage = spec.usage.model_dump()
    assert usage["draft_tokens"] > 0 and 0 <= usage["accepted_tokens"] <= usage["draft_tokens"]
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in stream) == c.choices[0].text
    assert blocks_free_of_requests(live)


def test_sse_format_ends_with_done(live):
    body = {
        "model": MODEL,
        "prompt": "abc",
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", live.url("/v1/completions"), json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][6:])
    assert usage["usage"]["completion_tokens"] == 5 and usage["choices"] == []


def test_simultaneous_mixed_requests(live, engine):
    jobs = []
    for i in range(18):
        greedy = i % 3 != 0
        body = {
            "model": MODEL,
            "max_tokens": 6 + i % 5,
            "temperature": 0 if greedy else 0.9,
            "seed": i,
            "ignore_eos": True,
        }
        if i % 2:
            body["speculative"] = {"enabled": True, "draft_layers": 1 + i % 3, "num_speculative_tokens": 1 + i % 4}
        if i % 4 == 0:
            body["messages"] = [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"Question {i}?"},
            ]
        else:
            body["prompt"] = f"Request number {i} says"
        jobs.append(body)

    def send(body):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        return httpx.post(live.url(path), json=body, timeout=120)

    with ThreadPoolExecutor(18) as pool:
        responses = list(pool.map(send, jobs))
    for body, resp in zip(jobs, responses):
        assert resp.status_code == 200, resp.text
        data = resp.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if "messages" in body else choice["text"]
        assert data["usage"]["completion_tokens"] == body["max_tokens"]
        if body["temperature"] == 0:  # greedy: equal to the request decoded alone
            if "messages" in body:
                alone = engine.generate(
                    [{"role": m["role"], "content": m["content"]} for m in body["messages"]],
                    SamplingParams(temperature=0, max_tokens=body["max_tokens"], ignore_eos=True),
                    speculation=None,
                )
            else:
                alone = engine.generate(
                    body["prompt"],
                    SamplingParams(temperature=0, max_tokens=body["max_tokens"], ignore_eos=True),
                    chat=False,
                    speculation=None,
                )
            assert text == alone.text
    assert blocks_free_of_requests(live)


BAD = [
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": -3}, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 17}, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 600}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 10**7]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": -1}, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**64}, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x"}, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "speculative": {"draft_layers": 99}}, "speculative"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "speculative": {"num_speculative_tokens": 0}}, "speculative"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "speculative": {"enabled": "sure"}}, "speculative"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -4},
        "max_tokens",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        "max_tokens",
    ),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_400_with_openai_error(live, path, body, param):
    r = httpx.post(live.url(path), json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and param in (err["param"] or "") + err["message"]


def test_malformed_json_and_wrong_body_type(live):
    r = httpx.post(
        live.url("/v1/completions"),
        content=b'{"model": "tiny", "prompt": ',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(live.url("/v1/completions"), json=["not", "an", "object"])
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_overload_gets_429_with_retry_after(engine):
    server = LiveServer(engine, max_batch_size=1, max_waiting=1)
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
        with ThreadPoolExecutor(6) as pool:
            responses = list(
                pool.map(lambda _: httpx.post(server.url("/v1/completions"), json=body, timeout=120), range(6))
            )
        codes = sorted(r.status_code for r in responses)
        assert codes.count(200) >= 2 and 429 in codes
        busy = next(r for r in responses if r.status_code == 429)
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["code"] == "overloaded"
    finally:
        server.close()


def test_client_disconnect_mid_stream_frees_blocks(live):
    body = {"model": MODEL, "prompt": "stream me", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", live.url("/v1/completions"), json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert live.scheduler.running
    # the connection is closed: the request must be cancelled long before its 400 tokens
    deadline = time.time() + 10
    while live.scheduler.running:
        assert time.time() < deadline, "request kept running after the client left"
        time.sleep(0.02)
    assert blocks_free_of_requests(live)


def test_client_disconnect_while_waiting_cancels_a_non_streaming_request(live, engine, monkeypatch):
    step = engine.step_batch

    def slow_step(*args, **kw):  # 400 tokens now take >= 8 s: the client leaves long before
        time.sleep(0.02)
        return step(*args, **kw)

    monkeypatch.setattr(engine, "step_batch", slow_step)
    subs = []
    submit = live.scheduler.submit
    monkeypatch.setattr(live.scheduler, "submit", lambda sub: subs.append(sub) or submit(sub))
    body = {"model": MODEL, "prompt": "wait for me", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url("/v1/completions"), json=body, timeout=httpx.Timeout(30, read=1.0))
    (sub,) = subs
    deadline = time.time() + 10
    while sub in live.scheduler.running or sub in live.scheduler.waiting:
        assert time.time() < deadline, "request kept running after the client left"
        time.sleep(0.02)
    assert sub.cancelled and len(sub.req.output_ids) < 400
    assert blocks_free_of_requests(live)


def test_metrics_after_traffic(live):
    body = {
        "model": MODEL,
        "prompt": "count",
        "max_tokens": 10,
        "temperature": 0,
        "speculative": {"enabled": True, "draft_layers": 2},
    }
    assert httpx.post(live.url("/v1/completions"), json=body, timeout=60).status_code == 200
    body["speculative"] = {"drafter": "lookup", "num_speculative_tokens": 3, "ngram": 2}
    assert httpx.post(live.url("/v1/completions"), json=body, timeout=60).status_code == 200
    text = httpx.get(live.url("/metrics")).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    assert values["selfspec_spec_decode_num_drafts_total"] > 0
    assert (
        values["selfspec_spec_decode_num_draft_tokens_total"]
        >= values["selfspec_spec_decode_num_accepted_tokens_total"]
    )
    assert values["selfspec_generation_tokens_total"] >= 10
    assert values["selfspec_time_to_first_token_seconds_count"] >= 1
    assert values["selfspec_inter_token_latency_seconds_count"] >= 1
    assert values["selfspec_e2e_request_latency_seconds_count"] >= 1
    assert 'selfspec_request_success_total{finished_reason="length"}' in values
    for gauge in (
        "selfspec_num_requests_running",
        "selfspec_num_requests_waiting",
        "selfspec_kv_cache_blocks_used",
        "selfspec_kv_cache_blocks_free",
    ):
        assert gauge in values
    assert "selfspec_spec_decode_num_accepted_tokens_per_pos_total" in text
    for drafter in ("exit", "lookup"):  # per drafter, beside the totals
        assert f'selfspec_spec_decode_drafter_draft_tokens_total{{drafter="{drafter}"}}' in values
