"""Request and connection limits against a live server: the body limit answers 413 before a body is
read (Content-Length or chunked) while /health keeps answering, message count and size limits,
tokenizing off the event loop, and the header and keep-alive timeouts that close idle or slow
connections."""

import json
import socket
import threading
import time

import httpx
import pytest

from selfspec import Engine
from tests.test_server import MODEL, LiveServer

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Engine.from_pretrained(str(tiny_checkpoint))


@pytest.fixture(scope="module")
def live(engine):
    s = LiveServer(
        engine,
        server={"header_timeout": 1.0, "keep_alive_timeout": 1.0},
        max_body_bytes=LIMIT,
        max_messages=3,
        max_message_chars=200,
    )
    yield s
    s.close()


def connect(live) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", live.port), timeout=10)
    return s


def read_response(s: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of one response (the server closes the connection after it, or sends a
    Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
    while len(body) < length:
        body += s.recv(65536)
    return int(head.split()[1]), json.loads(body[:length])


def closed_by_server(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        while True:
            if s.recv(65536) == b"":
                return True
    except socket.timeout:
        return False
    except OSError:
        return True


def test_declared_oversize_body_gets_413_before_it_is_sent(live):
    s = connect(live)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 52428800\r\n\r\n" + b'{"prompt": "' + b"a" * 1000
    )
    t0 = time.time()
    status, body = read_response(s)  # only ~1 kB of the 50 MB was sent
    assert status == 413 and time.time() - t0 < 10
    assert body["error"]["code"] == "request_too_large" and body["error"]["type"] == "invalid_request_error"
    assert closed_by_server(s, 5)


def test_chunked_body_gets_413_once_past_the_limit_and_health_answers_meanwhile(live):
    s = connect(live)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    s.sendall(b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"a" * (LIMIT // 4)
    s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    # an upload in progress holds nothing up
    assert httpx.get(live.url("/health"), timeout=5).status_code == 200
    for _ in range(4):  # now past the limit; the terminating chunk is never sent
        s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    status, body = read_response(s)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert httpx.get(live.url("/health"), timeout=5).status_code == 200


def test_body_under_the_limit_is_served(live):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "padding": "x" * (LIMIT // 2)}
    r = httpx.post(live.url("/v1/completions"), json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_httpx_sees_413_for_a_big_body(live):
    r = httpx.post(live.url("/v1/completions"), content=b"x" * (4 * LIMIT), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 4}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 201}]}, "messages.0.content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "x" * 201}]},
            "messages.1.content",
        ),
        ("/v1/completions", {"prompt": "x" * 201}, "prompt"),
    ],
)
def test_message_count_and_size_limits(live, path, body, param):
    r = httpx.post(live.url(path), json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tokenizing_runs_off_the_event_loop(engine, monkeypatch):
    """A slow tokenization (here: one held until /health has answered) must not hold up other requests;
    it runs in the single tokenizer thread. Were it on the event loop, /health could not answer while it
    waits, and its 5 s timeout would fail the test."""
    threads = []
    release = threading.Event()
    real_encode = engine.encode

    def slow_encode(*args, **kw):
        threads.append(threading.current_thread().name)
        release.wait(30)
        return real_encode(*args, **kw)

    monkeypatch.setattr(engine, "encode", slow_encode)
    server = LiveServer(engine)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        slow = threading.Thread(target=lambda: httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60))
        slow.start()
        deadline = time.time() + 10
        while not threads:
            assert time.time() < deadline
            time.sleep(0.01)
        # answered while the tokenization still waits: release is set only below
        assert httpx.get(server.url("/health"), timeout=5).status_code == 200
        release.set()
        slow.join(60)
        assert threads == ["selfspec-tokenize_0"]
    finally:
        release.set()
        server.close()


def test_partial_headers_are_cut_off_after_the_header_timeout(live):
    quiet = [connect(live) for _ in range(10)]
    for s in quiet:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
    trickler = connect(live)
    trickler.sendall(b"GET /health HTTP/1.1\r\n")
    for _ in range(4):  # a byte now and then must not keep it open either
        time.sleep(0.4)
        try:
            trickler.sendall(b"X: y\r\n")
        except OSError:
            break
    assert all(closed_by_server(s, 5) for s in quiet + [trickler])
    assert httpx.get(live.url("/health"), timeout=5).status_code == 200


def test_a_slow_but_timely_client_is_served(live):
    s = connect(live)
    s.sendall(b"GET /health HTTP/1.1\r\n")
    time.sleep(0.3)
    s.sendall(b"Host: x\r\n\r\n")
    status, body = read_response(s)
    assert status == 200 and body == {"status": "ok"}


def test_idle_keep_alive_connection_is_closed(live):
    s = connect(live)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_response(s)[0] == 200
    assert closed_by_server(s, 5)  # keep_alive_timeout is 1 s here
