"""The tiny demo with configs/vl3b_areal.toml's recipe on 3 ranks (2 FSDP trainers + 1 HF engine,
gloo): its prompt (EasyR1's \\boxed{} instruction), the image crop + JPEG, the word deletion,
loss.advantage_norm = "batch", train.master_dtype = "bfloat16", 4 versions ahead with partial
rollouts and the token mask at 5, and its reward, areal_geometry3k, beside the demo's toy reward
(which it learns; AReaL's rule stays ~0 on a random tiny model, as the demo's geometry accuracy
does, and is logged every step)."""
from __future__ import annotations

import re

import pytest

from tests.util import ROOT, TINY, metrics, torchrun

pytestmark = pytest.mark.slow  # a torchrun launch

TEMPLATE = next(line.split("=", 1)[1].strip().strip("'") for line in
                (ROOT / "configs" / "vl3b_areal.toml").read_text().splitlines()
                if line.startswith("template ="))
RECIPE = [f"--data.template='{TEMPLATE}'", "--data.image_crop=84", '--data.delete_text=["different"]',
          "--loss.advantage_norm=batch", "--train.master_dtype=bfloat16", "--model.dtype=bfloat16",
          "--rollout.max_staleness=4", "--rollout.partial=true", "--loss.correction=token_mask",
          "--loss.correction_high=5.0",
          '--reward.functions=[{name="areal_geometry3k"}, {name="target_fraction", weight=1.0, target="<answer>"}]']


def test_the_recipe_learns_on_three_ranks(tmp_path):
    p = torchrun(3, [*TINY, *RECIPE, "--run.steps=24", f"--run.out_dir={tmp_path}",
                     "--run.keep_last=1"], timeout=900)
    assert re.search(r"epochs: \d+ steps an epoch of 256 problems at 4 a step", p.stdout), p.stdout[-3000:]
    cfg = (tmp_path / "config.toml").read_text()
    assert "You FIRST think" in cfg and "image_crop = 84" in cfg and 'master_dtype = "bfloat16"' in cfg
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(24))
    assert max(r["rollout/staleness_max"] for r in rows) >= 1      # it ran ahead
    assert all("reward/accuracy" in r and "reward/format" in r for r in rows)  # AReaL's parts, each step
    rewards = [r["reward/mean"] for r in rows]
    print("reward with the recipe's knobs:", [round(x, 3) for x in rewards])
    assert sum(rewards[:4]) / 4 < 0.05
    assert sum(rewards[-4:]) / 4 > 0.3, rewards
    # the trainers' saved state is bf16 (train.master_dtype)
    import torch
    import torch.distributed.checkpoint as dcp
    state = dcp.FileSystemReader(str(tmp_path / "checkpoints" / "step_000024" / "state")).read_metadata()
    model = {k: v for k, v in state.state_dict_metadata.items() if k.startswith("model.")}
    assert model and all(v.properties.dtype == torch.bfloat16 for v in model.values()
                         if hasattr(v, "properties"))
