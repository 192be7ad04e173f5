#!/usr/bin/env bash
# The real-model comparison where the clip can act: SmolLM2-135M-Instruct, clip / noclip / bandkl x 3 seeds x 100
# steps, then the horizon table and the verdicts (docs/results.md, "The real model where the clip can act").
# Against the earlier SmolLM2 comparison (2 mini-batches, G 8, 32 tokens, no KL), this shape gives the clip room to
# act: 4 mini-batches per rollout (3 of them off-policy, the paper's recipe), a group of 16 (fewer groups without
# signal), 64-token responses and the paper's KL term of 0.001.
#
#   bash experiments/real_scale.sh                 # all nine runs; JOBS=9 on one GPU (~80 GB), JOBS=1 on a CPU
#   SEEDS=0 STEPS=30 bash experiments/real_scale.sh  # one seed per arm
#   bash experiments/real_scale.sh --prompts-per-step 4 --mini-batch-prompts 1  # train.py flags after the others
#   REWARD=random NAME=real-scale-random bash experiments/real_scale.sh  # coin rewards: the clip's own drift
#   PORT=29700 ...                                   # beside another comparison on the same machine
#   ROLLOUT=vllm ...                                 # the engine (default: hf for JOBS > 1 on a GPU, else auto)
#
# JOBS runs share one device. On a GPU with JOBS > 1 they roll out with the HF engine (ROLLOUT=hf): vLLM counts the
# whole GPU's memory growth while it starts as its own, so engines starting together shrink each other's KV cache
# (on one H100 with JOBS=6, three of six engines stopped: docs/gpu.md). ROLLOUT=vllm still runs them, each engine
# given min(0.5, 0.85 / JOBS) of the device's memory.
#
# Runs resume where they stopped (compare.py); a finished protocol re-tabulates. The model must be built first
# (make smollm2; on a GPU machine without network access: scripts/gpu_stage.py, docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
SEEDS=${SEEDS:-0,1,2}
STEPS=${STEPS:-100}
JOBS=${JOBS:-1}
NAME=${NAME:-real-scale}
REWARD=${REWARD:-math-verify}
if [ -z "${ROLLOUT:-}" ]; then  # several jobs on a GPU: the HF engine (above); else train.py's default
    ROLLOUT=auto
    if [ "$JOBS" -gt 1 ] && $PY -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then ROLLOUT=hf; fi
fi
GPU_SHARE=$(awk -v j="$JOBS" 'BEGIN { s = 0.85 / j; printf "%.3f", (s < 0.5 ? s : 0.5) }')
$PY experiments/compare.py --methods clip,noclip,bandkl --bandkl-deltas "" --seeds "$SEEDS" --max-steps "$STEPS" \
    --nproc 1 --jobs "$JOBS" --master-port "${PORT:-29600}" --reward "$REWARD" --runs-dir "runs/$NAME" --results "experiments/results/$NAME" \
    --figure "figures/${NAME}_compare.png" --title "SmolLM2-135M-Instruct, 4 mini-batches, G 16, 64 tokens, KL 0.001" \
    -- --model models/smollm2-135m-instruct --data arithmetic-instruct:1,3 --prompts-per-step 8 --group-size 16 \
    --mini-batch-prompts 2 --micro-batch-size 32 --max-new-tokens 64 --max-prompt-len 64 --lr 2e-5 \
    --kl-coef 0.001 --no-grad-checkpointing --share-prompt --eval-prompts 64 --eval-n 4 --eval-every 10 \
    --save-every 10 --keep-checkpoints 1 --rollout "$ROLLOUT" --gpu-memory-utilization "$GPU_SHARE" "$@"
$PY experiments/horizon.py "runs/$NAME" --results "experiments/results/$NAME" --figure "figures/${NAME}_horizon.png"
