"""launch/compat_check.sh: the pin sets it builds (read from the requirement files), what it
reads from pytest and the demo, and its documented examples under --dry-run. The check itself
(three venvs, the fast tier and a demo in each) runs from .ci/run, after the suite."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.util import ROOT

sys.path.insert(0, str(ROOT / "launch"))
import compat  # noqa: E402


def test_pin_sets_come_from_the_hardware_requirement_files():
    gpu, npu, dev = (compat.pin_set(n) for n in ("gpu", "npu", "device"))
    hw_gpu = compat.read_pins(ROOT / "requirements-gpu.txt")
    hw_npu = compat.read_pins(ROOT / "requirements-npu.txt")
    for pins, hw in ((gpu, hw_gpu), (npu, hw_npu)):
        for name in ("torch", "transformers", "peft", "accelerate", "tokenizers", "huggingface-hub"):
            assert pins[name] == hw[name], name
    assert (npu["torch"], npu["transformers"]) == ("2.10.0", "5.5.4")
    assert (dev["torch"], dev["transformers"]) == ("2.11.0", "5.17.0")
    for pins in (gpu, npu, dev):  # no engine, no accelerator-only package; the tests' own are there
        assert not set(pins) & compat.EXCLUDED
        assert {"pytest", "hypothesis", "pillow", "numpy"} <= set(pins)
    assert compat.venv_dir("gpu", gpu, ROOT) != compat.venv_dir("gpu", {**gpu, "torch": "2.11.1"}, ROOT)
    with pytest.raises(SystemExit, match="unknown pin set 'tpu'"):
        compat.pin_set("tpu")


def test_reads_pytest_counts_and_failing_ids():
    out = ("..F\nFAILED tests/test_a.py::test_x[bash launch/x.sh] - AssertionError: no\n"
           "ERROR tests/test_b.py::test_y\n"
           "1 failed, 700 passed, 7 skipped, 83 deselected in 55.90s\n")
    counts, failed = compat.summary(out)
    assert counts == "1 failed, 700 passed, 7 skipped, 83 deselected"
    assert failed == ["tests/test_a.py::test_x[bash launch/x.sh]", "tests/test_b.py::test_y"]
    assert compat.summary("= 703 passed in 51.0s =")[0] == "703 passed"
    assert compat.summary("ImportError while loading conftest")[0] == "no summary"


def test_demo_lpdiff_needs_every_step(tmp_path):
    m = tmp_path / "metrics.jsonl"
    m.write_text("".join(json.dumps({"step": i, "logprob_diff/max": 1e-6 * (i + 1)}) + "\n"
                         for i in range(compat.DEMO_STEPS)))
    assert compat.demo_lpdiff(m) == pytest.approx(1e-6 * compat.DEMO_STEPS)
    m.write_text(json.dumps({"step": 0, "logprob_diff/max": 1e-6}) + "\n")
    assert compat.demo_lpdiff(m) is None  # a demo that stopped early is no figure


def _examples() -> list[str]:
    text = (ROOT / "launch" / "compat_check.sh").read_text()
    return re.findall(r"^#\s+(bash launch/compat_check\.sh[^#\n]*)", text, re.M)


def test_every_documented_example_passes_dry_run(tmp_path):
    """Each example in the script's header, with --dry-run: the pin sets and venv folders, and
    nothing built (COMPAT_DIR stays empty)."""
    examples = _examples()
    assert len(examples) >= 3, examples
    for cmd in examples:
        words = shlex.split(cmd)
        p = subprocess.run([*words, "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, env=dict(os.environ, COMPAT_DIR=str(tmp_path / "c"),
                                                PYTHON=sys.executable))
        assert p.returncode == 0, (cmd, p.stderr)
        rows = [json.loads(line) for line in p.stdout.splitlines()]
        names = [a for a in words[2:] if not a.startswith("--")] or list(compat.PIN_SETS)
        assert [r["pins"] for r in rows] == names
        assert all(not r["built"] and any(x.startswith("torch==") for x in r["packages"])
                   for r in rows)
    assert not (tmp_path / "c").exists()
