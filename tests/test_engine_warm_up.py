"""The engines' warm-up before step 1 (engines.warm_up): one request of the run's sampling through
the engine's own `generate`, timed in the start-up summary, moving no random stream of the run.
(On vLLM: tests/test_vllm_e2e.py::test_vllm_warm_up_makes_the_first_step_a_step.)"""
from __future__ import annotations

import dataclasses
import random
import re
from types import SimpleNamespace

import torch
import torch.distributed as dist

import engines
import hf_engine as HF
import inputs as I
import rollout
import train
import world as W
from device import detect
from tests.util import TINY, metrics, train_py


class Recording(HF.HFEngine):
    """The HF engine, every generate call recorded (rows, sampling, seed) before it runs."""
    calls: list = []

    def generate(self, rows, sp, seed, check=None):
        Recording.calls.append((rows, sp, seed))
        return super().generate(rows, sp, seed, check)


def test_start_warms_the_engine_once_with_the_runs_sampling_and_moves_no_rng(tiny_dir, monkeypatch):
    """engines.start on a world of one: exactly one generate call, before start returns (so
    before the loop's first step), of the run's sampling (its samples, temperature, top_p,
    top_k) for WARM_UP_TOKENS new tokens, on the first problem's prompt with its image as the
    rollout builds it; the CPU's generator and Python's are where they were; the line says it."""
    over = ["--data.n_synthetic=8", "--rollout.group_size=3", "--rollout.temperature=0.7",
            "--rollout.top_p=0.9", "--rollout.top_k=5", f"--model.path={tiny_dir()}"]
    cfg = train.load_config(TINY[1], over)
    procs = I.processors(cfg.model.path, cfg.model, cfg.data, cfg.rollout)
    problems, _ = train.load_problems(cfg, "train", procs)
    monkeypatch.setattr(engines, "engine_class", lambda name: Recording)
    monkeypatch.setattr(Recording, "calls", [])
    world = W.World(rank=0, size=1, local_rank=0, trainers=(0,), gens=(0,))
    live = SimpleNamespace(store=dist.HashStore(), ns="warm", world=1, phase=lambda *a: None)
    torch.manual_seed(123)
    random.seed(5)
    cpu, py = torch.get_rng_state(), random.getstate()
    engine, turns, line = engines.start(cfg, world, detect(), torch.device("cpu"), live, cfg.model.path,
                                        procs, problems, rollout.sampling(cfg.rollout))
    assert torch.equal(torch.get_rng_state(), cpu) and random.getstate() == py
    assert isinstance(engine, Recording) and turns is None
    assert len(Recording.calls) == 1
    rows, sp, _ = Recording.calls[0]
    want = dataclasses.replace(rollout.sampling(cfg.rollout), max_new_tokens=engines.WARM_UP_TOKENS)
    assert sp == want and (sp.n, sp.temperature, sp.top_p, sp.top_k) == (3, 0.7, 0.9, 5)
    assert engines.WARM_UP_TOKENS < cfg.rollout.max_new_tokens
    first = problems[0]
    assert first.images and rows == rollout.engine_prompts([first], procs, cfg.data.template)
    assert re.fullmatch(r"engine warm-up: \d+\.\d\d s \(one request: a prompt "
                        r"with 1 image, 3 samples at temperature 0\.7, top_p 0\.9, top_k 5, 4 new "
                        r"tokens; the slowest of 1 engine\)", line), line


def test_the_warm_up_line_is_in_the_start_up_summary_before_step_1(tmp_path):
    """A world of one on the demo: the warm-up's line once, in the start-up summary (before
    step 1's line); the run's metrics count nothing of it (step 0 sampled G x prompts rows)."""
    p = train_py([*TINY, f"--run.out_dir={tmp_path}", "--run.steps=1", "--run.keep_last=0"])
    assert p.returncode == 0, p.stderr[-4000:]
    lines = p.stdout.splitlines()
    warm = [i for i, line in enumerate(lines) if line.startswith("   engine warm-up: ")]
    step1 = [i for i, line in enumerate(lines) if line.startswith("step 1/1 ")]
    assert len(warm) == 1 and len(step1) == 1 and warm[0] < step1[0], p.stdout[-3000:]
    assert "4 samples at temperature 1, top_p 1, top_k 0, 4 new tokens" in lines[warm[0]]
    (row,) = metrics(tmp_path)
    assert row["rollout/prompts_drawn"] == 4  # the step's prompts; the warm-up's is not one
