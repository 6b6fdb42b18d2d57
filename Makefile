# Two commands do all the set-up on a fresh machine:
#   make test   install (torch 2.13.0 CPU first, then the project), make lint, then the test suite
#   make lint   install, then ruff check, ruff format --check and mypy (configured in pyproject.toml)
#   make demo   install, then train the reference trap config without and with the monitor
#   make docs   install, then build the docs site into site/ (mkdocs build --strict: warnings fail)
#   make test-floor   the test suite on the declared torch floor (2.6.0), in its own venv; not CI's
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(VENV)/bin/pip

.PHONY: install lint test test-floor demo bench docs clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e ".[all,dev]"
	touch $@

install: $(VENV)/.installed

# Lint (ruff) and format check, then the type check: mypy reads its files from pyproject.toml.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Lint first: a lint or type error fails `make test` before pytest runs.
# pytest exits 5 when it collects no test: that is a failure here, never a silent pass.
test: install lint
	$(PY) -m pytest -q -p no:cacheprovider tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The floor pyproject.toml declares (torch>=2.6), tested as a user of it would install it: PyPI's
# torch 2.6.0 is a CUDA build (about 2.5 GB with its NVIDIA libraries), which runs on the CPU. Not
# part of CI (the download); its last result is in docs/benchmarks.md ("The torch floor").
FLOOR_TORCH ?= 2.6.0
FLOOR_VENV  ?= .venv-floor
test-floor:
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/pip install --quiet --upgrade pip
	$(FLOOR_VENV)/bin/pip install --quiet torch==$(FLOOR_TORCH)
	$(FLOOR_VENV)/bin/pip install --quiet -e ".[all,dev]"
	$(FLOOR_VENV)/bin/python -c "import sys, torch; v = torch.__version__; sys.exit(0 if v.startswith('$(FLOOR_TORCH)') else f'make test-floor: torch {v} installed, not $(FLOOR_TORCH)')"
	$(FLOOR_VENV)/bin/python -m pytest -q -p no:cacheprovider tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-floor: pytest collected no tests" >&2; exit 1; fi; exit $$rc

demo: install
	$(PY) -m reference_model.demo

bench: install
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/stability.py

# --strict: a warning (a broken link or anchor, a docstring mkdocstrings cannot read) fails the build.
# NO_MKDOCS_2_WARNING silences the theme's banner about MkDocs 2.0 (printed, not a warning).
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) $(FLOOR_VENV) runs sfmonitor_runs .pytest_cache
