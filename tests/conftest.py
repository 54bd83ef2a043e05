"""Tests import the project's flat modules from the repository root."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GRPO_DEVICE", "cpu")


def pytest_sessionstart(session):
    # the warm train.py server (tests/warm.py) imports on the other core while tests collect;
    # under `-n 2` (pytest-xdist) each worker starts its own, the controller (no tests) none
    controller = "PYTEST_XDIST_WORKER" not in os.environ
    if getattr(session.config.option, "numprocesses", None) and controller:
        return
    from tests import warm
    warm.start_server()


def pytest_configure(config):
    # `python -m pytest -q -m "not slow" tests` is the fast tier (about 2 minutes on 2 cores):
    # torchrun launches, the vLLM engine and anything long are marked slow.
    config.addinivalue_line("markers", "slow: torchrun launches, vLLM, long runs (skipped by -m 'not slow')")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """`tiny_dir(model_type)`: the folder of that family's tiny random model, built once for the
    whole session (every test of every module shares it; build_tiny is deterministic)."""
    import model as M
    root = tmp_path_factory.mktemp("families")

    def get(model_type: str = "qwen2_5_vl") -> str:
        return str(M.build_tiny(root / model_type, model_type=model_type))
    return get
