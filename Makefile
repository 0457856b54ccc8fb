# Two entry points for a fresh machine (see README.md):
#   make demo   - set up .venv, SFT the tiny MoE on CPU, then train it with SAO (recipes/tiny_sft_sao_cpu.toml)
#   make test   - set up .venv and run the whole test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-unit test-distributed test-faults test-learning test-slurm bench-quick clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch; GPU users install their CUDA build first and skip this line.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# The paper's order in miniature: SFT, then SAO (docs/quickstart.md). One OpenMP thread per process:
# the trainer and the rollout server share the two cores, and more threads slow the tiny model down.
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/sao train recipes/tiny_sft_sao_cpu.toml

test: $(STAMP)
	$(BIN)/pytest tests -q

test-unit: $(STAMP)
	$(BIN)/pytest tests/unit -q

test-distributed: $(STAMP)
	$(BIN)/pytest tests/distributed -q

test-faults: $(STAMP)
	$(BIN)/pytest tests/faults -q

test-learning: $(STAMP)
	$(BIN)/pytest tests/learning -q

test-slurm: $(STAMP)
	$(BIN)/pytest tests/slurm -q

bench-quick: $(STAMP)
	$(BIN)/sao bench all --quick

clean:
	rm -rf $(VENV) runs results/*.png

# The GPU check kit (docs/gpu.md): fetch the wheels a bare GPU image lacks into build/gpu_wheels
# (a package index is needed only while one is missing), then run the GPU tests on this machine's GPU
# and write gpu-check.json under $OUT (else build/gpu_check). GPU_WHEEL_PY is the GPU machine's Python.
# Without a GPU: make gpu-check GPU_PY=.venv/bin/python GPU_CHECK_ARGS=--dry-run
GPU_PY ?= python3
GPU_WHEEL_PY ?= 3.12
GPU_CHECK_ARGS ?=
.PHONY: gpu-check
gpu-check:
	$(GPU_PY) -m launch.gpu_check wheels --python-version $(GPU_WHEEL_PY)
	$(GPU_PY) -m launch.gpu_check run --python-version $(GPU_WHEEL_PY) $(GPU_CHECK_ARGS)
