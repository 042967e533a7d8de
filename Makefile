# Two entry points for a fresh machine: `make run` (the main job) and `make test`.
# torch is installed first and pinned, so pip takes the local CPU build instead of
# resolving a multi-GB CUDA build through the other dependencies.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: install run test lint

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/cospec pipeline --config configs/pipeline/toy.yaml

test: install
	$(VENV)/bin/pytest -q --durations=15

lint: install
	$(VENV)/bin/ruff check .
