"""Loss presets run in the demo (GRPO, Dr. GRPO, DAPO, GSPO, CISPO; DAPO's refill in a run); the
reference configs' dry runs print the rank plan (the EasyR1 recipe's too)."""
from __future__ import annotations

import json
import math

import pytest

import config as C
import errors
import world as W
from tests.util import ROOT, TINY, env, metrics, train_py
from train import load_config  # config.load + the checks of the modules config.py does not import


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "dapo"])
def test_demo_runs_with_each_preset(tmp_path, preset):
    p = train_py([*TINY, "--config", str(ROOT / "configs" / "presets" / f"{preset}.toml"),
                  f"--run.out_dir={tmp_path}", "--run.steps=3", "--run.keep_last=0"])
    assert p.returncode == 0, p.stderr[-3000:]
    rows = metrics(tmp_path)
    assert len(rows) == 3
    resolved = (tmp_path / "config.toml").read_text()
    if preset == "grpo":
        assert 'aggregation = "seq-mean-token-mean"' in resolved
        assert rows[-1]["kl"] > 0          # reference policy built; the policy moved away from it
    if preset == "dr_grpo":
        assert "scale_by_std = false" in resolved and rows[-1]["kl"] == 0
    if preset == "dapo":  # a loss preset: the demo's reward functions stay
        assert "train/dropped_groups" in rows[0] and "reward/overlong" not in rows[0]
        assert C.load(str(tmp_path / "config.toml")).reward.functions == C.load(
            str(ROOT / "configs" / "tiny.toml")).reward.functions


@pytest.mark.slow
def test_dapo_on_the_demo_learns_and_the_overlong_fragment_adds_its_reward(tmp_path):
    presets = ROOT / "configs" / "presets"
    p = train_py([*TINY, "--config", str(presets / "dapo.toml"), f"--run.out_dir={tmp_path / 'd'}",
                  "--run.steps=20", "--run.keep_last=0"])
    assert p.returncode == 0, p.stderr[-3000:]
    rows = metrics(tmp_path / "d")
    fraction = [r["reward/target_fraction"] for r in rows]
    assert sum(fraction[-4:]) / 4 > sum(fraction[:4]) / 4 + 0.1, fraction  # the demo's reward rises
    stacked = load_config([str(ROOT / "configs" / "tiny.toml"), str(presets / "dapo.toml"),
                           str(presets / "overlong.toml")], [])
    names = [f["name"] for f in stacked.reward.functions]
    assert names == ["geometry", "target_fraction", "overlong"]
    assert stacked.loss.drop_zero_variance and stacked.loss.clip_high == 0.28


TOY = ['--reward.functions=[{name="target_fraction", weight=1.0, target="<answer>"}]']


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["gspo", "cispo"])
def test_demo_runs_with_gspo_and_cispo_presets(tmp_path, preset):
    p = train_py([*TINY, "--config", str(ROOT / "configs" / "presets" / f"{preset}.toml"), *TOY,
                  f"--run.out_dir={tmp_path}", "--run.steps=3", "--run.keep_last=0",
                  "--train.mini_batches=2"])
    assert p.returncode == 0, p.stderr[-3000:]
    rows = metrics(tmp_path)
    assert len(rows) == 3 and all(r["train/updates"] == 2 for r in rows)
    assert f'objective = "{preset}"' in (tmp_path / "config.toml").read_text()
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)


def ok(p):
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p


