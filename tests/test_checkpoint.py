"""Checkpoints: exact resume, atomic writes under a kill, HF export, eval-only, local data folder."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.util import ROOT, TINY, env, metrics, torchrun

ARGS = [*TINY, "--run.save_every=2", "--run.eval_every=2", "--run.eval_size=8"]


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def _weights(out_dir, step):
    return load_file(str(out_dir / "checkpoints" / f"step_{step:06d}" / "hf" / "model.safetensors"))


@pytest.mark.slow
def test_exact_resume_2_plus_2_equals_4(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    torchrun(3, [*ARGS, f"--run.out_dir={a}", "--run.steps=4"])
    torchrun(3, [*ARGS, f"--run.out_dir={b}", "--run.steps=2"])
    p = torchrun(3, [*ARGS, f"--run.out_dir={b}", "--run.steps=4"])   # same out_dir: resumes
    assert "resumed from" in p.stdout and "step_000002" in p.stdout
    ra, rb = metrics(a), metrics(b)
    assert [r["step"] for r in rb] == [0, 1, 2, 3]
    assert _strip(ra) == _strip(rb)                  # every non-timing metric, bit for bit
    assert "eval/accuracy" in ra[1] and "eval/accuracy" in ra[3]
    wa, wb = _weights(a, 4), _weights(b, 4)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["lm_head.weight"], _weights(a, 2)["lm_head.weight"])  # it trained

    # The HF export loads with transformers and is evaluated by --eval-only.
    from transformers import Qwen2_5_VLForConditionalGeneration
    Qwen2_5_VLForConditionalGeneration.from_pretrained(str(a / "checkpoints" / "step_000004" / "hf"))
    q = subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, f"--run.out_dir={a}",
                        "--run.eval_size=8", "--eval-only", "--checkpoint",
                        str(a / "checkpoints" / "step_000004")],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert q.returncode == 0, q.stderr[-3000:]
    row = json.loads((a / "eval.jsonl").read_text().splitlines()[-1])
    assert row["eval/n"] == 8 and 0.0 <= row["eval/accuracy"] <= 1.0


@pytest.mark.slow
def test_kill_during_checkpoint_keeps_previous_and_resumes(tmp_path):
    e = env()
    e["GRPO_FAULT"] = "checkpoint_before_rename@4:0"  # trainer rank 0 dies writing step 4
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           str(ROOT / "train.py"), *ARGS, f"--run.out_dir={tmp_path}", "--run.steps=6"]
    p = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    ck = tmp_path / "checkpoints"
    names = sorted(x.name for x in ck.iterdir())
    assert names == ["step_000002", "step_000004.tmp"], names   # previous intact, new one not committed
    q = torchrun(3, [*ARGS, f"--run.out_dir={tmp_path}", "--run.steps=6"])
    assert "resumed from" in q.stdout and "step_000002" in q.stdout
    assert [r["step"] for r in metrics(tmp_path)] == list(range(6))
    assert sorted(x.name for x in ck.iterdir()) == ["step_000004", "step_000006"]  # keep_last=2


@pytest.mark.slow
def test_local_geometry3k_folder_trains(tmp_path):
    """`python data.py --write-synthetic` writes the Geometry3K layout; the trainer reads it."""
    d = tmp_path / "g3k"
    subprocess.run([sys.executable, str(ROOT / "data.py"), "--write-synthetic", str(d),
                    "--n-train", "32", "--n-val", "8", "--n-test", "8"], cwd=ROOT, check=True,
                   env=env(), capture_output=True)
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, f"--data.source={d}",
                        f"--run.out_dir={tmp_path / 'run'}", "--run.steps=2", "--run.keep_last=0",
                        "--data.max_prompt_len=200"],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
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
