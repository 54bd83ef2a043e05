"""run.export_every: a checkpoint's Hugging Face export at a multiple of it outlives the rotation
of its training state (run.keep_last), as AReaL's saver keeps a model every epoch
(examples/vlm_npu/geometry3k_grpo.yaml:123-129 at 524d1d90f: saver.freq_epochs 1)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed as dist

import checkpoint as ckpt
from device import detect
from tests.util import make_trainer, step_config


def test_exports_at_the_multiples_are_kept_while_the_state_rotates(tiny_step, tmp_path):
    cfg = step_config([f"--run.out_dir={tmp_path}", "--run.steps=7", "--run.save_every=3",
                       "--run.keep_last=2", "--run.export_every=2"])
    tr = make_trainer(tiny_step, cfg)
    world = SimpleNamespace(size=1, train_group=dist.group.WORLD, is_root=True)
    for step in range(1, 8):
        ckpt.save_progress(cfg, world, tr, tiny_step.procs, tiny_step.path, detect(), tmp_path,
                           ckpt.Progress(step=step, version=step))
    # saved at 2, 3, 4, 6 (export_every and save_every multiples) and 7 (the end); keep_last 2
    assert [p.name for p in ckpt.complete(tmp_path)] == ["step_000006", "step_000007"]
    exports = sorted(p.name for p in (tmp_path / "exports").iterdir())
    assert exports == ["step_000002", "step_000004"]   # step 3 rotated away with nothing kept
    for name in exports:
        hf = tmp_path / "exports" / name / "hf"
        assert (hf / "config.json").is_file() and (hf / "model.safetensors").is_file()
    assert (tmp_path / "checkpoints" / "step_000006" / "hf" / "config.json").is_file()


def test_export_every_needs_checkpoints():
    from errors import ConfigError
    with pytest.raises(ConfigError, match="run.export_every needs run.keep_last > 0"):
        step_config(["--run.export_every=5", "--run.keep_last=0"])
