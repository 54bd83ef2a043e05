"""End-to-end step time: the CPU demo synchronous vs with one-step overlap, in one invocation.

    python bench/e2e.py                       # 12 steps each, 1 trainer + 1 engine
    python bench/e2e.py --steps 20 --nproc 3  # the demo's 2 trainers + 1 engine

Runs `train.py --config configs/tiny.toml` twice under torchrun (max_staleness 0, then 1 with
truncated importance sampling) and prints one JSON object with medians over the steps after a
warm-up: sync_step_s, overlap_step_s, and the synchronous run's generate_s, train_s, sync_s;
overlap_ratio = overlap_step_s / (max(generate_s, train_s) + sync_s), where 1.0 is a perfect
overlap. The default is 2 processes because this machine has 2 cores: with 3 processes the
overlapped phases compete for cores and the ideal max(generate, train) is not reachable.
Also reports the last-4-steps mean reward of both runs (overlap must still learn).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(out: Path, nproc: int, steps: int, extra: list[str]) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", GRPO_DEVICE="cpu")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "tiny.toml"),
           f"--run.out_dir={out}", f"--run.steps={steps}", "--run.keep_last=0",
           '--reward.functions=[{name="target_fraction", weight=1.0}]', *extra]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        sync = run(Path(d) / "sync", a.nproc, a.steps, [])
        over = run(Path(d) / "overlap", a.nproc, a.steps, ["--rollout.max_staleness=1",
                                                           "--loss.tis_cap=2.0"])
    med = lambda rows, k: statistics.median(r[k] for r in rows[a.warmup:])  # noqa: E731
    gen, tr, sy = med(sync, "time/generate_s"), med(sync, "time/train_s"), med(sync, "time/sync_s")
    out = {"nproc": a.nproc, "steps": a.steps,
           "sync_step_s": round(med(sync, "time/step_s"), 4),
           "overlap_step_s": round(med(over, "time/step_s"), 4),
           "generate_s": round(gen, 4), "train_s": round(tr, 4), "sync_s": round(sy, 4),
           "overlap_ratio": round(med(over, "time/step_s") / (max(gen, tr) + sy), 3),
           "speedup": round(med(sync, "time/step_s") / med(over, "time/step_s"), 3),
           "staleness": max(r["rollout/staleness"] for r in over),
           "reward_last4_sync": round(sum(r["reward/mean"] for r in sync[-4:]) / 4, 3),
           "reward_last4_overlap": round(sum(r["reward/mean"] for r in over[-4:]) / 4, 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
