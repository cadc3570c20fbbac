# `make demo` and `make test` work on a fresh clone: they create .venv and install feddg first.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[flower,test]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/feddg sweep configs/demo.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15

bench: $(STAMP)
	$(BIN)/feddg bench models

clean:
	rm -rf $(VENV) runs .pytest_cache
