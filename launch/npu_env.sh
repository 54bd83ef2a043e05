# Ascend NPU environment for training + vllm-ascend generation. SOURCE it, do not run it:
#   source launch/npu_env.sh          (npu_1node.sh and multinode.sh with GRPO_DEVICE=npu do)
# Every value is a default: a variable already set in the environment is kept.
# Both roles inherit this one environment (the vllm-ascend engine is a child process of a
# generation rank), so every value here must suit the FSDP trainer AND the engine.
# No `set -euo pipefail` here: this file runs inside the caller's shell, whose options it keeps
# (the launch scripts set them; everything below is written to pass under `set -u`).
#
# Sources:
#   ROLL = alibaba/ROLL docs "Ascend NPU Environment Configuration Guide"
#          (docs_roll/docs/User Guides/Hardware Support/ascend_npu_env_config.md) and
#          roll/platforms/npu.py get_vllm_run_time_env_vars (what ROLL sets for its vLLM workers)
#   VA   = vllm-project/vllm-ascend v0.23.0: vllm_ascend/envs.py, vllm_ascend/platform.py,
#          Dockerfile, docs/source/tutorials/models/Qwen-VL-Dense.md
# Not verified on Ascend hardware by this project (no NPU was available).

# --- CANN toolkit and NNAL (libatb.so): skipped when already sourced (the vllm-ascend and ROLL
# images do it in ~/.bashrc). CANN's scripts read unset variables, so `set -u` is lifted for them.
if [ -z "${ASCEND_TOOLKIT_HOME:-}" ] && [ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]; then
  case $- in *u*) _grpo_had_u=1; set +u ;; *) _grpo_had_u=0 ;; esac
  # shellcheck disable=SC1091
  source /usr/local/Ascend/ascend-toolkit/set_env.sh
  if [ -f /usr/local/Ascend/nnal/atb/set_env.sh ]; then
    # shellcheck disable=SC1091
    source /usr/local/Ascend/nnal/atb/set_env.sh
  fi
  if [ "$_grpo_had_u" = 1 ]; then set -u; fi
  unset _grpo_had_u
fi

# --- HCCL (the collective library: FSDP2 on the trainers, vLLM's groups and the weight channel) --
# HCCL_CONNECT_TIMEOUT (seconds to establish an HCCL link; CANN default 120) and
# HCCL_EXEC_TIMEOUT (seconds a started collective waits for its peers; CANN default 1836) are
# NOT set here: both must stay below cluster.timeout_s, torch-npu's watchdog timeout, or the
# watchdog kills the job before HCCL writes its own report (plog; torch-npu warns "The watchdog
# timeout ... is less than or equal to HCCL execution timeout"). train.py sets each to 90% of
# cluster.timeout_s when unset (vl3b: 1619 s; ROLL uses 3600 for both) and refuses a value at
# or above it (device.hccl_env). Communicators are created at the first collective (trainers)
# and when the weight channel opens (engines, after vLLM loaded the model and, on a first run,
# compiled its operators). The engines do not wait inside HCCL during a training step (they
# wait for a gloo control message first), so a long HCCL wait buys nothing.
# HCCL_OP_EXPANSION_MODE is NOT set (train.py refuses AIV): CANN documents AIV for inference
# only, not for several communicators in one process, its Broadcast for one node (<= 8 cards;
# vl3b's weight channel spans two nodes), and it caps HCCL_EXEC_TIMEOUT at 1091 s. The
# defaults (A2: HOST, A3: AI_CPU) support every collective here.
# Multi-node only (set per node, see launch/multinode.sh): HCCL_IF_IP=<this node's address>,
# HCCL_SOCKET_IFNAME=<interface>; HCCL_BUFFSIZE (the per-communicator buffer, 200 MB by
# default) for larger transfers. ROLL.
# HCCL_BUFFSIZE costs device memory: every HCCL communicator holds 2 x HCCL_BUFFSIZE MB (its
# input and output buffers; CANN's HCCL environment variables), outside vLLM's
# gpu_memory_utilization budget on an engine's NPU: its weight channel's communicator is 400 MB
# at the default (more with tensor_parallel_size > 1: vLLM's own groups), and a trainer NPU
# holds one per HCCL group it joins (the world and the trainer group: 800 MB). Raising it for
# speed raises these figures with it.

