#!/usr/bin/env bash
# A first check on ONE NVIDIA GPU, prepared for a machine whose image has torch (2.11) and
# transformers (5.17) but no vLLM and no package registry: everything else travels with this
# working tree. Budget: about 8 minutes. Prints ONE JSON object on stdout (logs go to $OUT).
#   bash bench/device_check.sh                    # on the GPU machine
#   GRPO_DEVICE=cpu bash bench/device_check.sh    # the same steps on CPU, tiny model (a dry mode)
#
# 0. what the image has: the modules this project imports for the steps below (torch,
#    transformers, tokenizers, safetensors, huggingface_hub, numpy, PIL); a missing one stops
#    here with its name (PIL is not a dependency of torch or transformers: if it is missing,
#    bring a Pillow wheel for the image's Python and `pip install --no-index` it). Also noted:
#    whether flash-attn imports (train.packing = "varlen" needs it on CUDA).
# Then each step in turn; a step that fails is named in "failed" (its log's tail on stderr)
# and the others still run; the exit status is 1 if any failed:
# pack_3b     bench/packing.py on Qwen2.5-VL-3B's 36 decoder layers, bf16 mixed precision and
#             activation checkpointing: packed rows (attention.py's "segments" kernel, SDPA per
#             piece) against padded micro-batches of the same token budget (on CPU: 1 layer).
# pack_tiny   bench/packing.py on the tiny model in fp32: the same, and packed = padded (the
#             loss and every gradient, `exact`).
# demo_packed the tiny demo in a world of ONE, fp32, train.packing = "segments": logprob parity
#             (about 1e-6 expected) and the reward with packed rows on the device.
# demo        the tiny demo in a world of ONE on the device: `python train.py` (no torchrun),
#             FSDP2 over one rank, NCCL ("cpu:gloo,cuda:nccl"), the HF engine in the same
#             process, bf16 mixed precision and activation checkpointing on. Reports
#             logprob_diff/max (engine fp32 vs trainer bf16 compute: about 1e-2 is expected).
# step        bench/step.py on Qwen2.5-VL-3B's architecture at random init (nothing
#             downloaded), seq 2048, bf16, activation checkpointing: tokens/s, MFU, peak memory,
#             and checkpoint calls per step (layer forwards recomputed in backward: the 36
#             decoder layers when checkpointing works, 0 when it does not; the vision tower is
#             never recomputed).
# grpo        bench/step.py --grpo: one optimizer step as update.py runs it at the reference
#             shapes (GRPO_PROMPTS Geometry3K-like prompts x 4 responses <= 512 tokens, images at
#             vl3b.toml's pixel bounds, micro-batches of a 2048-token budget, the device's layout),
#             Qwen2.5-VL-3B's architecture, bf16, no activation checkpointing: forward+backward
#             MFU apart from the optimizer's time, peak memory per phase, aten operators and host
#             syncs per micro-batch (torch.profiler).
# grpo_ckpt   the same with activation checkpointing ("full": every decoder layer recomputed).
# grpo_sel    the same with selective checkpointing (model.activation_checkpointing = "selective":
#             the matmuls' and attention's outputs kept, the rest recomputed).
# grpo_compile the same without checkpointing, each decoder layer under torch.compile
#             (model.compile; the first pass compiles: its warm-up step is not timed).
# grpo_compile_ckpt the same compiled with checkpointing "full": each decoder layer's checkpoint
#             inside its compiled region (sharding.apply_fsdp; checkpoint_calls_per_step null:
#             the recomputation runs in the compiled backward, uncounted).
# head        bench/step.py --head HEAD_TOKENS: the LM head's peak memory, forward + backward, at
#             the 151,936-token vocabulary, chunked (head.py) against the full [N, V] computation.
# colocate    bench/colocate.py: a colocated step in a world of one, the HF engine and a trainer
#             sharing the device, Qwen2.5-VL-3B's architecture (tiny on CPU), bf16: the peak
#             device memory of the generate and of the train phase, the memory the engine's
#             sleep freed (its weights to host memory), the seconds of sleep, wake and load
#             (docs/colocate.md; memory figures are 0 on CPU).
# Variables: OUT (a new temp folder), PYTHON (python3), DEMO_STEPS (10), STEP_MODEL (3b; tiny on
# CPU), STEP_SEQ (2048; 256 on CPU), PACK_LAYERS (36; 1 on CPU), GRPO_PROMPTS (8; 1 on CPU),
# HEAD_TOKENS (8192; 64 on CPU), STEPS (the steps to run, in this order; default all:
# "pack_3b pack_tiny demo_packed demo step grpo grpo_ckpt grpo_sel grpo_compile grpo_compile_ckpt head colocate";
# e.g. STEPS=step to rerun one on
# a short lease).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d -t grpo-device-check.XXXXXX)}
export GRPO_DEVICE=${GRPO_DEVICE:-cuda}
DEMO_STEPS=${DEMO_STEPS:-10}
if [ "$GRPO_DEVICE" = cpu ]; then
  STEP_MODEL=${STEP_MODEL:-tiny}; STEP_SEQ=${STEP_SEQ:-256}; PACK_LAYERS=${PACK_LAYERS:-1}
  PACK_SIZE=(--prompts 4 --max-new-tokens 64 --reps 1)
  GRPO_PROMPTS=${GRPO_PROMPTS:-1}; HEAD_TOKENS=${HEAD_TOKENS:-64}; GRPO_SIZE=(--steps 1 --warmup 0)
  COLOC_SIZE=(--prompts 2 --prompt-len 16 --new-tokens 8 --seq-len 64)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
  STEP_MODEL=${STEP_MODEL:-3b}; STEP_SEQ=${STEP_SEQ:-2048}; PACK_LAYERS=${PACK_LAYERS:-36}
  PACK_SIZE=(--reps 3)
  GRPO_PROMPTS=${GRPO_PROMPTS:-8}; HEAD_TOKENS=${HEAD_TOKENS:-8192}; GRPO_SIZE=(--steps 3 --warmup 1)
  COLOC_SIZE=(--prompts 8 --prompt-len 512 --new-tokens 256 --seq-len 2048)
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
try:
    found["flash_attn"] = importlib.import_module("flash_attn").__version__
