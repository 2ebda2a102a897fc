# Two commands do all set-up: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Torch is installed by .ci/install-torch.sh: a CPU build only, never the multi-GB CUDA one.
PYTEST_ARGS ?=
# The suite runs in PYTEST_WORKERS processes (pytest-xdist), a test file to a worker (its module fixtures,
# servers and namespaces stay in one process); PYTEST_WORKERS=0 runs it in this one, in order.
PYTEST_WORKERS ?= 2

.PHONY: venv demo test lint typecheck pytest clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	.ci/install-torch.sh $(BIN)/python
	$(BIN)/pip install -e ".[test]"
	$(BIN)/python -m fhelium.native || echo "warning: fhelium native kernels not built; the pure-torch path will run"
	touch $(STAMP)

demo: venv
	$(BIN)/fdl run examples/encrypted_mean.py

lint: venv
	$(BIN)/ruff check flodld fhelium flodld_fhelium clients tests bench examples

typecheck: venv
	$(BIN)/mypy

pytest: venv
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test: lint typecheck pytest

clean:
	rm -rf $(VENV)
