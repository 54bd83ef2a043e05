"""bench/device_check.sh, the prepared one-GPU check: its syntax, and its CPU mode (the same
steps on CPU with the tiny model) printing the one JSON object. Not run on a GPU here."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.util import ROOT

SCRIPT = ROOT / "bench" / "device_check.sh"


def test_syntax():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.slow
def test_cpu_mode_prints_one_json_object(tmp_path):
    e = dict(os.environ, GRPO_DEVICE="cpu", OUT=str(tmp_path / "out"), DEMO_STEPS="4",
             OMP_NUM_THREADS="1", PYTHON=sys.executable)
    p = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=e, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1, p.stdout        # one JSON object, nothing else on stdout
    r = json.loads(lines[0])
    for key in ("peak_memory_gb", "tokens_per_s", "mfu", "checkpoint_calls_per_step",
                "logprob_diff/max", "versions", "step", "demo"):
        assert key in r, key
    assert r["checkpoint_calls_per_step"] == 2   # tiny model: 2 decoder layers (the tower: never)
    assert r["step"]["dtype"] == "bf16-mixed" and r["step"]["checkpointing"] == "full"
    assert r["demo"]["steps"] == 4 and 0 < r["logprob_diff/max"] < 0.1  # bf16 trainer vs fp32 engine
    assert r["tokens_per_s"] > 0 and r["versions"]["PIL"] and r["failed"] == []
    # packed rows: exact against padded (fp32) and in the demo's logprob parity
    assert r["pack_tiny"]["exact"]["grad_max_rel_diff"] < 1e-5 and r["pack_tiny"]["speedup"] > 0
    assert r["pack_3b"]["workload"]["model"] == "3b qwen2_5_vl, 1 layer(s)"
    assert r["pack_3b"]["packed"]["padding_frac"] == 0.0
    assert r["demo_packed"]["steps"] == 4 and r["demo_packed"]["logprob_diff/max"] <= 1e-4
    # the GRPO step, checkpointing off, full and selective (tiny: 2 decoder layers recomputed per
    # micro-batch), compiled without and with checkpointing (its recomputation inside the
    # compiled backward: not counted), and the head's peak chunked against full
    g, gc, gs, gk = r["grpo"], r["grpo_ckpt"], r["grpo_sel"], r["grpo_compile"]
    gkc = r["grpo_compile_ckpt"]
    assert gkc["compile"] and gkc["checkpointing"] == "full" and gkc["checkpoint_calls_per_step"] is None
    assert gkc["aten_ops_per_microbatch"] > 0 and gkc["forward_backward_s"] > 0
    assert g["mode"] == gc["mode"] == "grpo" and g["dtype"] == "bf16-mixed"
    assert (g["checkpointing"], gc["checkpointing"], gs["checkpointing"]) == ("off", "full", "selective")
    assert g["checkpoint_calls_per_step"] == 0 and gc["checkpoint_calls_per_step"] == 2 * gc["micro_batches"]
    assert gs["checkpoint_calls_per_step"] == 2 * gs["micro_batches"] and gk["compile"] and not g["compile"]
    assert g["aten_ops_per_microbatch"] > 0 and g["forward_backward_s"] > 0 and g["optimizer_s"] > 0
    assert r["head"]["tokens"] == 64 and 0 < r["head"]["head_peak_mb"] and 0 < r["head"]["head_peak_mb_full"]
    # the colocated step: both phases ran, its figures present (memory: 0 on CPU)
    c = r["colocate"]
    assert c["model"] == "tiny" and c["dtype"] == "bf16" and c["load_s"] > 0
    assert {"peak_generate_gb", "peak_train_gb", "sleep_freed_gb", "sleep_s", "wake_s"} <= set(c)


@pytest.mark.slow
def test_a_failed_step_is_named_and_the_others_still_run(tmp_path):
    """A step that fails (here: the demo's run.steps is refused) is named in "failed", its
    log's tail goes to stderr, the other steps (STEPS: these two) still run and print their
    figures, the steps not asked for print null, and the exit is 1."""
    e = dict(os.environ, GRPO_DEVICE="cpu", OUT=str(tmp_path / "out"), DEMO_STEPS="-1",
             OMP_NUM_THREADS="1", PYTHON=sys.executable, STEP_SEQ="64", STEPS="demo step")
    p = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=e, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 1, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["failed"] == ["demo"] and "run.steps" in p.stderr
    assert r["demo"] is None and r["step"]["seq_len"] == 64
    assert r["pack_tiny"] is None and r["demo_packed"] is None


def test_an_unknown_step_is_named(tmp_path):
    e = dict(os.environ, GRPO_DEVICE="cpu", OUT=str(tmp_path / "out"), PYTHON=sys.executable,
             STEPS="demo stpe")
    p = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=e, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "STEPS names stpe" in p.stderr and p.stdout == ""


def test_missing_module_is_named(tmp_path):
    """An image without a module the steps need stops at step 0 with its name."""
    (tmp_path / "PIL.py").write_text("raise ImportError('not in this image')\n")
    e = dict(os.environ, GRPO_DEVICE="cpu", OUT=str(tmp_path / "out"), PYTHON=sys.executable,
             PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=e, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode != 0 and "missing in this image: PIL" in p.stderr, p.stderr
    assert p.stdout == ""
