import json
import subprocess
import sys

import pytest

from selfspec.cli.main import main

SELFSPEC = [sys.executable, "-m", "selfspec.cli.main"]

BAD_ARGS = [
    (["generate", "x", "--temperature", "-1"], "temperature=-1.0"),
    (["generate", "x", "--top-p", "2"], "top_p=2.0"),
    (["generate", "x", "--top-k", "abc"], "--top-k: invalid int value"),
    (["generate", "x", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "x", "--dtype", "float16"], "--dtype: invalid choice"),
    (["generate", "x", "--seed", "-2"], "seed=-2"),
    (["generate", "x", "--model", "/no/such/model"], "not found"),
    (["generate", "x", "--bogus"], "unrecognized arguments: --bogus"),
    (["generate", "   "], "empty prompt"),
    (["generate", "x", "--raw", "--system", "s"], "--system needs the chat template"),
    (["frobnicate"], "unknown command 'frobnicate'"),
    (["generate", "x", "--gamma", "3"], "--gamma/--ngram need --drafter or --draft-layers"),
    (["generate", "x", "--draft-layers", "0"], "--draft-layers"),
    (["generate", "x", "--draft-layers", "2", "--gamma", "40"], "num_speculative_tokens=40"),
    (["check-distribution"], "--draft-layers"),
    (["check-distribution", "--draft-layers", "2", "--temperature", "0"], "--temperature 0 is greedy"),
    (["check-distribution", "--draft-layers", "2", "--top-p", "7"], "top_p=7.0"),
]


@pytest.mark.parametrize("argv,needle", BAD_ARGS)
def test_bad_arguments_exit_2_with_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_bad_argument_in_a_real_process():
    p = subprocess.run(SELFSPEC + ["generate", "hi", "--top-p", "0"], capture_output=True, text=True)
    assert p.returncode == 2
    assert (
        p.stderr.strip() == "selfspec generate: error: top_p=0.0 is invalid: use a number in (0, 1] (1 turns top-p off)"
    )


def test_help_lists_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--model",
        "--max-tokens",
        "--temperature",
        "--top-p",
        "--top-k",
        "--seed",
        "--dtype",
        "--raw",
        "--json",
    ):
        assert flag in out
    assert main(["--help"]) == 0


def test_generate_json_on_tiny_model(tiny_checkpoint):
    p = subprocess.run(
        SELFSPEC
        + ["generate", "hello", "--model", str(tiny_checkpoint), "--max-tokens", "6", "--ignore-eos", "--json"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert len(out["token_ids"]) == 6 and out["finish_reason"] == "length"
    for key in ("prompt_tokens", "generated_tokens", "tokens_per_second", "time_to_first_token"):
        assert key in out["stats"]


def test_generate_text_default_model_from_stdin():
    p = subprocess.run(
        SELFSPEC + ["generate", "--max-tokens", "24", "--threads", "2"],
        input="What is the capital of France?",
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout
    assert "tokens/s" in p.stderr and "finish:" in p.stderr


def test_generate_speculative_json_on_tiny_model(tiny_checkpoint):
    base = SELFSPEC + [
        "generate",
        "hello",
        "--model",
        str(tiny_checkpoint),
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--json",
    ]
    plain = json.loads(subprocess.run(base, capture_output=True, text=True, check=True).stdout)
    p = subprocess.run(base + ["--draft-layers", "2", "--gamma", "3"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["token_ids"] == plain["token_ids"] and plain["stats"]["spec"] is None
    spec = out["stats"]["spec"]
    for key in (
        "rounds",
        "drafted",
        "accepted",
        "accepted_per_position",
        "acceptance_rate",
        "mean_tokens_per_round",
        "draft_cost_ratio",
    ):
        assert key in spec
    assert spec["draft_layers"] == 2 and spec["num_speculative_tokens"] == 3
    off = json.loads(
        subprocess.run(base + ["--draft-layers", "2", "--no-speculate"], capture_output=True, text=True).stdout
    )
    assert off["stats"]["spec"] is None


def test_generate_compare_plain_on_tiny_model(tiny_checkpoint, capsys):
    """--compare-plain decodes the prompt again without speculation: both speeds, their ratio, a draft
    token's cost in plain steps and (greedy) whether the outputs are identical, in JSON and in text."""
    base = ["generate", "hello", "--model", str(tiny_checkpoint), "--max-tokens", "12", "--ignore-eos"]
    spec = ["--draft-layers", "2", "--gamma", "3", "--compare-plain"]
    assert main(base + spec + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    plain = out["plain"]
    assert plain["identical"] is True and plain["tokens_per_second"] > 0 and plain["draft_cost"] > 0
    assert plain["speedup"] == pytest.approx(out["stats"]["tokens_per_second"] / plain["tokens_per_second"])
    assert main(base + spec + ["--temperature", "0.8", "--seed", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plain"]["identical"] is None  # sampled: not a token-by-token claim
    assert main(base + spec) == 0
    err = capsys.readouterr().err
    assert "against plain decoding of the same prompt" in err and "output identical" in err
    assert main(base + ["--compare-plain"]) == 0  # no profile for the tiny model: the policy decodes plain
    assert "this request decoded plain too" in capsys.readouterr().err
    assert main(base + ["--no-speculate", "--compare-plain"]) == 2
    assert "--compare-plain with --no-speculate" in capsys.readouterr().err


def test_generate_bad_draft_depth_for_model(tiny_checkpoint, capsys):
    assert main(["generate", "x", "--model", str(tiny_checkpoint), "--draft-layers", "4"]) == 2
    assert "draft_layers=4 is invalid for a 4-layer model: use 1..3" in capsys.readouterr().err


def test_check_distribution_on_tiny_model(tiny_checkpoint):
    p = subprocess.run(
        SELFSPEC
        + [
            "check-distribution",
            "--model",
            str(tiny_checkpoint),
            "--draft-layers",
            "2",
            "--gamma",
            "2",
            "--samples",
            "200",
            "--new-tokens",
            "3",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert p.returncode in (0, 1), p.stderr  # 1 would mean "not lossless": the fixed seed makes it 0
    report = json.loads(p.stdout)
    assert p.returncode == 0 and report["lossless"] and report["samples"] == 200
    assert 0 <= report["pvalue"] <= 1 and 0 <= report["statistic"] <= 1


def test_bench_llama_cpp_prefills_every_prompt_in_full(monkeypatch):
    """llama-cpp-python's generate(reset=True) keeps the longest cached prefix of the previous call's
    tokens, so a repeated prompt would skip its prefill, which selfspec's runs never skip: the peer is
    reset before each run. Stub Llama: evaluates only what its cache does not hold."""
    import types

    from selfspec.cli import bench

    evaluated = []

    class Llama:
        def __init__(self, **kwargs):
            self.cached = []

        def reset(self):
            self.cached = []

        def generate(self, tokens, reset=True, **kwargs):
            keep = 0
            while keep < min(len(tokens), len(self.cached)) and tokens[keep] == self.cached[keep]:
                keep += 1
            evaluated.append(len(tokens) - keep)
            self.cached = list(tokens)
            while True:
                yield 7

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=Llama))
    monkeypatch.setattr("selfspec.model.loader.default_gguf_path", lambda: "model.gguf")
    args = types.SimpleNamespace(model="default", temperature=0.0, max_tokens=3)
    runner = bench.Runner(types.SimpleNamespace(max_model_len=2048), args)
    for _ in range(3):
        run = runner._llama_run([1, 2, 3, 4])
    assert run.tokens == [7, 7, 7] and evaluated == [4, 4, 4]
