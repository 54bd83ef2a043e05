#!/usr/bin/env bash
# The hardware's pinned versions (requirements-gpu.txt, requirements-npu.txt, the device image)
# on this CPU: for each pin set a venv (built once, cached under $COMPAT_DIR, default
# ~/.cache/grpo-compat), the fast test tier and a 5-step 3-rank torchrun demo in it, one JSON
# line per pin set; exit non-zero if any is not ok (launch/compat.py says more).
#   bash launch/compat_check.sh                # gpu, npu and device
#   bash launch/compat_check.sh npu            # one pin set
#   bash launch/compat_check.sh --dry-run      # the pins and venv folders; nothing built or run
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" launch/compat.py "$@"
