"""Fail fast, name the culprit: dead and hung ranks, NaNs, bad config, failing rewards."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

import rewards
from tests.util import ROOT, TINY, env, metrics

TIMEOUT = 20  # cluster.timeout_s in these tests


def launch(tmp_path, fault: str | None, *extra: str, timeout: float = 240):
    e = env()
    if fault:
        e["GRPO_FAULT"] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           str(ROOT / "train.py"), *TINY, f"--run.out_dir={tmp_path}", "--run.keep_last=0",
           f"--cluster.timeout_s={TIMEOUT}", *extra]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


def _last_step_time(out_dir) -> float:
    return (out_dir / "metrics.jsonl").stat().st_mtime


@pytest.mark.slow
@pytest.mark.parametrize("victim, role", [(2, "generation"), (1, "trainer")])
def test_killed_rank_stops_the_job_and_is_named(tmp_path, victim, role):
    p, _ = launch(tmp_path, f"die@2:{victim}", "--run.steps=6")
    end = time.time()
    assert p.returncode != 0
    assert f"rank {victim} ({role}) died" in p.stderr, p.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path)] == [0, 1]
    # every rank was gone within the collective timeout plus a margin of the last logged step
    assert end - _last_step_time(tmp_path) < TIMEOUT + 30


@pytest.mark.slow
def test_hung_rank_times_out_and_is_named(tmp_path):
    p, _ = launch(tmp_path, "hang@1:2", "--run.steps=4", "--cluster.timeout_s=8")
    end = time.time()
    assert p.returncode != 0
    assert "rank 2 (generation) is stuck in 'step 1: hung'" in p.stderr, p.stderr[-3000:]
    assert "Timed out waiting 8000ms" in p.stderr
    # the hung rank itself is stopped (abort notice or the launcher), not left behind
    assert "rank 2 (generation) stopp" in p.stderr, p.stderr[-3000:]
    assert end - _last_step_time(tmp_path) < 8 + 30


@pytest.mark.slow
def test_nan_step_is_skipped_and_counted(tmp_path):
    p, _ = launch(tmp_path, "nan_loss@1", "--run.steps=3")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["train/skipped"] for r in rows] == [0.0, 1.0, 0.0]
    assert rows[-1]["train/skipped_steps"] == 1.0
    assert rows[1]["grad_norm"] != rows[1]["grad_norm"]  # nan logged as it was


@pytest.mark.slow
def test_consecutive_nans_stop_the_run(tmp_path):
    p, _ = launch(tmp_path, "nan_loss", "--run.steps=6", "--train.max_skipped_steps=2")
    assert p.returncode != 0
    assert "2 consecutive steps had a non-finite loss" in p.stderr
    assert len(metrics(tmp_path)) == 2


@pytest.mark.slow
def test_bad_world_split_fails_before_any_group_work(tmp_path):
    p, dt = launch(tmp_path, None, "--cluster.gen_ranks=3", timeout=120)
    assert p.returncode != 0
    assert "config error: cluster.gen_ranks=3 leaves no trainer rank in a world of 3" in p.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@rewards.register("_test_raises")
def _raises(response, sample):
    raise ValueError("boom")


@rewards.register("_test_slow")
def _slow(response, sample):
    time.sleep(2)
    return {"reward": 1.0}


@rewards.register("_test_no_reward_key")
def _bad_shape(response, sample):
    return {"score": 1.0}


def test_failing_reward_functions_score_zero_and_are_counted():
    fns = [{"name": "target_fraction", "weight": 1.0, "target": "a"},
           {"name": "_test_raises", "weight": 1.0}, {"name": "_test_slow", "weight": 1.0},
           {"name": "_test_no_reward_key", "weight": 1.0}]
    t0 = time.monotonic()
    out = rewards.score("aab", {"response_len": 3}, fns, timeout_s=0.2)
    assert time.monotonic() - t0 < 1.5
    assert out["errors"] == 3.0
    assert out["reward"] == pytest.approx(2 / 3)   # only the working function counts
