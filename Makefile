# Two commands do all set-up: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Torch is installed by .ci/install-torch.sh: a CPU build only, never the multi-GB CUDA one.
PYTEST_ARGS ?=

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
	$(BIN)/pytest $(PYTEST_ARGS)

test: lint typecheck pytest

clean:
	rm -rf $(VENV)