except ImportError:
    found["flash_attn"] = None
print(json.dumps(found))
EOF
[ $? = 0 ] || exit 2
if [ "$GRPO_DEVICE" = cuda ] && ! grep -q '"cuda_available": true' "$OUT/versions.json"; then
  echo "device_check: GRPO_DEVICE=cuda but torch sees no CUDA device ($(cat "$OUT/versions.json"))" >&2
  exit 3
fi

ALL_STEPS="pack_3b pack_tiny demo_packed demo step grpo grpo_ckpt grpo_sel grpo_compile grpo_compile_ckpt head colocate"
STEPS=${STEPS:-$ALL_STEPS}
for name in $STEPS; do
  case " $ALL_STEPS " in *" $name "*) ;;
    *) echo "device_check: STEPS names $name; the steps are $ALL_STEPS" >&2
       exit 2 ;;
  esac
done
failed=()
stage() {  # stage NAME SECONDS command...: its output in $OUT/NAME.log; a failure is named
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  if timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then
    echo "device_check: $name ok in $((SECONDS - t0)) s" >&2
  else
    echo "device_check: $name FAILED (rc $?, $((SECONDS - t0)) s), its log's tail:" >&2
    tail -25 "$OUT/$name.log" >&2
    failed+=("$name")
  fi
}

stage pack_3b 150 "$PY" bench/packing.py --shapes 3b --layers "$PACK_LAYERS" --bf16 --checkpointing \
  --layout segments "${PACK_SIZE[@]}"
stage pack_tiny 90 "$PY" bench/packing.py --layout segments "${PACK_SIZE[@]}"
stage demo_packed 120 "$PY" train.py --config configs/tiny.toml --run.out_dir="$OUT/demo_packed" \
  --run.steps="$DEMO_STEPS" --run.keep_last=0 --rollout.engine=hf --train.packing=segments
