"""Checkpoints: exact resume, atomic writes under a kill, HF export, eval-only, local data folder."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tests.util import ROOT, TINY, env, metrics, torchrun, torchrun_cmd, train_py

ARGS = [*TINY, "--run.save_every=2", "--run.eval_every=2", "--run.eval_size=8"]


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def _weights(out_dir, step):
    return load_file(str(out_dir / "checkpoints" / f"step_{step:06d}" / "hf" / "model.safetensors"))


TOY = ['--reward.functions=[{name="target_fraction", weight=1.0, target="<answer>"}]']
# Everything a resume must restore at once, on two FSDP2-sharded trainers + one engine: several
# updates per rollout batch (M = E = 2), DAPO refill, CISPO, the KL options of issue 23 (the KL in
# the reward, the adaptive coefficient with its state in the checkpoint's meta, a reference that
# moves every step with its shards in the checkpoint) and a cosine LR schedule with warm-up: a
# resume that restarted any of them from its initial value would make the rows differ.
EVERYTHING = [*ARGS, *TOY, "--train.mini_batches=2", "--train.ppo_epochs=2",
              "--loss.drop_zero_variance=true", "--rollout.max_refill_rounds=2",
              "--loss.objective=cispo", "--loss.kl_coef=0.05", "--loss.kl_in_reward=true",
              "--loss.kl_estimator=k1", "--loss.kl_target=0.001", "--loss.kl_horizon=100",
              "--train.ref_update_every=1", "--train.ref_mix_alpha=0.5",
              "--train.lr_schedule=cosine", "--train.warmup_steps=1", "--train.min_lr_ratio=0.1",
              "--run.steps=6"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Three 3-rank launches shared by the tests below: `a` runs 6 steps straight; `b` runs the
    same config and trainer rank 0 is killed while writing step 4's checkpoint (after the
    shards, before the commit), then `b` is launched again and resumes from step 2."""
    root = tmp_path_factory.mktemp("resumed")
    a, b = root / "a", root / "b"
    torchrun(3, [*EVERYTHING, f"--run.out_dir={a}"])
    e = env(warm=True)
    e["GRPO_FAULT"] = "checkpoint_before_rename@4:0"  # trainer rank 0 dies writing step 4
    killed = subprocess.run(torchrun_cmd(3, [*EVERYTHING, f"--run.out_dir={b}"]), cwd=ROOT, env=e,
                            capture_output=True, text=True, timeout=300)
    after_kill = {"rc": killed.returncode, "steps": [r["step"] for r in metrics(b)],
                  "checkpoints": sorted(x.name for x in (b / "checkpoints").iterdir())}
    q = torchrun(3, [*EVERYTHING, f"--run.out_dir={b}"])
    return SimpleNamespace(a=a, b=b, after_kill=after_kill, resumed=q)


