"""The device table, and that device differences stay in device.py."""
from __future__ import annotations

import os
import subprocess

import pytest

import device as D
from tests.util import ROOT


def test_table_rows():
    assert D.TABLE["cpu"] == D.Device("cpu", "gloo", None, "gloo", fan_out=True)
    assert D.TABLE["cuda"] == D.Device("cuda", "cpu:gloo,cuda:nccl", "CUDA_VISIBLE_DEVICES", "pynccl")
    assert D.TABLE["npu"] == D.Device("npu", "cpu:gloo,npu:hccl", "ASCEND_RT_VISIBLE_DEVICES", "pyhccl")
    # weight buckets: point to point only where the device's tensors travel over gloo
    assert [k for k, d in D.TABLE.items() if d.fan_out] == ["cpu"]


def test_detect_on_this_machine_and_forced(monkeypatch):
    monkeypatch.setenv("GRPO_DEVICE", "npu")
    assert D.detect().kind == "npu"
    monkeypatch.delenv("GRPO_DEVICE")
    assert D.detect().kind == "cpu"  # no accelerator here; torch_npu absent


def test_narrow_visible(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    D.narrow_visible(D.TABLE["cuda"], [2])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    D.narrow_visible(D.TABLE["cuda"], [2, 3])  # a tensor-parallel engine: two devices
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    with pytest.raises(ValueError, match=r"CUDA_VISIBLE_DEVICES=4,5,6: this rank needs devices \[2, 3\]"):
        D.narrow_visible(D.TABLE["cuda"], [2, 3])
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    D.narrow_visible(D.TABLE["npu"], [3])
    assert os.environ["ASCEND_RT_VISIBLE_DEVICES"] == "3"
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES")
    D.narrow_visible(D.TABLE["cpu"], [5])  # CPU: nothing to narrow
    assert "ASCEND_RT_VISIBLE_DEVICES" not in os.environ


def test_hccl_env_against_the_watchdog():
    """HCCL_EXEC_TIMEOUT must stay below cluster.timeout_s (torch-npu's watchdog): derived when
    unset, refused when set at or above it; AIV expansion mode is refused for training."""
    assert D.hccl_env(1800.0, {}) == {"HCCL_EXEC_TIMEOUT": "1620"}
    assert D.hccl_env(1800.0, {"HCCL_EXEC_TIMEOUT": "1740"}) == {}
    for bad in ("1800", "3600", "0", "abc"):
        with pytest.raises(ValueError, match=f"HCCL_EXEC_TIMEOUT={bad} must be in .*cluster.timeout_s=1800"):
            D.hccl_env(1800.0, {"HCCL_EXEC_TIMEOUT": bad})
    with pytest.raises(ValueError, match="HCCL_OP_EXPANSION_MODE=AIV"):
        D.hccl_env(1800.0, {"HCCL_OP_EXPANSION_MODE": "AIV", "HCCL_EXEC_TIMEOUT": "100"})
    assert D.hccl_env(1800.0, {"HCCL_OP_EXPANSION_MODE": "HOST"}) == {"HCCL_EXEC_TIMEOUT": "1620"}


def test_no_accelerator_calls_outside_device_py():
    out = subprocess.run(["git", "grep", "-n", "-E", r"torch\.(cuda|npu)\.|import torch_npu",
                          "--", "*.py", ":!device.py", ":!tests/*", ":!bench/*"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.stdout == "", out.stdout


def test_accelerator_packages_are_not_imported_at_module_level():
    code = ("import sys, train, rollout, sync, model, device, data, loss, config, trainer, world, "
            "failures, vllm_engine, synthetic, checkpoint; "
            "bad = [m for m in ('vllm', 'vllm_ascend', 'torch_npu') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run(["python", "-c", code], cwd=ROOT, check=True)
