# Set-up is part of every target: the first `make run` or `make test` on a fresh machine creates .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and pinned, so that nothing resolves an unpinned (CUDA) torch.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/tapp run $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	@echo "type: ignore comments: $$(grep -r --include='*.py' -c 'type: ignore' tapp_core tasks flows reports | awk -F: '{s += $$2} END {print s}')"

clean:
	rm -rf $(VENV) mlflow.db mlruns mlartifacts out
