"""Loss presets run in the demo; the reference configs' dry runs print the rank plan."""
from __future__ import annotations

import json

import pytest

import config as C
import errors
import world as W
from tests.util import ROOT, TINY, env, metrics, train_py


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
    if preset == "dapo":
        assert "reward/overlong" in rows[0] and "train/dropped_groups" in rows[0]


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
