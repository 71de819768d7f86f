"""Graceful shutdown of a real `selfspec serve` process: on SIGTERM or SIGINT it stops admitting (503
shutting_down), lets requests in flight finish within --shutdown-timeout, then ends the rest with an
error chunk and `data: [DONE]`; a second signal cuts the wait short; the process exits 0."""

import json
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.conftest import tiny_hf_model
from tests.test_server import free_port

MODEL = "tiny"
LONG = 8000  # tokens: minutes of decoding on a CPU, so a stream with this many is still going at any signal


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory, default_checkpoint):
    """The tiny random llama with an 8k context, so a stream can outlast the test."""
    out = tmp_path_factory.mktemp("tiny-long")
    model = tiny_hf_model(
        "llama", vocab_size=49152, tie_word_embeddings=True, eos_token_id=2, max_position_embeddings=8192
    )
    model.save_pretrained(out, safe_serialization=True)
    for f in default_checkpoint.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    return out


class ServeProcess:
    def __init__(self, checkpoint, tmp_path, *args: str) -> None:
        self.port = free_port()
        self.log = open(tmp_path / "serve.log", "w+")
        argv = ["serve", "--model", str(checkpoint), "--served-model-name", MODEL, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "selfspec.cli.main", *argv, *args], stdout=self.log, stderr=subprocess.STDOUT
        )
        deadline = time.time() + 180
        while True:
            assert self.proc.poll() is None, self.output()
            assert time.time() < deadline, "server did not come up"
            try:
                if httpx.get(self.url("/health"), timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError("server did not exit:\n" + self.output()) from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class Stream:
    """A streaming completion read in a thread; started once its first chunk arrived (so the request
    is in flight)."""

    def __init__(self, server: ServeProcess, max_tokens: int) -> None:
        self.lines: list[str] = []
        self.started = threading.Event()
        body = {"model": MODEL, "prompt": "go", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self.thread = threading.Thread(target=self._read, args=(server.url("/v1/completions"), body), daemon=True)
        self.thread.start()
        assert self.started.wait(120), "stream did not start"

    def _read(self, url: str, body: dict) -> None:
        with httpx.stream("POST", url, json=body, timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line:
                    self.lines.append(line)
                    self.started.set()

    def finish(self, timeout: float = 60) -> list[str]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "stream did not end"
        return self.lines

    def last_chunk(self) -> dict:
        return json.loads(self.lines[-2][len("data: ") :])


@pytest.fixture
def serve(long_checkpoint, tmp_path):
    servers = []

    def start(*args: str) -> ServeProcess:
        servers.append(ServeProcess(long_checkpoint, tmp_path, *args))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def assert_shutting_down(r: httpx.Response) -> None:
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text


def test_sigterm_mid_stream_cancels_after_the_timeout_and_exits_0(serve):
    server = serve("--shutdown-timeout", "1")
    stream = Stream(server, LONG)
    server.proc.send_signal(signal.SIGTERM)
    lines = stream.finish()
    assert lines[-1] == "data: [DONE]"
    assert stream.last_chunk()["error"]["code"] == "shutting_down"
    assert server.wait(30) == 0, server.output()
    assert "Traceback" not in server.output()


def test_drain_lets_requests_finish_and_a_second_signal_cuts_it_short(serve):
    server = serve("--shutdown-timeout", "120")
    long = Stream(server, LONG)
    short = Stream(server, 40)
    server.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    body = {"model": MODEL, "prompt": "late", "max_tokens": 2}
    assert_shutting_down(httpx.post(server.url("/v1/completions"), json=body, timeout=30))
    assert_shutting_down(httpx.get(server.url("/health"), timeout=30))
    lines = short.finish()  # in flight when the signal came: it finishes normally
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert server.proc.poll() is None and long.thread.is_alive()  # still draining the long one
    server.proc.send_signal(signal.SIGINT)  # a second signal: cancel now, never abort
    lines = long.finish()
    assert lines[-1] == "data: [DONE]" and long.last_chunk()["error"]["code"] == "shutting_down"
    assert server.wait(30) == 0, server.output()
    assert "Traceback" not in server.output()


def test_idle_server_exits_0_at_once_on_sigterm(serve):
    server = serve()
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait(30) == 0, server.output()
