#!/usr/bin/env bash
# Two (or more) nodes, one torchrun per node, one world. With configs/vl3b.toml and 2 x 8
# devices: node 0 = ranks 0-7 = trainers, node 1 = ranks 8-15 = one engine each
# (cluster.gen_ranks = 8: the LAST 8 ranks generate). With --cluster.layout=per_node on both
# nodes, every node trains on its first 4 devices and generates on the other 4 (ROLL's second
# layout; docs/gpu-npu.md, "Layouts"); the same NPROC_PER_NODE on every node then.
#
# Run the same command on every node, changing only NODE_RANK:
#   node 0 (trainers):  MASTER_ADDR=10.0.0.1 NODE_RANK=0 bash launch/multinode.sh
#   node 1 (engines):   MASTER_ADDR=10.0.0.1 NODE_RANK=1 bash launch/multinode.sh
#   Ascend: add GRPO_DEVICE=npu (then launch/npu_env.sh is sourced on every node).
#   DRY_RUN=1 MASTER_ADDR=10.0.0.1 NODE_RANK=0 bash launch/multinode.sh   # the plan, start nothing
# Before a long run, check the weight channel (seconds: no model, no engine): the same command
# with --check-channel on both nodes. Trainer rank 0 broadcasts one sync.bucket_mb bucket to
# every engine rank, over the channel the run uses (NCCL/HCCL from node 0's device 0 to each
# engine's device), and node 0 prints one JSON line ("ok", "broadcast_s", "gb_per_s"):
#   node 0 (trainers):  MASTER_ADDR=10.0.0.1 NODE_RANK=0 bash launch/multinode.sh --check-channel --sync.channel_port=29600
#   node 1 (engines):   MASTER_ADDR=10.0.0.1 NODE_RANK=1 bash launch/multinode.sh --check-channel --sync.channel_port=29600
#   A hang there (until cluster.timeout_s) means a port or interface below is not reachable.
# Variables:
#   MASTER_ADDR     (required) address of node 0, reachable from every node
#   NODE_RANK       (required) 0 on the trainer node, 1 on the engine node
#   MASTER_PORT     (29500) a free TCP port on node 0
#   NNODES          (2)
#   NPROC_PER_NODE  (8)
#   CONFIG          (configs/vl3b.toml)
#   GRPO_DEVICE     (cuda) cuda | npu
#   RDZV_TIMEOUT    (600) seconds node 0 waits for the other nodes to join, and another node
#                   for node 0 to answer (then torchrun stops with an error naming the address)
# Extra arguments are --section.key=value overrides (the same on every node!).
# Tensor-parallel engines (rollout.tensor_parallel_size = T > 1): the engine node runs 8 / T
# processes, e.g. T = 2: NODE_RANK=1 NPROC_PER_NODE=4 and --cluster.gen_ranks=4 on both nodes
# (torchrun accepts a different --nproc_per_node per node; the dry run draws equal nodes).
# Ports node 1 must reach on node 0 (open them in a firewall): MASTER_PORT (torchrun's store),
# sync.channel_port (the weight channel's rendezvous; 0 = any free port, so set one), and the
# device library's own (NCCL: ephemeral ports on NCCL_SOCKET_IFNAME; HCCL: HCCL_IF_BASE_PORT,
# default 60000 and up; gloo: ephemeral ports between every pair of nodes).
# Several network interfaces: name the one the nodes share, for the gloo control group AND the
# device library: GLOO_SOCKET_IFNAME=eth0, plus NCCL_SOCKET_IFNAME=eth0 (GPU) or
# HCCL_SOCKET_IFNAME=eth0 / HCCL_IF_IP=<this node's address> (NPU; ROLL's multi-node list).
#
# Why static rendezvous: torchrun's c10d rendezvous numbers the nodes in the order they ARRIVE,
# not by --node_rank (which it ignores, with a warning). Start the engine node first and it
# becomes node 0, i.e. ranks 0-7 = the trainers land on the engine machine and the roles swap
# silently. The static backend (--rdzv_backend static + --master_addr/--master_port) takes the
# global rank from --node_rank, so node 0 is always the trainer node. The price: no elastic
# restarts, and all nodes must join within 600 s of the first one (static rendezvous default;
# RDZV_TIMEOUT below changes it).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

: "${MASTER_ADDR:?set MASTER_ADDR to node 0 (the trainer node) address}"
: "${NODE_RANK:?set NODE_RANK: 0 on the trainer node, 1 on the engine node}"
MASTER_PORT=${MASTER_PORT:-29500}
NNODES=${NNODES:-2}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
CONFIG=${CONFIG:-$root/configs/vl3b.toml}
RDZV_TIMEOUT=${RDZV_TIMEOUT:-600}
export GRPO_DEVICE=${GRPO_DEVICE:-cuda}

if [ "$GRPO_DEVICE" = npu ]; then
  # shellcheck source-path=SCRIPTDIR source=npu_env.sh
  source "$root/launch/npu_env.sh"
fi

args=(--config "$CONFIG" --cluster.nnodes="$NNODES" --cluster.nproc_per_node="$NPROC_PER_NODE" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  exec "${PYTHON:-python3}" "$root/train.py" "${args[@]}" --dry-run
fi
# Say what this node waits for: until every node has joined, torchrun prints nothing.
if [ "$NODE_RANK" = 0 ]; then
  echo "multinode.sh: node 0 of $NNODES hosts the rendezvous on port $MASTER_PORT; waiting up to" \
    "$RDZV_TIMEOUT s (RDZV_TIMEOUT) for the other $((NNODES - 1)) node(s) to join" >&2
else
  echo "multinode.sh: node $NODE_RANK of $NNODES joins the rendezvous at $MASTER_ADDR:$MASTER_PORT" \
    "(node 0); waiting up to $RDZV_TIMEOUT s (RDZV_TIMEOUT) for it to answer" >&2
fi
exec torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" --node_rank "$NODE_RANK" \
  --rdzv_backend static --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  --rdzv_conf timeout="$RDZV_TIMEOUT" \
  "$root/train.py" "${args[@]}"
