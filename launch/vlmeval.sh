#!/usr/bin/env bash
# The seed's table (AReaL PR #746: LogicVista / MathVision_mini / MathVista_mini) with VLMEvalKit:
# the base model and each checkpoint, then one table (base, trained, delta, the seed's rows).
#
#   bash launch/vlmeval.sh [--dry-run] [--judge NAME] [--judge-base-url URL] [--judge-key KEY] BASE CHECKPOINT...
#
# BASE: the base model (hub id or folder), e.g. Qwen/Qwen2.5-VL-3B-Instruct. CHECKPOINT: a
# checkpoint folder of this project (its hf/ export is evaluated) or an HF model folder.
# Examples (docs/reproducing.md):
#   bash launch/vlmeval.sh --dry-run Qwen/Qwen2.5-VL-3B-Instruct runs/vl3b_areal/checkpoints/step_004550
#   JUDGE_BASE_URL=http://127.0.0.1:8000/v1 JUDGE=Qwen/Qwen2.5-72B-Instruct bash launch/vlmeval.sh --dry-run Qwen/Qwen2.5-VL-3B-Instruct
#
# VLMevalKit at the commit below, with its registered "Qwen2.5-VL-3B-Instruct" settings
# (vlmeval/config.py: Qwen2VLChat, min_pixels 1280*28*28, max_pixels 16384*28*28,
# use_custom_prompt False; the model's own decoding defaults) for every model alike.
# The judge (VLMEvalKit's default for these sets: gpt-4o-mini, which only extracts the answer;
# rules then grade it): --judge / JUDGE names the model, --judge-base-url / JUDGE_BASE_URL an
# OpenAI-compatible endpoint (OpenAI's by default; a local model served with `vllm serve` is one
# too), --judge-key / JUDGE_KEY (else OPENAI_API_KEY) its key. LogicVista gives no score at all
# without a judge.
#
# Environment: VLMEVALKIT_DIR (default ./VLMEvalKit: a clone at VLMEVALKIT_COMMIT, installed
# with `pip install -e`), WORK_DIR (default runs/vlmeval), NPROC (GPUs for inference, default 1),
# PYTHON (default python).
set -euo pipefail

VLMEVALKIT_COMMIT=e8e78f05f3080fe28154f2130321f17951c3be94  # open-compass/VLMEvalKit, 2026-08-18
DATASETS=(LogicVista MathVision_MINI MathVista_MINI)
MIN_PIXELS=$((1280 * 28 * 28))    # vlmeval/config.py, "Qwen2.5-VL-3B-Instruct"
MAX_PIXELS=$((16384 * 28 * 28))

here="$(cd "$(dirname "$0")/.." && pwd)"
PY=${PYTHON:-python}
KIT=${VLMEVALKIT_DIR:-$PWD/VLMEvalKit}
WORK=${WORK_DIR:-runs/vlmeval}
NPROC=${NPROC:-1}
JUDGE=${JUDGE:-gpt-4o-mini}
JUDGE_BASE_URL=${JUDGE_BASE_URL:-}
JUDGE_KEY=${JUDGE_KEY:-${OPENAI_API_KEY:-}}
dry=0
models=()

die() { echo "vlmeval.sh: $*" >&2; exit 2; }
while (($#)); do
  case "$1" in
    --dry-run) dry=1 ;;
    --judge) JUDGE=${2:?--judge needs a model name}; shift ;;
    --judge-base-url) JUDGE_BASE_URL=${2:?--judge-base-url needs a URL}; shift ;;
    --judge-key) JUDGE_KEY=${2:?--judge-key needs a key}; shift ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) models+=("$1") ;;
  esac
  shift