@pytest.mark.slow
def test_exact_resume_after_a_kill_equals_the_uninterrupted_run(resumed):
    """6 steps straight == 2 + (killed at step 4, resumed from step 2) + 4: every non-timing
    metric and the final weights bit for bit; the HF export loads with transformers and is
    evaluated by --eval-only. (This test merges what were three: 2 + 2 == 4 on the demo config,
    exact resume with mini-batches, epochs, refill and the KL options, and the cosine schedule
    continuing exactly after a kill; a finished run extended by a resume is exact in
    test_lora_world_of_one_learns_and_resumes_exactly.)"""
    a, b, q = resumed.a, resumed.b, resumed.resumed
    assert "resumed from" in q.stdout and "step_000002" in q.stdout
    assert "changed optimizer keys" not in q.stdout
    ra, rb = metrics(a), metrics(b)
    assert [r["step"] for r in rb] == list(range(6))
    assert _strip(ra) == _strip(rb)                  # every non-timing metric, bit for bit
    assert "eval/accuracy" in ra[1] and "eval/accuracy" in ra[3] and "eval/accuracy" in ra[5]
    wa, wb = _weights(a, 6), _weights(b, 6)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["lm_head.weight"], _weights(a, 4)["lm_head.weight"])  # it trained
    # every knob was live, so the comparison above covers its state
    assert len({r["train/kl_coef"] for r in ra}) == 6                     # the coefficient moves
    assert abs(ra[0]["train/kl_seq_mean"]) < 1e-6 < ra[2]["train/kl_seq_mean"]  # ref = policy at 0
    assert [r["train/optimizer_steps"] for r in ra] == [4, 8, 12, 16, 20, 24]
    lrs = [r["train/lr"] for r in ra]
    assert lrs[0] == pytest.approx(2e-3 * 1.0) and lrs[-1] < lrs[1]      # warmed up, decaying

    # The HF export loads with transformers and is evaluated by --eval-only.
    from transformers import Qwen2_5_VLForConditionalGeneration
    Qwen2_5_VLForConditionalGeneration.from_pretrained(str(a / "checkpoints" / "step_000006" / "hf"))
    q = train_py([*TINY, f"--run.out_dir={a}", "--run.eval_size=8", "--eval-only", "--checkpoint",
                  str(a / "checkpoints" / "step_000006")])
    assert q.returncode == 0, q.stderr[-3000:]
    assert "engine warm-up: " in q.stdout and "a prompt with 1 image, greedy, 4 new tokens" in q.stdout
    row = json.loads((a / "eval.jsonl").read_text().splitlines()[-1])
    assert row["eval/n"] == 8 and 0.0 <= row["eval/accuracy"] <= 1.0
    # into a new run folder: the checkpoint's export is the whole model, no base is built there
    new = a.parent / "evaluated"
    q = train_py([*TINY, f"--run.out_dir={new}", "--run.eval_size=4", "--eval-only", "--checkpoint",
                  str(a / "checkpoints" / "step_000006")])
    assert q.returncode == 0, q.stderr[-3000:]
    assert (new / "eval.jsonl").is_file() and not (new / "tiny-model").exists()


@pytest.mark.slow
def test_kill_during_checkpoint_keeps_previous_and_resumes(resumed):
    """The killed launch of the fixture: the previous checkpoint intact, the new one not
    committed; the resume redoes steps 2-3 and every record file holds every step once."""
    tmp_path = resumed.b
    assert resumed.after_kill["rc"] != 0
    names = resumed.after_kill["checkpoints"]
    assert names == ["step_000002", "step_000004.tmp"], names   # previous intact, new one not committed
    assert resumed.after_kill["steps"] == [0, 1, 2, 3]          # logged before the commit failed
    assert [r["step"] for r in metrics(tmp_path)] == list(range(6))
    # every record file holds every step once: steps 2-3, logged before step 4's checkpoint
    # failed to commit, were moved aside and done again
    assert _column(tmp_path, "samples.jsonl", "step") == [s for s in range(6) for _ in range(2)]
    assert _column(tmp_path, "eval.jsonl", "after") == [2, 4, 6]
    assert _column(tmp_path, "metrics.abandoned.jsonl", "step") == [2, 3]
    assert _column(tmp_path, "eval.abandoned.jsonl", "after") == [4]
    # keep_last=2, and rotation never deletes the checkpoint the run resumed from
    ck = tmp_path / "checkpoints"
    assert sorted(x.name for x in ck.iterdir()) == ["step_000002", "step_000004", "step_000006"]


