"""configs/vl3b_areal.toml is AReaL PR #746's run: each value against AReaL's, at
inclusionAI/AReaL 524d1d90f (yaml = examples/vlm_npu/geometry3k_grpo.yaml, py =
examples/vlm_npu/geometry3k_grpo.py, dataset = areal/dataset/geometry3k.py)."""
from __future__ import annotations

import pytest

import config as C
import resume_rules
import data
from tests.util import ROOT

PATH = str(ROOT / "configs" / "vl3b_areal.toml")
# dataset:141-145 instruction_following, appended to the problem (dataset:150-153)
EASYR1 = (r" You FIRST think about the reasoning process as an internal monologue and then provide "
          r"the final answer. The reasoning process MUST BE enclosed within <think> </think> tags. "
          r"The final answer MUST BE put in \boxed{}.")

AREAL = {
    "run.seed": 1,                                   # yaml:4
    "run.steps": 70 * 65,                            # README:17 70 epochs x 65 (dataloader.py:25-42)
    "run.save_every": 65, "run.export_every": 65,    # yaml:127 saver.freq_epochs 1
    "run.eval_every": 65,                            # yaml:144 evaluator.freq_epochs 1
    "run.eval_size": 601,                            # py:47-52 the test split (601 problems)
    "cluster.gen_ranks": 4, "cluster.nnodes": 1, "cluster.nproc_per_node": 8,  # yaml:10-17
    "model.path": "Qwen/Qwen2.5-VL-3B-Instruct",     # yaml:38
    "model.dtype": "bfloat16",                       # yaml:42, yaml:101
    "model.min_pixels": 56 * 56, "model.max_pixels": 28 * 28 * 16384,  # the processor's own (py:38)
    "model.activation_checkpointing": True,          # yaml:41
    "data.source": "hiyouga/geometry3k",             # yaml:112
    "data.template": "{problem}" + EASYR1,           # dataset:141-155
    "data.system_prompt": "",                        # dataset:147-155: one user turn
    "data.image_crop": 448,                          # dataset:131-133 convert_image(image, 448, 448)
    "data.delete_text": ["different"],               # dataset:150-152 .replace("different", "")
    "rollout.engine": "vllm",                        # yaml:17 allocation_mode vllm:d4p1t1+d4p1t1
    "rollout.prompts_per_step": 32,                  # yaml:109
    "rollout.group_size": 4,                         # yaml:29
    "rollout.temperature": 1.0,                      # yaml:33
    "rollout.top_p": 1.0, "rollout.top_k": 0,        # yaml:28-33 (defaults: off)
    "rollout.max_new_tokens": 512,                   # yaml:31
    "rollout.max_model_len": 32768,                  # yaml:102
    "rollout.gpu_memory_utilization": 0.9,           # yaml:103
    "rollout.tensor_parallel_size": 1,               # yaml:17 (t1)
    "rollout.max_staleness": 4,                      # yaml:25 max_head_offpolicyness 4
    "rollout.partial": True,                         # areal/core/remote_inf_engine.py:560-575
    "train.lr": 2e-6, "train.weight_decay": 0.01,    # yaml:47-48
    "train.beta1": 0.9, "train.beta2": 0.999,        # yaml:49-50
    "train.warmup_steps": 4,                         # yaml:54: int(0.001 x 4550), fsdp_engine.py:772-774
    "train.lr_schedule": "constant",                 # yaml:52
    "train.grad_clip": 1.0,                          # yaml:53
    "train.micro_batch_tokens": 4096,                # yaml:44
    "train.mini_batches": 1, "train.ppo_epochs": 1,  # yaml:61
    "train.master_dtype": "bfloat16",                # yaml:42, fsdp_engine.py:671-675, 746-754
    "loss.clip_low": 0.4, "loss.clip_high": 0.4,     # yaml:56 (functional.py:193-196)
    "loss.aggregation": "token-mean",                # functional.py:175, 220
    "loss.advantage": "grpo", "loss.scale_by_std": True,  # yaml:66-69 reward_norm group / group
    "loss.advantage_norm": "batch",                  # yaml:70-72 adv_norm batch / batch
    "loss.kl_coef": 0.0,                             # yaml:60
    "loss.correction": "token_mask", "loss.correction_high": 5.0,  # yaml:63-64
    "loss.tis_cap": 0.0,
    "loss.drop_zero_variance": False,                # yaml:65
    "reward.functions": [{"name": "areal_geometry3k"}],  # py:26-33
    "eval.functions": [{"name": "areal_geometry3k"}],    # py:69-72
    "eval.split": "test",                            # py:47-52
    "eval.n": 4, "eval.temperature": 0.6,            # py:71 gconfig.new(temperature=0.6), yaml:29
}


def test_every_value_is_areals():
    tree = C.to_dict(C.load(PATH))
    for key, want in AREAL.items():
        assert resume_rules.lookup(tree, key) == want, key


def test_the_epoch_is_65_steps_as_areal_counts_it():
    # areal/utils/dataloader.py:25-42: DistributedSampler(drop_last) over 4 dp ranks, batches of
    # 32 // 4 with drop_last; Geometry3K's train split: 2,101 problems
    assert data.epoch_steps(2101, 32, 4) == 65
    assert "65 steps an epoch" in data.epoch_line(2101, 32, 4, 4550) and "70.00" in data.epoch_line(2101, 32, 4, 4550)
    assert data.epoch_steps(2101, 30, 4) == 2101 // 30       # 30 does not split over 4: one rank


def test_dry_run_shows_every_value(capsys):
    import train
    assert train.main(["--config", PATH, "--dry-run"]) == 0
    out = capsys.readouterr().out
    tree = C.to_dict(C.load(PATH))
    printed = __import__("tomllib").loads(out.split("\n{")[0])
    for key in AREAL:
        assert resume_rules.lookup(printed, key) == resume_rules.lookup(tree, key), key
