"""The OpenAI parameters beyond the basics: logprobs (completions and chat, streamed too), echo, n,
penalties and logit_bias; the ones not implemented rejected by name; and every error in OpenAI's
shape (unknown model, unknown route, wrong method, an unhandled exception, a lone surrogate, a
client error found after the request was accepted, for a streaming request too)."""

import json
import math

import httpx
import pytest

from selfspec import Engine
from tests.test_server import MODEL, LiveServer, blocks_free_of_requests


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Engine.from_pretrained(str(tiny_checkpoint))


@pytest.fixture(scope="module")
def live(engine):
    s = LiveServer(engine)
    yield s
    s.close()


def post(live, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(live.url(path), json={"model": MODEL, **body}, timeout=120, **kw)


def stream_chunks(live, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", live.url(path), json={"model": MODEL, **body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
CHAT = [{"role": "user", "content": "Say something."}]


# ---- not implemented: rejected by name, accepted at their no-op values -----------------------------------
UNSUPPORTED = [
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": {"name": "f"}}, "function_call"),
    ("/v1/chat/completions", {"parallel_tool_calls": False}, "parallel_tool_calls"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy"}}, "audio"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"suffix": "the end"}, "suffix"),
    ("/v1/completions", {"logprobs": 2, "echo": True}, "echo"),
]


@pytest.mark.parametrize("path,extra,param", UNSUPPORTED, ids=[u[2] for u in UNSUPPORTED])
def test_unsupported_parameters_are_rejected_by_name(live, path, extra, param):
    body = {"messages": CHAT} if "chat" in path else {"prompt": "hi"}
    err = assert_openai_error(post(live, path, {**body, **extra}), 400, param)
    assert err["type"] == "invalid_request_error"


def test_no_op_values_of_unsupported_parameters_are_accepted(live):
    chat = {
        "messages": CHAT,
        "max_tokens": 2,
        "tools": [],
        "tool_choice": "none",
        "functions": None,
        "function_call": "none",
        "parallel_tool_calls": True,
        "response_format": {"type": "text"},
        "modalities": ["text"],
        "audio": None,
        "prediction": None,
        "user": "someone",
    }
    assert post(live, "/v1/chat/completions", chat).status_code == 200
    completion = {"prompt": "hi", "max_tokens": 2, "best_of": 1, "suffix": None, "echo": False, "logprobs": None}
    assert post(live, "/v1/completions", completion).status_code == 200


BAD_VALUES = [
    ("/v1/completions", {"presence_penalty": 99}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"49152": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/completions", {"n": 17}, "n"),
    ("/v1/completions", {"seed": 2**64}, "seed"),
]


@pytest.mark.parametrize("path,extra,param", BAD_VALUES, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD_VALUES)])
def test_bad_parameter_values_name_the_parameter(live, path, extra, param):
    body = {"messages": CHAT} if "chat" in path else {"prompt": "hi"}
    assert_openai_error(post(live, path, {**body, **extra}), 400, param)


# ---- errors in OpenAI's shape ---------------------------------------------------------------------------
def test_unknown_model_is_404_model_not_found(live):
    assert_openai_error(
        post(live, "/v1/completions", {"prompt": "x", "model": "gpt-4"}), 404, "model", "model_not_found"
    )
    r = post(live, "/v1/chat/completions", {"messages": CHAT, "model": "gpt-4", "stream": True})
    assert_openai_error(r, 404, "model", "model_not_found")


def test_unknown_route_and_wrong_method(live):
    err = assert_openai_error(httpx.get(live.url("/v1/nothing-here")), 404)
    assert "/v1/nothing-here" in err["message"]
    assert_openai_error(httpx.get(live.url("/v1/completions")), 405)
    assert_openai_error(httpx.delete(live.url("/health")), 405)


def test_unhandled_exception_is_a_500_in_openai_shape(live, monkeypatch):
    def boom(*args, **kw):
        raise RuntimeError("something broke")

    monkeypatch.setattr(live.app.state.service, "plan", boom)
    err = assert_openai_error(post(live, "/v1/completions", {"prompt": "x"}), 500)
    assert err["type"] == "server_error" and "something broke" not in err["message"]


@pytest.mark.parametrize(
    "path,raw,param",
    [
        ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", '{"model": "tiny", "prompt": ["a\\udfff"]}', "prompt"),
        ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d"}]}', "messages"),
        (
            "/v1/chat/completions",
            '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
            "messages",
        ),
    ],
)
def test_lone_surrogate_is_a_400_naming_the_field(live, path, raw, param):
    r = httpx.post(live.url(path), content=raw.encode(), headers={"content-type": "application/json"}, timeout=30)
    err = assert_openai_error(r, 400)
    assert err["param"].startswith(param) and "surrogate" in err["message"]


def test_empty_stop_strings_mean_no_stop(live):
    texts = [
        post(live, "/v1/completions", {"prompt": "abc", **GREEDY, **extra}).json()["choices"][0]["text"]
        for extra in ({}, {"stop": ""}, {"stop": [""]}, {"stop": ["", ""]})
    ]
    assert len(set(texts)) == 1


def test_client_error_found_after_acceptance_is_4xx_for_streams_too(live):
    # no draft head at depth 2 on this model: the scheduler finds that when it admits the request
    spec = {"speculative": {"drafter": "head", "draft_layers": 2}}
    for stream in (False, True):
        r = post(live, "/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": stream, **spec})
        err = assert_openai_error(r, 400)
        assert "draft head" in err["message"]
    assert blocks_free_of_requests(live)


# ---- logprobs ---------------------------------------------------------------------------------------------
def test_completion_logprobs(live):
    r = post(live, "/v1/completions", {"prompt": "Once upon a time", "logprobs": 3, **GREEDY}).json()
    choice = r["choices"][0]
    lp = choice["logprobs"]
    n = r["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert math.isfinite(logprob) and logprob <= 0
        assert token in top and 1 <= len(top) <= 4
        assert logprob == pytest.approx(max(top.values()), abs=1e-5)  # greedy takes the most likely


def test_completion_logprobs_zero_gives_the_chosen_tokens_only(live):
    lp = post(live, "/v1/completions", {"prompt": "abc", "logprobs": 0, **GREEDY}).json()["choices"][0]["logprobs"]
    assert all(len(top) == 1 and token in top for token, top in zip(lp["tokens"], lp["top_logprobs"]))


def test_chat_logprobs(live):
    body = {"messages": CHAT, "logprobs": True, "top_logprobs": 2, **GREEDY}
    r = post(live, "/v1/chat/completions", body).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert bytes(entry["bytes"]).decode("utf-8", errors="replace") == entry["token"]
        assert len(entry["top_logprobs"]) == 2
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"], abs=1e-5)
    # logprobs=true alone: the chosen tokens, no alternatives; without logprobs: null
    r = post(live, "/v1/chat/completions", {"messages": CHAT, "logprobs": True, **GREEDY}).json()
    assert all(e["top_logprobs"] == [] for e in r["choices"][0]["logprobs"]["content"])
    assert post(live, "/v1/chat/completions", {"messages": CHAT, **GREEDY}).json()["choices"][0]["logprobs"] is None


def test_streamed_logprobs_match_the_whole_response(live):
    body = {"prompt": "Once upon a time", "logprobs": 2, **GREEDY}
    whole = post(live, "/v1/completions", body).json()["choices"][0]["logprobs"]
    parts = [c["choices"][0]["logprobs"] for c in stream_chunks(live, "/v1/completions", body) if c["choices"]]
    parts = [p for p in parts if p]
    assert {k: sum((p[k] for p in parts), []) for k in whole} == whole

    body = {"messages": CHAT, "logprobs": True, "top_logprobs": 1, **GREEDY}
    whole = post(live, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    chunks = stream_chunks(live, "/v1/chat/completions", body)
    streamed = [
        e
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == whole


# ---- echo and n ------------------------------------------------------------------------------------------
def test_echo_prepends_the_prompt(live, engine):
    plain = post(live, "/v1/completions", {"prompt": "Once upon", **GREEDY}).json()["choices"][0]["text"]
    echoed = post(live, "/v1/completions", {"prompt": "Once upon", "echo": True, **GREEDY}).json()
    assert echoed["choices"][0]["text"] == "Once upon" + plain
    chunks = stream_chunks(live, "/v1/completions", {"prompt": "Once upon", "echo": True, **GREEDY})
    assert chunks[0]["choices"][0]["text"] == "Once upon"
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Once upon" + plain
    ids = engine.tokenizer("Once upon").input_ids
    by_ids = post(live, "/v1/completions", {"prompt": ids, "echo": True, **GREEDY}).json()["choices"][0]["text"]
    assert by_ids == engine.tokenizer.decode(ids) + plain


def test_n_choices(live):
    body = {"prompt": "Once upon a time", "n": 3, "max_tokens": 5, "ignore_eos": True, "seed": 7, "temperature": 1.0}
    r = post(live, "/v1/completions", body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert r["usage"]["completion_tokens"] == 15
    assert r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + 15
    texts = [c["text"] for c in r["choices"]]
    assert len(set(texts)) > 1  # seeds seed, seed+1, seed+2
    assert [c["text"] for c in post(live, "/v1/completions", body).json()["choices"]] == texts  # reproducible
    greedy = post(live, "/v1/completions", {"prompt": "Once upon a time", "n": 2, **GREEDY}).json()
    assert greedy["choices"][0]["text"] == greedy["choices"][1]["text"]
    assert blocks_free_of_requests(live)


def test_n_choices_streamed(live):
    body = {
        "messages": CHAT,
        "n": 2,
        "max_tokens": 4,
        "ignore_eos": True,
        "seed": 3,
        "stream_options": {"include_usage": True},
    }
    chunks = stream_chunks(live, "/v1/chat/completions", body)
    texts, reasons = {0: "", 1: ""}, {}
    for c in chunks:
        for choice in c["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
            if choice["finish_reason"]:
                reasons[choice["index"]] = choice["finish_reason"]
    assert reasons == {0: "length", 1: "length"}
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    whole = post(live, "/v1/chat/completions", {**body, "stream": False}).json()
    assert [c["message"]["content"] for c in whole["choices"]] == [texts[0], texts[1]]


def test_openai_client_with_the_new_parameters(live):
    from openai import OpenAI

    client = OpenAI(base_url=live.url("/v1"), api_key="unused")
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=4,
        n=2,
        logprobs=True,
        top_logprobs=2,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"5": -100},
        seed=1,
    )
    assert len(r.choices) == 2 and len(r.choices[1].logprobs.content[0].top_logprobs) == 2
    c = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, logprobs=1, echo=False, temperature=0)
    assert len(c.choices[0].logprobs.tokens) == c.usage.completion_tokens


# ---- penalties and logit_bias reach the engine --------------------------------------------------------------
def test_logit_bias_steers_greedy_decoding(live, engine):
    token = engine.tokenizer(" cat").input_ids[-1]
    r = post(live, "/v1/completions", {"prompt": "hello", "logit_bias": {str(token): 100}, **GREEDY}).json()
    assert r["choices"][0]["text"] == " cat" * GREEDY["max_tokens"]


def test_penalties_and_bias_reach_the_scheduler(live, monkeypatch):
    seen = []
    submit = live.scheduler.submit
    monkeypatch.setattr(live.scheduler, "submit", lambda sub: seen.append(sub.params) or submit(sub))
    body = {
        "prompt": "hi",
        "max_tokens": 2,
        "presence_penalty": 0.5,
        "frequency_penalty": -1.5,
        "repetition_penalty": 1.3,
        "logit_bias": {"7": -100, "3": 2.5},
        "seed": 2**64 - 1,
        "n": 2,
    }
    assert post(live, "/v1/completions", body).status_code == 200
    first, second = seen
    assert (first.presence_penalty, first.frequency_penalty, first.repetition_penalty) == (0.5, -1.5, 1.3)
    assert first.logit_bias == ((3, 2.5), (7, -100))
    assert (first.seed, second.seed) == (2**64 - 1, 0)  # seed + i, wrapped into [0, 2**64)
