#!/usr/bin/env bash
# One node of NVIDIA GPUs: the first half of the ranks train (FSDP2, NCCL), the second half each
# run one vLLM engine. Default: 8 GPUs = 4 trainers + 4 engines, configs/vl3b.toml.
#   bash launch/gpu_1node.sh                                   # the reference recipe on one node
#   bash launch/gpu_1node.sh --run.steps=20 --rollout.enforce_eager=false
#   NPROC_PER_NODE=4 GEN_RANKS=1 bash launch/gpu_1node.sh      # 3 trainers + 1 engine
# Variables: CONFIG (default configs/vl3b.toml), NPROC_PER_NODE (8), GEN_RANKS (half of them).
# Extra arguments are --section.key=value overrides; they come last, so they win.
# Check the plan first: GRPO_DEVICE=cuda python train.py --config configs/vl3b.toml --dry-run \
#   --cluster.gen_ranks=4 --cluster.nnodes=1
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

CONFIG=${CONFIG:-$root/configs/vl3b.toml}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
GEN_RANKS=${GEN_RANKS:-$((NPROC_PER_NODE / 2))}

# Fail loudly when CUDA is missing instead of falling back to a CPU run of a 3B model.
export GRPO_DEVICE=${GRPO_DEVICE:-cuda}

# --standalone: a private rendezvous on localhost (one node, nothing to agree on).
exec torchrun --standalone --nnodes 1 --nproc_per_node "$NPROC_PER_NODE" \
  "$root/train.py" --config "$CONFIG" \
  --cluster.gen_ranks="$GEN_RANKS" --cluster.nnodes=1 --cluster.nproc_per_node="$NPROC_PER_NODE" \
  "$@"