# --- memory ---------------------------------------------------------------------------------
# Expandable segments in torch_npu's caching allocator: less fragmentation, fewer OOMs in FSDP
# training (ROLL's recommendation). Safe for the engines here: vllm-ascend 0.23 sets exactly this
# itself whenever sleep mode is off (VA platform.py); only sleep mode's CaMemAllocator rejects it
# (why ROLL clears it for its vLLM workers). The engines here never use sleep mode.
export PYTORCH_NPU_ALLOC_CONF=${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}
# Not exported, torch-npu's default already (torch-npu 2.10 OptionsManager.cpp):
# MULTI_STREAM_MEMORY_REUSE=1 (erase the cross-stream record of collective buffers after
# work.wait()).

# --- operator dispatch and CPU binding: for the trainers ----------------------------------
# TASK_QUEUE_ENABLE=2: torch-npu's level-2 task queue (more of each operator's dispatch moved
# off the Python thread; "may raise the memory peak"). Value: vllm-ascend v0.23.0
# docs/source/developer_guide/performance_and_debug/optimization_and_tuning.md ("Scheduling
# optimization") and ROLL's env guide (2 for non-graph mode: FSDP2 here runs eagerly).
# CPU_AFFINITY_CONF=1: torch-npu binds each process's threads to the CPU cores of its NPU's
# NUMA node (coarse; 2 = fine-grained, ROLL's choice, also pins the main threads). Value:
# the same vllm-ascend guide. Both are read at process start, so they are exported here for
# every rank; the vLLM engines' processes get TASK_QUEUE_ENABLE=1 and CPU_AFFINITY_CONF=0
# back (device.vllm_spawn_env): ROLL's vLLM workers force 1, and vllm-ascend 0.23 binds its
# workers' CPUs itself (enable_cpu_binding, on by default).
export TASK_QUEUE_ENABLE=${TASK_QUEUE_ENABLE:-2}
export CPU_AFFINITY_CONF=${CPU_AFFINITY_CONF:-1}

# --- CPU ------------------------------------------------------------------------------------
# One OpenMP thread per process: 8-16 ranks plus their engine processes share the host.
# Value: ROLL and VA's Dockerfile (1). (torchrun also sets 1 when unset.)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# --- operator compile cache: a first run compiles operators (minutes); later runs reuse them --
# Value: ROLL (enable; ROLL's directory is /tmp/npu_cache, here per user under ~/.cache so it
# survives /tmp cleaning). Put it on a local disk, not NFS, when several nodes write to it.
export ACL_OP_COMPILER_CACHE_MODE=${ACL_OP_COMPILER_CACHE_MODE:-enable}
export ACL_OP_COMPILER_CACHE_DIR=${ACL_OP_COMPILER_CACHE_DIR:-${HOME:-/tmp}/.cache/ascend_op_cache}
# Disk space of that cache per AI processor, in MB (CANN default 500; files over it and unused
# for 30 min are aged out). 2000 x 8 devices = up to 16 GB per node on that disk.
export ASCEND_MAX_OP_CACHE_SIZE=${ASCEND_MAX_OP_CACHE_SIZE:-2000}
mkdir -p "$ACL_OP_COMPILER_CACHE_DIR"

# --- vllm-ascend --------------------------------------------------------------------------------
# Do not cast weights to the FRACTAL_NZ layout. An NZ weight cannot take an update in the plain
# (ND) layout the trainer sends; vllm-ascend 0.23's own RL weight-update path refuses to run
# with it ("may cause model parameter precision issues in the RL scenarios"), and so does this
# project (vllm_engine.py: before vLLM starts, and in the worker). Default 1 (= quantized weights
# only). Value: ROLL and VA worker.py (0).
export VLLM_ASCEND_ENABLE_NZ=${VLLM_ASCEND_ENABLE_NZ:-0}
# (USE_OPTIMIZED_MODEL=0, in AReaL's NPU script, only exists up to vllm-ascend 0.11: not set.)
# (VLLM_WORKER_MULTIPROC_METHOD=spawn is set by vllm_engine.py itself before the engine starts.)

# --- logging: errors only (debug levels slow everything down). Value: ROLL (3 = ERROR).
# For a hang or a device error: ASCEND_GLOBAL_LOG_LEVEL=1 ASCEND_SLOG_PRINT_TO_STDOUT=1 and,
# to localise it, ASCEND_LAUNCH_BLOCKING=1 (synchronous, very slow).
export ASCEND_GLOBAL_LOG_LEVEL=${ASCEND_GLOBAL_LOG_LEVEL:-3}