@pytest.mark.slow
def test_lora_world_of_one_learns_and_resumes_exactly(tmp_path):
    """`--model.lora_rank=8` in a world of one (trainer and HF engine in one process): 24 steps
    straight == 12 + resume + 12, every non-timing metric and the saved adapters and export bit
    for bit; every sync verified bitwise; the reward rises as in the 3-rank LoRA run
    (test_e2e.py: as with full training; the demo's adapters include the output head)."""
    args = [*TINY, "--model.lora_rank=8", "--sync.verify=true", "--run.save_every=12",
            "--run.eval_every=12", "--run.eval_size=4",
            '--reward.functions=[{name="target_fraction", weight=1.0, target="<answer>"}]']
    a, b = tmp_path / "a", tmp_path / "b"
    for out, steps in ((a, 24), (b, 12), (b, 24)):
        p = _one([*args, f"--run.out_dir={out}", f"--run.steps={steps}"])
        assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stdout and "step_000012" in p.stdout
    ra, rb = metrics(a), metrics(b)
    assert [r["step"] for r in rb] == list(range(24))
    assert _strip(ra) == _strip(rb)
    assert all(r["sync/checksum_ok"] == 1.0 and r["logprob_diff/max"] <= 1e-4 for r in ra)
    rewards = [r["reward/mean"] for r in ra]
    assert sum(rewards[:4]) / 4 < 0.05 and sum(rewards[-4:]) / 4 > 0.4, rewards
    for part in ("hf/model.safetensors", "adapter/adapter_model.safetensors"):
        wa, wb = (load_file(str(d / "checkpoints" / "step_000024" / part)) for d in (a, b))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), part


@pytest.mark.slow
def test_local_geometry3k_folder_trains(tmp_path):
    """`python data.py --write-synthetic` writes the Geometry3K layout; the trainer reads it."""
    d = tmp_path / "g3k"
    subprocess.run([sys.executable, str(ROOT / "data.py"), "--write-synthetic", str(d),
                    "--n-train", "32", "--n-val", "8", "--n-test", "8"], cwd=ROOT, check=True,
                   env=env(), capture_output=True)
    p = train_py([*TINY, f"--data.source={d}", f"--run.out_dir={tmp_path / 'run'}", "--run.steps=2",
                  "--run.keep_last=0", "--data.max_prompt_len=200"])
    assert p.returncode == 0, p.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert len(rows) == 2
    assert rows[0]["data/skipped"] > 0     # prompts over 200 tokens (image tokens counted) skipped
    assert "skipping row" in p.stderr