@pytest.mark.slow
def test_refill_in_a_run_draws_more_and_stops_at_its_bound(tmp_path):
    # A reward that is 0 for every response (responses are decoded without special tokens, so a
    # special token is never counted): every group has zero variance, so every step runs all its
    # refill rounds, then trains on nothing (all groups masked, counted as dropped).
    zero = ['--reward.functions=[{name="target_fraction", weight=1.0, target="<|im_start|>"}]']
    # (a world of one: the engine's refill rounds do not depend on the ranks; the 3-rank
    # exact-resume run of tests/test_checkpoint.py runs refill across ranks)
    ok(train_py([*TINY, *zero, f"--run.out_dir={tmp_path / 'zero'}", "--run.steps=2",
                 "--run.keep_last=0", "--loss.drop_zero_variance=true", "--rollout.max_refill_rounds=2"]))
    for r in metrics(tmp_path / "zero"):
        assert r["rollout/refill_rounds"] == 2 and r["rollout/prompts_drawn"] == 4 * 3
        assert r["train/dropped_groups"] == 4 and r["loss"] == 0.0
    # The toy reward: early groups are mostly all-zero, so refill draws more prompts; whenever it
    # stopped before its bound, every group that reached the trainers had reward variance.
    ok(train_py([*TINY, *TOY, f"--run.out_dir={tmp_path / 'toy'}", "--run.steps=6",
                 "--run.keep_last=0", "--loss.drop_zero_variance=true", "--rollout.max_refill_rounds=3"]))
    rows = metrics(tmp_path / "toy")
    assert any(r["rollout/prompts_drawn"] > 4 for r in rows), rows
    for r in rows:
        assert r["rollout/prompts_drawn"] == 4 * (1 + r["rollout/refill_rounds"])
        assert r["rollout/refill_rounds"] <= 3
        if r["rollout/refill_rounds"] < 3:
            assert r["train/dropped_groups"] == 0, r


def test_vl3b_dry_run_prints_config_and_rank_plan():
    e = env()
    e["GRPO_DEVICE"] = "cuda"
    p = train_py(["--config", str(ROOT / "configs" / "vl3b.toml"), "--dry-run"], env=e, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    plan, groups = rows[:-1], rows[-1]["groups"]
    assert len(plan) == 16
    assert groups["trainers (FSDP2 mesh)"] == list(range(8))
    assert groups["sync (trainer 0 + engines)"] == [0, *range(8, 16)]
    assert len(groups["vLLM weight channel (outside torch's world)"]) == 9
    assert [r["role"] for r in plan] == ["trainer"] * 8 + ["generation"] * 8
    assert {r["node"] for r in plan[:8]} == {0} and {r["node"] for r in plan[8:]} == {1}
    assert [r["device"] for r in plan[8:]] == [f"cuda:{i}" for i in range(8)]
    assert 'engine = "vllm"' in p.stdout and 'path = "Qwen/Qwen2.5-VL-3B-Instruct"' in p.stdout


def test_easyr1_recipe_dry_run():
    e = env()
    e["GRPO_DEVICE"] = "cuda"
    p = train_py(["--config", str(ROOT / "configs" / "vl3b_easyr1.toml"), "--dry-run"], env=e,
                 timeout=120)
    assert p.returncode == 0, p.stderr
    cfg = load_config(str(ROOT / "configs" / "vl3b_easyr1.toml"))
    W.validate_world(cfg, 16)
    # 4 updates per rollout batch of 512 prompts x 5 samples, KL 1e-2 low_var_kl, lr 1e-6
    assert (cfg.train.mini_batches, cfg.train.ppo_epochs) == (4, 1)
    assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size) == (512, 5)
    assert (cfg.loss.kl_coef, cfg.loss.kl_estimator, cfg.loss.kl_clamp) == (0.01, "k3", 10.0)
    assert (cfg.train.lr, cfg.loss.clip_low, cfg.loss.clip_high) == (1e-6, 0.2, 0.3)
    assert (cfg.rollout.max_new_tokens, cfg.data.max_prompt_len) == (2048, 2048)
    assert (cfg.model.min_pixels, cfg.model.max_pixels) == (262144, 4194304)
    assert "mini_batches = 4" in p.stdout


