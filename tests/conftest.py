"""Tests import the project's flat modules from the repository root."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GRPO_DEVICE", "cpu")


def pytest_configure(config):
    # `python -m pytest -q -m "not slow" tests` is the fast tier (about 2 minutes on 2 cores):
    # torchrun launches, the vLLM engine and anything long are marked slow.
    config.addinivalue_line("markers", "slow: torchrun launches, vLLM, long runs (skipped by -m 'not slow')")
