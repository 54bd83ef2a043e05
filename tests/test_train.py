"""The loop's shape: the CLI, the one rank split, the engine interface, and a world of one run
end to end in the fast tier (every phase, parity after every sync, a configurable eval reward)."""
from __future__ import annotations

import inspect
import re
import subprocess
import sys

import pytest

import config as C
import rollout as R
import train
import vllm_engine as V
import world as W
from tests.util import ROOT, TINY, env, metrics


def test_help_prints_usage_and_exits_0():
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), "--help"], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    for flag in ("--config", "--section.key=value", "--dry-run", "--resume", "--eval-only", "config.py"):
        assert flag in p.stdout
    assert train.main(["-h"]) == 0


@pytest.mark.parametrize("size, gens, trainers, generation", [
    (1, 1, (0,), (0,)), (1, 5, (0,), (0,)), (3, 1, (0, 1), (2,)), (16, 8, tuple(range(8)), tuple(range(8, 16))),
])
def test_split_roles(size, gens, trainers, generation):
    assert W.split_roles(size, gens) == (trainers, generation)


def test_split_roles_refuses_no_trainer():
    with pytest.raises(ValueError, match="cluster.gen_ranks=3 leaves no trainer rank in a world of 3"):
        W.split_roles(3, 3)
    with pytest.raises(ValueError, match="cluster.gen_ranks must be >= 1"):
        W.split_roles(3, 0)


def test_world_record_roles():
    w = W.World(rank=2, size=4, local_rank=2, trainers=(0, 1), gens=(2, 3))
    assert (w.is_trainer, w.is_gen, w.gen_index, w.trainer_index, w.is_root) == (False, True, 0, -1, False)
    assert [w.role(r) for r in range(4)] == ["trainer", "trainer", "generation", "generation"]
    one = W.World(rank=0, size=1, local_rank=0, trainers=(0,), gens=(0,))
    assert one.role() == "trainer+generation" and one.gen_index == 0 and one.trainer_index == 0
    with pytest.raises(AttributeError):
        w.rank = 3  # frozen: built once


def test_rank_plan_uses_the_one_split():
    plan = W.rank_plan(4, 1, 2)
    assert [r["role"] for r in plan] == ["trainer"] * 3 + ["generation"]
    assert [(r["node"], r["local_rank"]) for r in plan] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("cls", [R.HFEngine, V.VLLMEngine])
def test_both_engines_satisfy_the_engine_interface(cls):
    for name in ("generate", "receive_weights", "load_weights", "shutdown", "from_config"):
        assert callable(getattr(cls, name)), name
    assert isinstance(cls.OWN_CHANNEL, bool)
    assert R.engine_class({"hf": "hf", "vllm": "vllm"}["hf" if cls is R.HFEngine else "vllm"]) is cls
    sig = inspect.signature(cls.generate)
    assert list(sig.parameters) == ["self", "prompts", "sp", "seed"]


def test_loop_and_sync_do_not_branch_on_the_engine_kind():
    for name in ("train.py", "sync.py", "trainer.py"):
        text = (ROOT / name).read_text()
        assert not re.search(r"isinstance\([^)]*[Ee]ngine|hasattr\([^)]*engine|VLLMEngine|HFEngine",
                             text), name


def test_train_py_stays_the_loop():
    lines = (ROOT / "train.py").read_text().splitlines()
    assert len(lines) <= 480, len(lines)
    # no function longer than about 60 lines
    src = (ROOT / "train.py").read_text()
    tree = __import__("ast").parse(src)
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in tree.body
            if isinstance(n, __import__("ast").FunctionDef) and n.end_lineno - n.lineno + 1 > 62]
    assert not long, long


def test_config_validates_against_loss_lists():
    assert C.load(TINY[1], ["--loss.kl_estimator=k2"]).loss.kl_estimator == "k2"
    with pytest.raises(C.ConfigError, match="loss.kl_estimator.*known: k1, k2, k3"):
        C.load(TINY[1], ["--loss.kl_estimator=k4"])


def test_world_of_one_every_phase_parity_and_eval_reward(tmp_path):
    """A world of one (trainer + HF engine in one process): bitwise weights and logprob parity
    after every sync, and evaluation graded by the configured [eval] reward."""
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, f"--run.out_dir={tmp_path}",
                        "--run.steps=2", "--sync.verify=true", "--run.eval_every=2",
                        "--run.eval_size=4", "--run.keep_last=0",
                        '--eval.functions=[{name="target_fraction", weight=1.0}]'],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1] and [r["weight_version"] for r in rows] == [0, 1]
    for r in rows:
        assert r["sync/checksum_ok"] == 1.0 and r["logprob_diff/max"] <= 1e-4 and r["sync/bytes"] > 0
    assert "eval/target_fraction" in rows[1] and "eval/accuracy" not in rows[1]
    assert rows[1]["eval/n"] == 4
    # the step line names the configured reward parts
    assert "target_fraction" in p.stdout and "step 2/2 |" in p.stdout
