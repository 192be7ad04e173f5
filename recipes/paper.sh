#!/usr/bin/env bash
# The paper's recipe (docs/paper.md §4) for one method: Qwen2.5-3B-Instruct on DAPO-Math-17k + MATH levels 3-5,
# evaluated on AIME 2024/2025 and AMC 2023 (mean@32, temperature 1.0) every 5 steps.
#
#   bash recipes/paper.sh bandkl                      # one node, 8 GPUs
#   bash recipes/paper.sh clip                        # GRPO baseline ([0.8, 1.2]);  also: clip-higher, dcpo,
#                                                     # bandtv, bandchi2, bandkl-relax
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash recipes/paper.sh bandkl   # on node 0 of 2
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash recipes/paper.sh bandkl   # on node 1 of 2
#   MODEL=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B bash recipes/paper.sh bandkl
#
# Batch shape as the paper: 256 prompts x 16 samples per step, mini-batches of 64 prompts (4 optimizer steps per
# rollout, so the bounds act from the 2nd mini-batch on); lr 1e-6 constant; KL to reference 0.001 (low_var_kl);
# reward +1/-1 by the DAPO rule (last "Answer:" line, Minerva normalisation); delta = 0.05 for KL/TV/chi2.
# 10 epochs of DAPO-Math-17k + MATH L3-5 (about 25k prompts) at 256 prompts a step is about 1000 steps.
set -euo pipefail
METHOD=${1:?usage: recipes/paper.sh METHOD [extra train.py flags]}
shift
MODEL=${MODEL:-Qwen/Qwen2.5-3B-Instruct}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
NPROC=${NPROC:-8}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
cd "$(dirname "$0")/.."
exec .venv/bin/torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  train.py --method "$METHOD" --delta 0.05 \
  --model "$MODEL" --data dapo-math-17k,math-l3to5 --eval-data aime24,aime25,amc23 \
  --prompts-per-step 256 --group-size 16 --mini-batch-prompts 64 --micro-batch-size 4 \
  --max-prompt-len 1024 --max-new-tokens 4096 --temperature 1.0 --top-p 1.0 \
  --lr 1e-6 --kl-coef 0.001 --kl-kind low_var_kl --agg seq-mean-token-mean --clip-c 10 --max-ratio 10 \
  --reward dapo --reward-correct 1 --reward-incorrect -1 \
  --eval-every 5 --eval-n 32 --eval-prompts 0 --save-every 20 --max-steps 1000 \
  --grad-checkpointing --rollout vllm \
  --out-dir "runs/paper-${METHOD}-$(basename "$MODEL")" "$@"
