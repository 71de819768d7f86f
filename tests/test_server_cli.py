"""`selfspec serve`'s options: listed in --help, bad values rejected on one line (exit 2) before the
model loads, the API key taken from SELFSPEC_API_KEY."""

import pytest

from selfspec.cli.main import main
from selfspec.cli.serve import build_parser

FLAGS = (
    "--api-key",
    "--protect",
    "--docs",
    "--max-body-bytes",
    "--max-messages",
    "--max-message-chars",
    "--max-n",
    "--max-request-tokens",
    "--keep-alive-timeout",
    "--header-timeout",
    "--limit-concurrency",
    "--shutdown-timeout",
)


def test_help_lists_the_server_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(flag in out for flag in FLAGS)


BAD = [
    (["--protect", "health"], "--protect needs --api-key"),
    (["--api-key", "k", "--protect", "health,everything"], "cannot protect everything"),
    (["--max-body-bytes", "0"], "--max-body-bytes"),
    (["--header-timeout", "0"], "--header-timeout"),
    (["--keep-alive-timeout", "-1"], "--keep-alive-timeout"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["--max-n", "0"], "--max-n"),
]


@pytest.mark.parametrize("argv,needle", BAD)
def test_bad_server_options_exit_2_before_loading(argv, needle, capsys, monkeypatch):
    monkeypatch.delenv("SELFSPEC_API_KEY", raising=False)
    # a model that does not exist: reaching the loader would be a different error
    assert main(["serve", "--model", "/no/such/model", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("SELFSPEC_API_KEY", "from-env")
    assert build_parser().parse_args([]).api_key == "from-env"
    assert build_parser().parse_args(["--api-key", "flag"]).api_key == "flag"
    monkeypatch.setenv("SELFSPEC_API_KEY", "")
    assert build_parser().parse_args([]).api_key is None
