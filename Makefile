# Two entry points for a fresh machine (see README.md):
#   make demo   - set up .venv and train the tiny MoE on CPU with SAO (recipes/tiny_moe_cpu.toml)
#   make test   - set up .venv and run the whole test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-unit test-distributed test-slurm bench-quick clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch; GPU users install their CUDA build first and skip this line.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/sao train recipes/tiny_moe_cpu.toml

test: $(STAMP)
	$(BIN)/pytest tests -q

test-unit: $(STAMP)
	$(BIN)/pytest tests/unit -q

test-distributed: $(STAMP)
	$(BIN)/pytest tests/distributed -q

test-slurm: $(STAMP)
	$(BIN)/pytest tests/slurm -q

bench-quick: $(STAMP)
	$(BIN)/sao bench all --quick

clean:
	rm -rf $(VENV) runs results/*.png
