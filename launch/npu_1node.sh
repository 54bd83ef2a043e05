#!/usr/bin/env bash
# One node of Ascend NPUs (Atlas A2/A3): the first ranks train (FSDP2, HCCL), the last
# GEN_RANKS each run one vllm-ascend engine. Default: 8 NPUs = 4 trainers + 4 engines.
#   bash launch/npu_1node.sh
#   bash launch/npu_1node.sh --run.steps=20
#   NPROC_PER_NODE=16 GEN_RANKS=8 bash launch/npu_1node.sh --cluster.devices_per_node=16
#                                     # an A3 node with 16 NPUs (the key: for the dry run)
#   DRY_RUN=1 bash launch/npu_1node.sh                         # print the plan, start nothing
# Variables: CONFIG (default configs/vl3b.toml), NPROC_PER_NODE (8: processes, i.e. trainers +
# engines; an engine of tensor_parallel_size T takes T NPUs), GEN_RANKS (half of them).
# Extra arguments are --section.key=value overrides; they come last, so they win.
# Trainers and engines never share an NPU (no colocation, no sleep mode).
# Keep rollout.enforce_eager=true (the config's value) until a first run is clean: graph mode
# on vllm-ascend compiles per shape and is a later optimisation.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# CANN environment, HCCL, memory and vllm-ascend settings (each one documented there).
# shellcheck source-path=SCRIPTDIR source=npu_env.sh
source "$root/launch/npu_env.sh"

CONFIG=${CONFIG:-$root/configs/vl3b.toml}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
GEN_RANKS=${GEN_RANKS:-$((NPROC_PER_NODE / 2))}

# Fail loudly when torch_npu cannot see the NPUs instead of falling back to CPU.
export GRPO_DEVICE=${GRPO_DEVICE:-npu}

args=(--config "$CONFIG" --cluster.gen_ranks="$GEN_RANKS" --cluster.nnodes=1
      --cluster.nproc_per_node="$NPROC_PER_NODE" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  exec "${PYTHON:-python3}" "$root/train.py" "${args[@]}" --dry-run
fi
exec torchrun --standalone --nnodes 1 --nproc_per_node "$NPROC_PER_NODE" "$root/train.py" "${args[@]}"
