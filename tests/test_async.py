"""Engines running ahead under real 3-rank torchrun launches (2 trainers + 1 hf engine, CPU):
k = 4 with partial rollouts learns within the bound, a resume at k = 4 trains the same prompts
at every step as the run it continues, a dead engine rank and Ctrl-C still end the job at once.
(k = 1 keeps today's overlap schedule: tests/test_e2e.py's overlap test; the Producer's rules
apart from a launch: tests/test_pipeline.py.)"""
from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from tests.util import ROOT, TINY, env, metrics, torchrun, torchrun_cmd

pytestmark = pytest.mark.slow

TOY = ['--reward.functions=[{name="target_fraction", weight=1.0, target="<answer>"}]']
K4 = ["--rollout.max_staleness=4", "--loss.correction=token_mask"]


@pytest.mark.parametrize("partial", ["true", "keep"])
def test_four_ahead_with_partial_rollouts_learns_within_the_bound(tmp_path, monkeypatch, partial):
    """k = 4 with partial rollouts learns as the synchronous demo does, within the bound. The
    schedule is pinned on any machine (GRPO_FAULT's hooks, pipeline.py): batch 1 is held after
    its first decode step until version 1 arrives (it spans two versions), and step 1 finds the
    engine run ahead to the bound (later steps train groups more than one version old).
    "recompute" (true) prefills the continued rows again; "keep" never does."""
    monkeypatch.setenv("GRPO_FAULT", "hold_for_weights,fill_queue@1")
    torchrun(3, [*TINY, *TOY, *K4, "--run.steps=32", f"--run.out_dir={tmp_path}",
                 f"--rollout.partial={partial}"])
    rows = metrics(tmp_path)
    again = [r["rollout/reprefill_tokens"] for r in rows]
    assert (again[1] > 0) if partial == "true" else not any(again), again
    assert all(r["rollout/staleness_max"] <= 4 for r in rows), [r["rollout/staleness_max"] for r in rows]
    assert max(r["rollout/staleness_max"] for r in rows) > 1          # it really ran ahead
    assert rows[1]["rollout/partial_frac"] > 0                        # episodes spanning versions
    measured = [r for r in rows if r["logprob_diff/tokens"]]  # a step whose tokens were all stale: none
    assert all(r["logprob_diff/max"] <= 1e-4 for r in measured), [r["logprob_diff/max"] for r in measured]
    assert not any("logprob_diff/max" in r for r in rows if not r["logprob_diff/tokens"])
    assert sum(r["logprob_diff/tokens"] for r in rows) > 0            # compared on real tokens
    for key in ("rollout/stale_dropped", "rollout/queue_groups", "time/engine_idle_frac",
                "time/trainer_wait_frac", "rollout/staleness_mean", "train/correction_masked_frac"):
        assert key in rows[-1], key
    rewards = [r["reward/mean"] for r in rows]
    print("reward, 4 ahead with partial rollouts:", [round(x, 3) for x in rewards])
    assert sum(rewards[:4]) / 4 < 0.05
    assert sum(rewards[-4:]) / 4 > 0.4, rewards


def _problems_by_step(out) -> dict[int, list[int]]:
    by: dict[int, list[int]] = {}
    for line in (out / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        by.setdefault(row["step"], []).append(row["index"])
    return by


def test_resume_four_ahead_trains_the_same_prompts_at_every_step(tmp_path, monkeypatch):
    """README (docs/async.md): with stale = "wait" step t trains batch t of the seeded prompt
    stream, so a resumed run trains the prompts the uninterrupted run would, regenerated with the
    checkpoint's weights (fresher: staleness restarts at 0); nothing skipped or trained twice.
    Step 0 finds the engine at the bound (GRPO_FAULT=fill_queue@0: batches 0-4 made with
    version 0 on any machine), so step 2 trains a group two versions old."""
    monkeypatch.setenv("GRPO_FAULT", "fill_queue@0")
    common = [*TINY, *TOY, *K4, "--run.steps=6", "--run.save_every=3", "--run.log_samples=4"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    torchrun(3, [*common, f"--run.out_dir={whole}"])
    torchrun(3, [*common, f"--run.out_dir={part}", "--run.steps=3"])
    torchrun(3, [*common, f"--run.out_dir={part}"])   # resumes from part's step 3
    a, b = _problems_by_step(whole), _problems_by_step(part)
    assert sorted(a) == sorted(b) == list(range(6))
    assert all(a[t] == b[t] for t in range(6)), (a, b)
    rows = metrics(part)
    assert [r["step"] for r in rows] == list(range(6))
    assert rows[3]["rollout/staleness_max"] == 0 and rows[2]["rollout/staleness_max"] == 2


def test_resume_with_drop_continues_each_engines_stream_position(tmp_path):
    """stale = "drop": the checkpoint holds each engine's stream position, the resumed engines
    start there (the start-up line names it) and the run goes on to its last step."""
    import torch
    common = [*TINY, *TOY, "--rollout.max_staleness=1", "--rollout.stale=drop",
              "--loss.correction=icepop", "--run.save_every=3", f"--run.out_dir={tmp_path}"]
    torchrun(3, [*common, "--run.steps=3"])
    meta = torch.load(tmp_path / "checkpoints" / "step_000003" / "state" / "meta.pt", weights_only=False)
    (b, g), = meta["stream"]
    assert b >= 3
    p = torchrun(3, [*common, "--run.steps=5"])
    assert f"the engines' prompt streams resume at batch {b} (+{g} groups)" in p.stdout, p.stdout[-2000:]
    assert [r["step"] for r in metrics(tmp_path)] == list(range(5))


def test_dead_engine_rank_and_ctrl_c_end_a_running_ahead_job(tmp_path):
    e = dict(env(True), GRPO_FAULT="die@3:2")
    args = [*TINY, *K4, "--rollout.partial=true",
            "--run.keep_last=0", "--cluster.timeout_s=20"]
    t0 = time.monotonic()
    p = subprocess.run(torchrun_cmd(3, [*args, "--run.steps=8", f"--run.out_dir={tmp_path / 'd'}"]),
                       cwd=ROOT, env=e, capture_output=True, text=True, timeout=240)
    assert p.returncode != 0 and "rank 2 (generation) died" in p.stderr, p.stderr[-3000:]
    assert time.monotonic() - t0 < 90
    out = tmp_path / "c"
    proc = subprocess.Popen(torchrun_cmd(3, [*args, "--run.steps=500", f"--run.out_dir={out}"],
                                         warm=False),
                            cwd=ROOT, env=env(False), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 180
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip()):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    t1 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert time.monotonic() - t1 < 15
    # every rank: one line, exit 130 (torchrun itself then exits 1 on the signal it received)
    assert proc.returncode != 0 and err.count("stopped by SIGINT") == 3, err[-3000:]
