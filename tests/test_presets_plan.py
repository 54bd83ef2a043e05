"""Loss presets run in the demo; the reference config's dry run prints the rank plan."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import config as C
import world as W
from tests.util import ROOT, TINY, env, metrics


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "dapo"])
def test_demo_runs_with_each_preset(tmp_path, preset):
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, "--config",
                        str(ROOT / "configs" / "presets" / f"{preset}.toml"),
                        f"--run.out_dir={tmp_path}", "--run.steps=3", "--run.keep_last=0"],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
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
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config",
                        str(ROOT / "configs" / "vl3b.toml"), "--dry-run"],
                       cwd=ROOT, env=e, capture_output=True, text=True, timeout=120)
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
        e = (C.NodeConfigError if node_err else C.ConfigError)("node 1 (ranks 8-15) needs ...")
        assert failures.exit_bad_input(e) == 2
        assert ("config error: node 1" in capsys.readouterr().err) == printed, (rank, local, node_err)