def test_plot_script_draws_png(tmp_path):
    rows = [{"step": i, "reward/mean": i / 10, "reward/accuracy": 0.0, "reward/format": 0.0,
             "response_len/mean": 16.0, **({"eval/accuracy": 0.1} if i % 2 else {})} for i in range(6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = subprocess.run([sys.executable, str(ROOT / "launch" / "plot.py"), str(tmp_path)],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def _one(args: list[str], fault: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """A world of one (`python train.py`, warm: tests/util.train_py): the checkpoint logic does
    not depend on the ranks."""
    e = env()
    if fault:
        e["GRPO_FAULT"] = fault
    return train_py([*TINY, *args], env=e, timeout=timeout)


def _ours(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith(("error:", "config error:", "warning:"))]


@pytest.mark.slow
def test_resume_from_an_older_checkpoint_owns_its_branch(tmp_path):
    """Resuming step 2 of a run that got to 4, with save_every = 1 and keep_last = 1: the newer
    checkpoints are moved aside (not deleted), the first save works, rotation keeps the
    checkpoint the run resumed from, and the run ends at step 4 with every step logged once."""
    ck = tmp_path / "checkpoints"
    p = _one([f"--run.out_dir={tmp_path}", "--run.steps=4", "--run.save_every=1", "--run.keep_last=3"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert [x.name for x in sorted(ck.iterdir())] == ["step_000002", "step_000003", "step_000004"]
    q = _one([f"--run.out_dir={tmp_path}", "--run.steps=4", "--run.save_every=1", "--run.keep_last=1",
              "--resume", str(ck / "step_000002")])
    assert q.returncode == 0, q.stderr[-3000:]
    assert "moved 2 checkpoint(s) newer than step 2 aside" in q.stdout
    [aside] = ck.glob("abandoned-*")
    assert sorted(x.name for x in aside.iterdir()) == ["step_000003", "step_000004"]
    assert sorted(x.name for x in ck.iterdir() if x != aside) == ["step_000002", "step_000004"]
    assert [r["step"] for r in metrics(tmp_path)] == [0, 1, 2, 3]


def _column(out_dir, name: str, key: str) -> list:
    return [json.loads(ln)[key] for ln in (out_dir / name).read_text().splitlines()]


@pytest.mark.slow
def test_kill_right_after_a_checkpoint_commit_and_a_torn_line_lose_no_record(tmp_path):
    """kill -9 right after step 2's checkpoint is committed, then a last line of samples.jsonl
    cut off mid-write (what a full disk leaves): the restart drops the torn line saying so, and
    every step is in every record file exactly once (the step's records were written before
    its checkpoint's commit; the loop used to write them after it, losing step 1 for good)."""
    args = [f"--run.out_dir={tmp_path}", "--run.steps=4", "--run.save_every=1", "--run.keep_last=1",
            "--run.eval_every=1", "--run.eval_size=2"]
    p = _one(args, fault="checkpoint_after_rename@2")
    assert p.returncode == -9, p.stderr[-3000:]
    assert sorted(x.name for x in (tmp_path / "checkpoints").iterdir()) == ["step_000001",
                                                                            "step_000002"]
    with open(tmp_path / "samples.jsonl", "a") as f:
        f.write('{"step": 2, "index": 7, "gro')
    q = _one(args)
    assert q.returncode == 0, q.stderr[-3000:]
    assert _ours(q.stderr) == [f"warning: {tmp_path / 'samples.jsonl'}: its last line was cut off "
                               "mid-write (28 bytes, not JSON; a full disk or a kill while writing): "
                               "dropped"]
    assert "resumed from" in q.stdout and "step_000002 at step 2" in q.stdout
    assert _column(tmp_path, "metrics.jsonl", "step") == [0, 1, 2, 3]
    assert _column(tmp_path, "samples.jsonl", "step") == [0, 0, 1, 1, 2, 2, 3, 3]  # log_samples = 2
    assert _column(tmp_path, "eval.jsonl", "after") == [1, 2, 3, 4]
    assert not list(tmp_path.glob("*.abandoned.jsonl"))   # nothing after the checkpoint to move


@pytest.mark.slow
def test_damaged_checkpoint_falls_back_or_stops_when_named(tmp_path):
    ck = tmp_path / "checkpoints"
    p = _one([f"--run.out_dir={tmp_path}", "--run.steps=2", "--run.save_every=1"])
    assert p.returncode == 0, p.stderr[-3000:]
    shard = next((ck / "step_000002" / "state").glob("*.distcp"))
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    # named by --resume: one line, exit 2, nothing moved, no traceback
    q = _one([f"--run.out_dir={tmp_path}", "--run.steps=2", "--resume", str(ck / "step_000002")])
    assert q.returncode == 2, q.stderr[-3000:]
    assert _ours(q.stderr) == [f"error: checkpoint {ck / 'step_000002'} is damaged: state/{shard.name}: "
                               f"{size // 2} bytes, expected {size}"]
    assert "Traceback" not in q.stderr and (ck / "step_000002").is_dir()
    # not named: the newest intact one, saying so; the damaged one moved aside, not deleted
    r = _one([f"--run.out_dir={tmp_path}", "--run.steps=2"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert _ours(r.stderr) == [f"warning: checkpoint {ck / 'step_000002'} is damaged (state/{shard.name}: "
                               f"{size // 2} bytes, expected {size}); trying the next older one"]
    assert f"resumed from {ck / 'step_000001'} at step 1" in r.stdout
    assert [x["step"] for x in metrics(tmp_path)] == [0, 1]
    [aside] = ck.glob("abandoned-*")
    assert (aside / "step_000002" / "state" / shard.name).stat().st_size == size // 2


@pytest.mark.slow
def test_full_disk_while_saving_is_named_and_the_previous_checkpoint_stays(tmp_path):
    """GRPO_FAULT=checkpoint_enospc (any machine; tests/test_resume.py also fills a real tmpfs)."""
    ck = tmp_path / "checkpoints"
    p = _one([f"--run.out_dir={tmp_path}", "--run.steps=3", "--run.save_every=1"],
             fault="checkpoint_enospc@2")
    assert p.returncode == 4, p.stderr[-3000:]
    assert _ours(p.stderr) == [
        "error: rank 0 (trainer+generation) failed at step 1 (eval/checkpoint): checkpoint "
        f"step_000002 not saved: No space left on device ({ck}: "
        + _ours(p.stderr)[0].split(f"({ck}: ")[1]]
    assert _ours(p.stderr)[0].endswith("MiB free); the previous checkpoint step_000001 is intact")
    assert "Traceback" not in p.stderr
    assert sorted(x.name for x in ck.iterdir()) == ["step_000001"]
    q = _one([f"--run.out_dir={tmp_path}", "--run.steps=3", "--run.save_every=1"])
    assert q.returncode == 0 and "resumed from" in q.stdout and "step_000001" in q.stdout


@pytest.mark.slow
def test_resume_with_more_trainer_ranks_reshards(tmp_path):
    """A checkpoint of 1 trainer rank resumed on 2: weights and optimizer resharded. The step
    after the resume sees the same episodes and nearly the same update as an uninterrupted
    1-trainer run (not bit-exact: another reduction order, RNG states not restored).
    `b` is a copy of the uninterrupted run `a` resumed from its step-2 checkpoint (the newer one
    moved aside, tests/test_resume.py), as a run of 2 steps would have left it."""
    import shutil
    a, b = tmp_path / "a", tmp_path / "b"
    args = [*TINY, "--run.save_every=2", "--rollout.temperature=1.0"]
    torchrun(2, [*args, f"--run.out_dir={a}", "--run.steps=3"])
    shutil.copytree(a, b)
    at_2 = ["--resume", str(b / "checkpoints" / "step_000002")]
    # another rank split is another experiment: refused, naming both counts, unless allowed
    q = torchrun(3, [*args, f"--run.out_dir={b}", "--run.steps=3", *at_2], check=False)
    assert q.returncode != 0 and q.stderr.count("config error") == 1
    assert "the rank split (trainers of ranks) '1 of 2' -> '2 of 3'" in q.stderr
    p = torchrun(3, [*args, f"--run.out_dir={b}", "--run.steps=3", *at_2,
                     "--run.allow_config_change=true"])
    assert ("resuming a checkpoint of 1 trainer rank(s) on 2: weights and optimizer state "
            "resharded") in p.stdout
    assert "resumed from" in p.stdout
    ra, rb = metrics(a), metrics(b)
    assert [r["step"] for r in rb] == [0, 1, 2]
    assert rb[2]["reward/mean"] == ra[2]["reward/mean"]            # same episodes: same engine weights
    assert rb[2]["logprob_diff/max"] < 1e-4                        # trainer == engine after the resume
    assert rb[2]["grad_norm"] == pytest.approx(ra[2]["grad_norm"], rel=1e-4)  # the optimizer state too
    wa, wb = _weights(a, 3), _weights(b, 3)
    assert all(torch.allclose(wa[k], wb[k], atol=1e-5) for k in wa)


@pytest.mark.slow
def test_real_full_disk_while_saving_is_named(tmp_path):
    """A 5 MiB tmpfs under checkpoints/ holds one checkpoint of the tiny model (3.5 MB), not
    two (root only: mounting needs it; the fault-injected test above runs anywhere)."""
    import os
    import shutil
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(ck)],
                       capture_output=True, text=True)
    if m.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {m.stderr.strip()}")
    try:
        p = _one([f"--run.out_dir={tmp_path}", "--run.steps=3", "--run.save_every=1"])
        assert p.returncode == 4, p.stderr[-3000:]
        [line] = _ours(p.stderr)
        assert line.startswith("error: rank 0 (trainer+generation) failed at step 1 (eval/checkpoint): "
                               f"checkpoint step_000002 not saved: No space left on device ({ck}: "), line
        assert line.endswith("the previous checkpoint step_000001 is intact") and "Traceback" not in p.stderr
        assert sorted(x.name for x in ck.iterdir()) == ["step_000001"]   # the partial folder is gone
    finally:
        subprocess.run(["umount", str(ck)], check=False)
