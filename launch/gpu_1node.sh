#!/usr/bin/env bash
# One node of NVIDIA GPUs: the first ranks train (FSDP2, NCCL), the last GEN_RANKS each run one
# vLLM engine. Default: 8 GPUs = 4 trainers + 4 engines, configs/vl3b.toml.
#   bash launch/gpu_1node.sh                                   # the reference recipe on one node
#   bash launch/gpu_1node.sh --run.steps=20 --rollout.enforce_eager=false
#   NPROC_PER_NODE=4 GEN_RANKS=2 bash launch/gpu_1node.sh      # 4 GPUs: 2 trainers + 2 engines
#   NPROC_PER_NODE=6 GEN_RANKS=2 bash launch/gpu_1node.sh --rollout.tensor_parallel_size=2
#                                     # 8 GPUs: 4 trainers + 2 engines of 2 GPUs each
#   DRY_RUN=1 bash launch/gpu_1node.sh                          # print the plan, start nothing
# Variables: CONFIG (default configs/vl3b.toml), NPROC_PER_NODE (8: processes, i.e. trainers +
# engines; an engine of tensor_parallel_size T takes T GPUs), GEN_RANKS (half of the processes).
# Extra arguments are --section.key=value overrides; they come last, so they win. The
# prompts (rollout.prompts_per_step = 32) must split evenly over the engines, the episodes
# (32 x 4) over the trainers.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

CONFIG=${CONFIG:-$root/configs/vl3b.toml}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
GEN_RANKS=${GEN_RANKS:-$((NPROC_PER_NODE / 2))}

# Fail loudly when CUDA is missing instead of falling back to a CPU run of a 3B model.
export GRPO_DEVICE=${GRPO_DEVICE:-cuda}

args=(--config "$CONFIG" --cluster.gen_ranks="$GEN_RANKS" --cluster.nnodes=1
      --cluster.nproc_per_node="$NPROC_PER_NODE" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  exec "${PYTHON:-python3}" "$root/train.py" "${args[@]}" --dry-run
fi
# --standalone: a private rendezvous on localhost (one node, nothing to agree on).
exec torchrun --standalone --nnodes 1 --nproc_per_node "$NPROC_PER_NODE" "$root/train.py" "${args[@]}"
