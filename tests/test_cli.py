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
]


@pytest.mark.parametrize("argv,needle", BAD_ARGS)
def test_bad_arguments_exit_2_with_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_bad_argument_in_a_real_process():
    p = subprocess.run(SELFSPEC + ["generate", "hi", "--top-p", "0"], capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.strip() == "selfspec generate: error: top_p=0.0 is invalid: use a number in (0, 1] (1 turns top-p off)"


def test_help_lists_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--dtype", "--raw", "--json"):
        assert flag in out
    assert main(["--help"]) == 0


def test_generate_json_on_tiny_model(tiny_checkpoint):
    p = subprocess.run(
        SELFSPEC + ["generate", "hello", "--model", str(tiny_checkpoint), "--max-tokens", "6", "--ignore-eos", "--json"],
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