@pytest.mark.parametrize("device", ["cuda", "npu"])
@pytest.mark.parametrize("name, expect", [
    ("qwen3vl_4b", {"model": {"path": "Qwen/Qwen3-VL-4B-Instruct", "min_pixels": 512 * 512},
                    "data": {"source": "hiyouga/geometry3k", "problem_column": "problem",
                             "answer_column": "answer", "images_column": "images",
                             "system_prompt": ""},
                    "rollout": {"engine": "vllm", "prompts_per_step": 32, "group_size": 4}}),
    ("qwen3_4b_math", {"model": {"path": "Qwen/Qwen3-4B"},
                       "data": {"source": "hiyouga/math12k", "problem_column": "problem",
                                "answer_column": "answer", "images_column": "",
                                "enable_thinking": True, "system_prompt": ""},
                       "rollout": {"engine": "vllm", "prompts_per_step": 512, "group_size": 5},
                       "train": {"mini_batches": 4},
                       "eval": {"split": "test", "before_start": True}}),
])
def test_qwen3_reference_configs_dry_run(name, expect, device, monkeypatch, capsys):
    """configs/qwen3vl_4b.toml and configs/qwen3_4b_math.toml resolve and plan 8 trainers on node
    0 + 8 engines on node 1, on either accelerator; the resolved config (the TOML the dry run
    prints) holds the model, the column mapping and the prompt settings each file documents."""
    import tomllib

    import train
    monkeypatch.setenv("GRPO_DEVICE", device)
    assert train.main(["--config", str(ROOT / "configs" / f"{name}.toml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    toml_text = out[:out.index('\n{"rank"')]
    resolved = tomllib.loads(toml_text)
    for section, values in expect.items():
        for key, value in values.items():
            assert resolved[section][key] == value, (name, section, key, resolved[section][key])
    if name == "qwen3vl_4b":
        assert "enable_thinking" not in resolved["data"]   # unset: the template's own default
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    plan = rows[:-1]
    assert [(r["role"], r["node"]) for r in plan] == [("trainer", 0)] * 8 + [("generation", 1)] * 8
    assert [r["device"] for r in plan[8:]] == [f"{device}:{i}" for i in range(8)]


def test_rank_plan_rejects_impossible_layouts():
    cfg = C.load(str(ROOT / "configs" / "vl3b.toml"))
    with pytest.raises(C.ConfigError, match="cluster.gen_ranks"):
        W.validate_world(cfg, 8)                  # 8 engines, no trainer left
    with pytest.raises(ValueError, match="cluster.gen_ranks"):
        W.rank_plan(8, 8, 8)


def test_dry_run_refuses_more_devices_than_a_node_has(monkeypatch, capsys):
    """4 trainers + 4 engines of tensor_parallel_size 2 need 12 devices on one node: the dry run
    refuses against cluster.devices_per_node (8), as the run would against the node's count."""
    import train
    args = ["--config", str(ROOT / "configs" / "vl3b.toml"), "--cluster.nnodes=1",
            "--cluster.nproc_per_node=8", "--cluster.gen_ranks=4", "--rollout.tensor_parallel_size=2"]
    monkeypatch.setenv("GRPO_DEVICE", "cuda")
    assert train.main([*args, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert ("config error: node 0 (ranks 0-7) needs 12 devices (4 trainer(s) + 4 engine(s) x "
            "rollout.tensor_parallel_size=2) but has 8 (cluster.devices_per_node)") in err, err
    assert train.main([*args, "--cluster.devices_per_node=12", "--dry-run"]) == 0
    monkeypatch.setenv("GRPO_DEVICE", "cpu")  # CPU ranks claim no devices
    assert train.main([*args, "--dry-run"]) == 0


def test_a_node_error_is_printed_by_that_nodes_first_rank(monkeypatch, capsys):
    import failures
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for rank, local, node_err, printed in ((8, 0, True, True), (9, 1, True, False),
                                           (8, 0, False, False), (0, 0, False, True)):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(local))
        e = (errors.NodeConfigError if node_err else C.ConfigError)("node 1 (ranks 8-15) needs ...")
        assert failures.exit_bad_input(e) == 2
        assert ("config error: node 1" in capsys.readouterr().err) == printed, (rank, local, node_err)