done
((${#models[@]})) || die "name the base model and the checkpoints: bash launch/vlmeval.sh [--dry-run] BASE CHECKPOINT..."

# name and model folder of each argument: "base" for the first; a checkpoint is named by its
# folder (step_004550), its hf/ export evaluated
names=() paths=()
for i in "${!models[@]}"; do
  m=${models[$i]%/}
  if ((i == 0)); then  # a hub id, or a folder (made absolute)
    names+=(base); paths+=("$([[ -d $m ]] && cd "$m" && pwd || echo "$m")"); continue
  fi
  if [[ -f $m/hf/config.json ]]; then path=$m/hf
  elif [[ -f $m/config.json ]]; then path=$m
  else die "$m: neither a checkpoint with hf/config.json nor a model folder with config.json"
  fi
  name=$(basename "$([[ $path == */hf ]] && dirname "$path" || echo "$path")")
  for n in "${names[@]}"; do [[ $n != "$name" ]] || die "two models named $name: give distinct folders"; done
  names+=("$name"); paths+=("$(cd "$path" && pwd)")
  # an export made before checkpoint.py kept the source's image processor caps images lower
  "$PY" "$here/launch/vlmeval_table.py" --check-export "$path" || true
done
[[ -n $JUDGE_KEY || -n $JUDGE_BASE_URL || $dry == 1 ]] || die "no judge: set JUDGE_KEY (or OPENAI_API_KEY) for OpenAI's $JUDGE, or JUDGE_BASE_URL (and JUDGE) for another OpenAI-compatible endpoint"

run() {  # print, and run unless --dry-run
  printf '%q ' "$@"; echo
  ((dry)) || "$@"
}

if ((dry)); then
  echo "# VLMEvalKit: git clone https://github.com/open-compass/VLMEvalKit $KIT && git -C $KIT checkout $VLMEVALKIT_COMMIT && $PY -m pip install -e $KIT"
else
  [[ -d $KIT/.git ]] || die "no VLMEvalKit at $KIT: git clone https://github.com/open-compass/VLMEvalKit $KIT && git -C $KIT checkout $VLMEVALKIT_COMMIT && pip install -e $KIT (or set VLMEVALKIT_DIR)"
  at=$(git -C "$KIT" rev-parse HEAD)
  [[ $at == "$VLMEVALKIT_COMMIT" ]] || die "$KIT is at $at, not the pinned $VLMEVALKIT_COMMIT: git -C $KIT checkout $VLMEVALKIT_COMMIT"
fi
((dry)) || mkdir -p "$WORK"
[[ ! -d $WORK ]] || WORK=$(cd "$WORK" && pwd)
[[ $WORK == /* ]] || WORK=$PWD/$WORK

# the judge's key goes by the environment (OPENAI_API_KEY, which VLMEvalKit reads), so the
# commands printed here never show it
[[ -z $JUDGE_KEY ]] || export OPENAI_API_KEY=$JUDGE_KEY
judge=(--judge "$JUDGE")
[[ -z $JUDGE_BASE_URL ]] || judge+=(--judge-base-url "$JUDGE_BASE_URL")
data=$(printf '"%s": {"class": "%s", "dataset": "%s"}, ' LogicVista LogicVista LogicVista \
  MathVision_MINI MathVision MathVision_MINI MathVista_MINI MathVista MathVista_MINI)
for i in "${!names[@]}"; do
  cfg=$WORK/${names[$i]}.json
  json="{\"model\": {\"${names[$i]}\": {\"class\": \"Qwen2VLChat\", \"model_path\": \"${paths[$i]}\", \"min_pixels\": $MIN_PIXELS, \"max_pixels\": $MAX_PIXELS, \"use_custom_prompt\": false}}, \"data\": {${data%, }}}"
  echo "# ${names[$i]}: $cfg"
  echo "# $json"
  ((dry)) || printf '%s\n' "$json" > "$cfg"
  run env OMP_NUM_THREADS=1 torchrun --nproc_per_node "$NPROC" "$KIT/run.py" --config "$cfg" \
    --work-dir "$WORK" "${judge[@]}"
done
run "$PY" "$here/launch/vlmeval_table.py" --work-dir "$WORK" --base base --trained "${names[@]:1}"
