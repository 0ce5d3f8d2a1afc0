# Set-up is part of every target: the first `make run` or `make test` on a fresh machine creates .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

FASHION_MNIST := /usr/share/datasets/fashion-mnist
FORTUNES := /usr/share/games/fortunes

.PHONY: run test lint bench clean data

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and pinned, so that nothing resolves an unpinned (CUDA) torch.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Real data for the accuracy table: Debian's dataset-fashion-mnist, and for the GPT Debian's fortunes (text), installed
# where this is root and has apt-get;
# elsewhere one line says how. Nothing is downloaded by TAPP itself. (CIFAR-10: give `tapp run --data-dir DIR`.)
data:
	@if [ -f $(FASHION_MNIST)/t10k-labels-idx1-ubyte.gz ] || [ -f $(FASHION_MNIST)/t10k-labels-idx1-ubyte ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing Debian's dataset-fashion-mnist (real data for the accuracy table)"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q dataset-fashion-mnist >/dev/null; } || \
	  echo "could not install dataset-fashion-mnist: the accuracy table will stay empty, saying why"; \
	else \
	  echo "Fashion-MNIST is not in $(FASHION_MNIST): run \`sudo apt-get install dataset-fashion-mnist\` (Debian/Ubuntu)," \
	    "or give CIFAR-10 with \`make run ARGS=\"--data-dir DIR\"\`; without either the accuracy table stays empty, saying why"; \
	fi
	@# The GPT's text: the quotations of Debian's fortunes package (plain text files, read as bytes, never run).
	@if [ -f $(FORTUNES)/literature ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing Debian's fortunes (the GPT's text)"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends fortunes >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends fortunes >/dev/null; } || \
	  echo "could not install fortunes: the GPT trains on nothing, saying why"; \
	else \
	  echo "the GPT's text is not in $(FORTUNES): run \`sudo apt-get install fortunes\` (Debian/Ubuntu)"; \
	fi

run: $(STAMP) data
	$(BIN)/tapp run $(ARGS)

# Two pytest workers, each test module on one (its module fixtures start servers and pools once), the longest modules
# first (tests/conftest.py). A failed test is run once more: on 2 shared cores a timing-bound test can lose to the
# other worker; a broken one fails twice.
TEST_WORKERS ?= 2
test: $(STAMP) data
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --reruns 1 $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	@echo "type: ignore comments: $$(grep -r --include='*.py' -c 'type: ignore' tapp_core tasks flows reports | awk -F: '{s += $$2} END {print s}')"

clean:
	rm -rf $(VENV) mlflow.db mlruns mlartifacts out
