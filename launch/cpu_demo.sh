#!/usr/bin/env bash
# The CPU demo: 3 ranks on gloo, a tiny random Qwen2.5-VL built locally (nothing downloaded).
# Ranks 0-1 train (FSDP2), rank 2 generates (transformers engine); about 30 s for 30 steps.
#   bash launch/cpu_demo.sh                      # configs/tiny.toml as is
#   bash launch/cpu_demo.sh --run.steps=5        # any --section.key=value override
#   DRY_RUN=1 bash launch/cpu_demo.sh            # print the config and rank plan, start nothing
# The run folder (runs/tiny by default) is created under the current directory.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# One thread per process: 3 processes share the machine's cores (2 on the reference machine);
# more threads each only oversubscribe them.
export OMP_NUM_THREADS=1
# The demo is the CPU path even on a machine with an accelerator.
export GRPO_DEVICE=cpu

args=(--config "$root/configs/tiny.toml" --cluster.nnodes=1 --cluster.nproc_per_node=3 "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  exec "${PYTHON:-python3}" "$root/train.py" "${args[@]}" --dry-run
fi
exec torchrun --standalone --nnodes 1 --nproc_per_node 3 "$root/train.py" "${args[@]}"
