#!/usr/bin/env bash
# A first check on ONE NVIDIA GPU, prepared for a machine whose image has torch (2.11) and
# transformers (5.17) but no vLLM and no package registry: everything else travels with this
# working tree. Budget: under 8 minutes. Prints ONE JSON object on stdout (logs go to $OUT).
#   bash bench/device_check.sh                    # on the GPU machine
#   GRPO_DEVICE=cpu bash bench/device_check.sh    # the same steps on CPU, tiny model (a dry mode)
#
# 0. what the image has: the modules this project imports for the steps below (torch,
#    transformers, tokenizers, safetensors, huggingface_hub, numpy, PIL); a missing one stops
#    here with its name (PIL is not a dependency of torch or transformers: if it is missing,
#    bring a Pillow wheel for the image's Python and `pip install --no-index` it).
# 1. the tiny demo in a world of ONE on the device: `python train.py` (no torchrun), FSDP2 over
#    one rank, NCCL ("cpu:gloo,cuda:nccl"), the HF engine in the same process, bf16 mixed
#    precision and activation checkpointing on. Reports logprob_diff/max (engine fp32 vs trainer
#    bf16 compute: about 1e-2 is expected, 1e-6 in fp32), the reward and the step time.
# 2. bench/step.py on Qwen2.5-VL-3B's architecture at random init (nothing downloaded), seq 2048,
#    bf16, activation checkpointing: tokens/s, MFU, peak memory, and checkpoint calls per step
#    (layer forwards recomputed in backward: 32 vision blocks + 36 decoder layers = 68 when
#    checkpointing works, 0 when it does not).
# Variables: OUT (a new temp folder), PYTHON (python3), DEMO_STEPS (10), STEP_MODEL (3b; tiny on
# CPU), STEP_SEQ (2048; 256 on CPU).
# Never run on a GPU by this project yet (none was available); the CPU mode is tested.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d -t grpo-device-check.XXXXXX)}
export GRPO_DEVICE=${GRPO_DEVICE:-cuda}
DEMO_STEPS=${DEMO_STEPS:-10}
if [ "$GRPO_DEVICE" = cpu ]; then
  STEP_MODEL=${STEP_MODEL:-tiny}; STEP_SEQ=${STEP_SEQ:-256}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
  STEP_MODEL=${STEP_MODEL:-3b}; STEP_SEQ=${STEP_SEQ:-2048}
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1  # no network there
mkdir -p "$OUT"
cd "$root"
echo "device_check: logs in $OUT" >&2

# --- 0. the image's packages -------------------------------------------------------------
"$PY" - > "$OUT/versions.json" <<'EOF'
import importlib, json, sys
need = ["torch", "transformers", "tokenizers", "safetensors", "huggingface_hub", "numpy", "PIL"]
found, missing = {}, []
for name in need:
    try:
        found[name] = getattr(importlib.import_module(name), "__version__", "?")
    except ImportError as e:
        missing.append(f"{name} ({e})")
if missing:
    sys.exit("device_check: missing in this image: " + "; ".join(missing))
import torch
found["python"] = sys.version.split()[0]
found["cuda_available"] = torch.cuda.is_available()
found["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
print(json.dumps(found))
EOF
if [ "$GRPO_DEVICE" = cuda ] && ! grep -q '"cuda_available": true' "$OUT/versions.json"; then
  echo "device_check: GRPO_DEVICE=cuda but torch sees no CUDA device ($(cat "$OUT/versions.json"))" >&2
  exit 3
fi

# --- 1. the tiny demo, world of one ------------------------------------------------------
timeout 300 "$PY" train.py --config configs/tiny.toml --run.out_dir="$OUT/demo" \
  --run.steps="$DEMO_STEPS" --run.keep_last=0 --rollout.engine=hf \
  --model.mixed_precision=true --model.activation_checkpointing=true \
  > "$OUT/demo.log" 2>&1 || { echo "device_check: the demo failed, see $OUT/demo.log" >&2;
                              tail -20 "$OUT/demo.log" >&2; exit 4; }

# --- 2. the trainer step on the 3B architecture --------------------------------------------
timeout 300 "$PY" bench/step.py --model "$STEP_MODEL" --seq-len "$STEP_SEQ" --bf16 \
  --checkpointing > "$OUT/step.log" 2>&1 || { echo "device_check: bench/step.py failed, see $OUT/step.log" >&2;
                                              tail -20 "$OUT/step.log" >&2; exit 5; }

# --- 3. one JSON object --------------------------------------------------------------------
"$PY" - "$OUT" <<'EOF'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
versions = json.loads((out / "versions.json").read_text())
rows = [json.loads(l) for l in (out / "demo" / "metrics.jsonl").read_text().splitlines()]
step = json.loads([l for l in (out / "step.log").read_text().splitlines() if l.startswith("{")][-1])
print(json.dumps({
    "device": step["device"], "versions": versions,
    "peak_memory_gb": step["peak_memory_gb"], "tokens_per_s": step["tokens_per_s"],
    "mfu": step["mfu"], "checkpoint_calls_per_step": step["checkpoint_calls_per_step"],
    "logprob_diff/max": max(r["logprob_diff/max"] for r in rows),
    "step": step,
    "demo": {"steps": len(rows), "logprob_diff/max_median": statistics.median(
                 r["logprob_diff/max"] for r in rows),
             "reward_first": rows[0]["reward/mean"], "reward_last": rows[-1]["reward/mean"],
             "step_s_median": statistics.median(r["time/step_s"] for r in rows[1:] or rows)},
}))
EOF
