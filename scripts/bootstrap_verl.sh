#!/usr/bin/env bash
# Create .venv-verl, the second environment in which tests/test_verl_bandpo.py runs verl's own loss code.
# Why a second environment: verl 0.9.1 pins transformers>=5.5.3,<5.11, ours is 5.19.0 (requirements.txt); a plain
# install would downgrade .venv's transformers (and pull ray, wandb, tensorboard, +1 GB). Its policy losses
# (verl.trainer.ppo.core_algos) import fine on our torch/transformers/numpy with verl installed --no-deps plus the
# small packages pinned below (docs/setup.md). Re-runs are no-ops until this file changes. Measured on the 2-core
# dev box: 105 s from scratch (pip cache warm), 1.4 GB (torch 754 MB, ray 220 MB, transformers 120 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV_VERL:-.venv-verl}
stamp="$VENV/.bootstrapped"
want="$(sha1sum scripts/bootstrap_verl.sh | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi

start=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
pip="$VENV/bin/python -m pip install --quiet --disable-pip-version-check"
echo "bootstrap_verl: installing into $VENV"
$pip torch==2.13.0                                       # the local CPU wheel; first, or a CUDA torch comes along
$pip transformers==5.19.0 numpy==2.3.5 pytest==9.2.0 pytest-timeout==2.4.0   # the same pins as requirements.txt
# What `import verl.trainer.ppo.core_algos` needs (found by importing it until it stopped failing), exact pins.
# ray is imported by verl.protocol at `import verl`; its own small dependencies come with it.
$pip ray==2.55.1 tensordict==0.10.0 omegaconf==2.3.0 codetiming==1.4.0
$pip --no-deps verl==0.9.1    # last: its transformers<5.11 pin would fight ours (--no-deps also skips pip's warning)
echo "$want" > "$stamp"
echo "bootstrap_verl: done in $(( $(date +%s) - start )) s"
