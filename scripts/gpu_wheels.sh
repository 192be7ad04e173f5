#!/usr/bin/env bash
# Wheels for scripts/gpu_check.py on a GPU machine without network access (Python 3.12, torch + CUDA, transformers,
# accelerate): what train.py's import chain and the CUDA tests need beyond those, at the pins of requirements.txt.
# Downloaded here into .whl/gpu/ (git-ignored, about 9 MiB: it fits one transfer beside the last part of a stage of
# scripts/gpu_stage.py), installed there by gpu_check.py with `pip install --no-index --no-deps --target`, each only
# if the machine lacks it.
#
#     bash scripts/gpu_wheels.sh            # then transfer .whl/gpu/ to the machine: see docs/gpu.md
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.whl/gpu
PIP=${PIP:-python3 -m pip}
pin() { grep -i -E "^$1==" requirements.txt | head -1; }  # NAME==VERSION as requirements.txt pins it

# math-verify (reward.py) and its chain; tqdm (train.py); pytest + pytest-timeout (pytest.ini sets `timeout`) and
# pytest's own dependencies; mpmath (tests/test_band.py). Not pinned in requirements.txt (dependencies of the pins
# there): latex2sympy2_extended (math-verify 0.9.0 pins 1.11.0), antlr4 (latex2sympy2_extended wants <= 4.13.2),
# and pytest's iniconfig, pluggy, pygments, packaging, at the versions this project's .venv resolved.
WHEELS=(
  "$(pin math-verify)" latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 "$(pin sympy)" "$(pin mpmath)"
  "$(pin tqdm)" "$(pin pytest)" "$(pin pytest-timeout)" iniconfig==2.3.1 pluggy==1.7.0 pygments==2.21.0
  packaging==26.3
)
rm -rf "$DIR" && mkdir -p "$DIR"
for w in "${WHEELS[@]}"; do
  # all of these are pure Python (py3-none-any), which pip accepts for the manylinux platform tag too
  $PIP download --quiet --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    -d "$DIR" "$w"
done
ls -l "$DIR" | awk 'NR > 1 {printf "%10d  %s\n", $5, $9}'
du -cb "$DIR"/*.whl | tail -1 | awk '{printf "total %.1f MiB in %s\n", $1 / 2^20, "'"$DIR"'"}'
