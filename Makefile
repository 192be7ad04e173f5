# Every target bootstraps .venv first (scripts/bootstrap.sh: pinned requirements + the vLLM flavour of this machine).
PY := .venv/bin/python
TORCHRUN := .venv/bin/torchrun
NPROC ?= 2

.PHONY: venv demo test test-fast bench figures tiny-model clean

venv:
	@bash scripts/bootstrap.sh

demo: venv
	$(TORCHRUN) --nproc_per_node $(NPROC) train.py --method bandkl --delta 0.05

test: venv
	$(PY) -m pytest

test-fast: venv
	$(PY) -m pytest -m "not slow"

bench: venv
	@for f in benchmarks/bench_*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

figures: venv
	$(PY) derivations/figures.py
	$(PY) experiments/bandit.py

tiny-model: venv
	$(PY) make_tiny_model.py

clean:
	rm -rf .pytest_cache .hypothesis runs