stage demo 120 "$PY" train.py --config configs/tiny.toml --run.out_dir="$OUT/demo" \
  --run.steps="$DEMO_STEPS" --run.keep_last=0 --rollout.engine=hf \
  --model.mixed_precision=true --model.activation_checkpointing=true
stage step 150 "$PY" bench/step.py --model "$STEP_MODEL" --seq-len "$STEP_SEQ" --bf16 --checkpointing
stage grpo 180 "$PY" bench/step.py --grpo --model "$STEP_MODEL" --prompts "$GRPO_PROMPTS" --bf16 "${GRPO_SIZE[@]}"
stage grpo_ckpt 180 "$PY" bench/step.py --grpo --model "$STEP_MODEL" --prompts "$GRPO_PROMPTS" --bf16 \
  --checkpointing "${GRPO_SIZE[@]}"
stage grpo_sel 180 "$PY" bench/step.py --grpo --model "$STEP_MODEL" --prompts "$GRPO_PROMPTS" --bf16 \
  --checkpointing selective "${GRPO_SIZE[@]}"
stage grpo_compile 300 "$PY" bench/step.py --grpo --model "$STEP_MODEL" --prompts "$GRPO_PROMPTS" --bf16 \
  --compile "${GRPO_SIZE[@]}"
stage grpo_compile_ckpt 300 "$PY" bench/step.py --grpo --model "$STEP_MODEL" --prompts "$GRPO_PROMPTS" --bf16 \
  --compile --checkpointing full "${GRPO_SIZE[@]}"
stage head 120 "$PY" bench/step.py --head "$HEAD_TOKENS"
stage colocate 180 "$PY" bench/colocate.py --model "${STEP_MODEL%-depth}" "${COLOC_SIZE[@]}"

# --- one JSON object: what each step gave ---------------------------------------------------
"$PY" - "$OUT" "${failed[@]}" <<'EOF'
import json, statistics, sys
from pathlib import Path
out, failed = Path(sys.argv[1]), sys.argv[2:]


def last_json(name):
    log = out / f"{name}.log"
    lines = [l for l in log.read_text().splitlines() if l.startswith("{")] if log.exists() else []
    return json.loads(lines[-1]) if lines and name not in failed else None


def demo(name):
    f = out / name / "metrics.jsonl"
    if name in failed or not f.exists():
        return None
    rows = [json.loads(l) for l in f.read_text().splitlines()]
    return {"steps": len(rows), "logprob_diff/max": max(r["logprob_diff/max"] for r in rows),
            "logprob_diff/max_median": statistics.median(r["logprob_diff/max"] for r in rows),
            "reward_first": rows[0]["reward/mean"], "reward_last": rows[-1]["reward/mean"],
            "step_s_median": statistics.median(r["time/step_s"] for r in rows[1:] or rows)}


step, d = last_json("step"), demo("demo")
print(json.dumps({
    "device": step["device"] if step else None, "failed": failed,
    "versions": json.loads((out / "versions.json").read_text()),
    **{k: step[k] if step else None for k in ("peak_memory_gb", "tokens_per_s", "mfu",
                                               "checkpoint_calls_per_step")},
    "logprob_diff/max": d["logprob_diff/max"] if d else None,
    "step": step, "demo": d, "demo_packed": demo("demo_packed"),
    "pack_3b": last_json("pack_3b"), "pack_tiny": last_json("pack_tiny"),
    "grpo": last_json("grpo"), "grpo_ckpt": last_json("grpo_ckpt"),
    "grpo_sel": last_json("grpo_sel"), "grpo_compile": last_json("grpo_compile"),
    "grpo_compile_ckpt": last_json("grpo_compile_ckpt"), "head": last_json("head"),
    "colocate": last_json("colocate"),
}))
EOF
[ ${#failed[@]} = 0 ]
