"""The loop's shape: the CLI, the one rank split, the engine interface, and a world of one run
end to end in the fast tier (every phase, parity after every sync, a configurable eval reward)."""
from __future__ import annotations

import inspect
import os
import re

import pytest

import config as C
import errors
import hf_engine as HF
import engines
import train
import vllm_engine as V
import world as W
from tests.util import ROOT, TINY, metrics, train_py


def test_help_prints_usage_and_exits_0():
    p = train_py(["--help"], timeout=120)
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


@pytest.mark.parametrize("cls", [HF.HFEngine, V.VLLMEngine])
def test_both_engines_satisfy_the_engine_interface(cls):
    """Each engine has every member of its protocol in episode.py (an engine that receives in
    this process takes buckets handed over, one with its own channel receives ahead), with the
    protocol's `generate` signature."""
    import episode as E
    protocol = E.AheadEngine if cls.OWN_CHANNEL else E.LocalEngine
    members = [n for n in dir(protocol) if not n.startswith("_") and n not in dir(object)]
    assert {"generate", "from_config", "shutdown"} <= set(members)
    for name in members:
        if callable(getattr(protocol, name, None)):
            assert callable(getattr(cls, name)), name
    assert isinstance(cls.OWN_CHANNEL, bool)
    assert engines.engine_class({"hf": "hf", "vllm": "vllm"}["hf" if cls is HF.HFEngine else "vllm"]) is cls
    assert inspect.signature(cls.generate).parameters.keys() == inspect.signature(E.Engine.generate).parameters.keys()


def test_loop_and_sync_do_not_branch_on_the_engine_kind():
    for name in ("train.py", "sync.py", "trainer.py"):
        text = (ROOT / name).read_text()
        assert not re.search(r"isinstance\([^)]*[Ee]ngine|hasattr\([^)]*engine|VLLMEngine|HFEngine",
                             text), name


def test_train_py_stays_the_loop():
    lines = (ROOT / "train.py").read_text().splitlines()
    assert len(lines) <= 460, len(lines)  # the loop, its phases and the start-up; pipeline.py owns running ahead, config.py the command line
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
    p = train_py([*TINY, f"--run.out_dir={tmp_path}", "--run.steps=2", "--sync.verify=true",
                  "--run.eval_every=2", "--run.eval_size=4", "--run.keep_last=0",
                  '--eval.functions=[{name="target_fraction", weight=1.0}]'])
    assert p.returncode == 0, p.stderr[-4000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1] and [r["weight_version"] for r in rows] == [0, 1]
    for r in rows:
        assert r["sync/checksum_ok"] == 1.0 and r["logprob_diff/max"] <= 1e-4 and r["sync/bytes"] > 0
    assert "eval/target_fraction" in rows[1] and "eval/accuracy" not in rows[1]
    assert rows[1]["eval/n"] == 4
    # the step line names the configured reward parts
    assert "target_fraction" in p.stdout and "step 2/2 |" in p.stdout


def test_local_devices_trainers_first_then_engines_of_tp_devices():
    # tensor_parallel_size 1: device = local rank, every layout
    assert [W.local_devices(r, r % 8, 8, 8, 1) for r in range(16)] == [[r % 8] for r in range(16)]
    # one node, 4 trainers + 2 engines of 2 devices: 6 processes on 8 devices
    assert [W.local_devices(r, r, 6, 4, 2) for r in range(6)] == [[0], [1], [2], [3], [4, 5], [6, 7]]
    # node 0: 8 trainers; node 1: 4 engines of 2 devices (torchrun --nproc_per_node 4 there)
    assert [W.local_devices(r, r - 8, 4, 8, 2) for r in range(8, 12)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # a node shared by the last trainers and the first engines (3 trainers, 2 per node)
    assert W.local_devices(2, 0, 2, 3, 2) == [0] and W.local_devices(3, 1, 2, 3, 2) == [1, 2]


def test_rank_plan_draws_tensor_parallel_engines():
    plan = W.rank_plan(6, 2, 6, engine_devices=2)
    assert [r["device"] for r in plan] == ["{dev}:0", "{dev}:1", "{dev}:2", "{dev}:3",
                                          "{dev}:4,5", "{dev}:6,7"]


@pytest.mark.parametrize("rank,engine,check,want,backend", [
    (1, "vllm", False, ("set_device", 1), "cpu:gloo,npu:hccl"),  # a trainer binds its device first
    (3, "vllm", False, ("narrow", [3, 4]), "gloo"),  # a vLLM engine rank only narrows; no HCCL
    (3, "hf", False, ("set_device", 3), "cpu:gloo,npu:hccl"),    # an HF engine computes here
    (3, "vllm", True, ("set_device", 3), "cpu:gloo,npu:hccl"),   # --check-channel: its first device
])
def test_setup_claims_devices_before_the_process_group(monkeypatch, rank, engine, check, want,
                                                       backend):
    from types import SimpleNamespace
    import torch.distributed as dist

    import device as D
    calls = []
    monkeypatch.setattr(D, "torch_device", lambda dev, i: calls.append(("set_device", i)))
    monkeypatch.setattr(D, "narrow_visible", lambda dev, ids: calls.append(("narrow", ids)))
    monkeypatch.setattr(D, "device_count", lambda dev: 8)

    class Stop(Exception):
        pass

    def init(**kw):
        calls.append(("init_process_group", kw["backend"]))
        raise Stop
    monkeypatch.setattr(dist, "init_process_group", init)
    rc = 2 if engine == "vllm" else None  # engine_devices: a vLLM engine's own processes span 2
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "30")
    for k, v in dict(RANK=rank, WORLD_SIZE=4, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=4).items():
        monkeypatch.setenv(k, str(v))
    with pytest.raises(Stop):
        W.setup(1, 60, "cpu:gloo,npu:hccl", D.TABLE["npu"], rc, claim_engine_devices=check)
    assert calls == [want, ("init_process_group", backend)]
    calls.clear()
    with pytest.raises(Stop):  # CPU: nothing to claim
        W.setup(1, 60, "gloo", D.TABLE["cpu"], rc)
    assert calls == [("init_process_group", "gloo")]


def test_setup_refuses_more_devices_than_the_node_has(monkeypatch):
    """8 processes, 4 engines of tensor_parallel_size 2 on an 8-device node would put rank 7 on
    devices 10-11: every rank of that node refuses before claiming anything or starting the
    process group, naming the keys (printed by the node's first rank)."""
    from types import SimpleNamespace
    import torch.distributed as dist

    import config as C
    import device as D
    calls = []
    monkeypatch.setattr(D, "torch_device", lambda dev, i: calls.append(("set_device", i)))
    monkeypatch.setattr(D, "narrow_visible", lambda dev, ids: calls.append(("narrow", ids)))
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append("init"))
    monkeypatch.setattr(D, "device_count", lambda dev: 8)
    rc = 2  # engine_devices: vLLM engines of tensor_parallel_size 2
    for rank in (0, 7):  # a trainer and the engine that would overflow
        for k, v in dict(RANK=rank, WORLD_SIZE=8, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=8,
                         GROUP_RANK=0).items():
            monkeypatch.setenv(k, str(v))
        with pytest.raises(errors.NodeConfigError) as e:
            W.setup(4, 60, "cpu:gloo,cuda:nccl", D.TABLE["cuda"], rc)
        msg = str(e.value)
        for part in ("node 0 (ranks 0-7) needs 12 devices", "4 trainer(s) + 4 engine(s)",
                     "rollout.tensor_parallel_size=2", "has 8 (cuda devices visible here)",
                     "cluster.gen_ranks", "cluster.nproc_per_node"):
            assert part in msg, msg
    assert calls == []
    # the engine node of two: 4 engines of 2 devices (torchrun --nproc_per_node 4 there) fit
    for k, v in dict(RANK=11, WORLD_SIZE=12, LOCAL_RANK=3, LOCAL_WORLD_SIZE=4, GROUP_RANK=1).items():
        monkeypatch.setenv(k, str(v))
    monkeypatch.setattr(dist, "new_group", lambda *a, **kw: None)
    monkeypatch.setattr(dist, "get_rank", lambda: 11)
    W.setup(4, 60, "cpu:gloo,cuda:nccl", D.TABLE["cuda"], rc)
    assert calls == [("narrow", [6, 7]), "init"]


def test_node_devices_needed():
    assert W.node_devices(0, 8, 4, 2) == 12       # 4 trainers + 4 engines x 2
    assert W.node_devices(0, 6, 4, 2) == 8
    assert W.node_devices(8, 4, 8, 2) == 8        # the engine node of 2 x 8 with tp 2
    assert W.node_devices(0, 8, 8, 2) == 8        # a trainer-only node
    assert W.node_devices(0, 1, 1, 1) == 1        # a world of one
    W.check_node_devices(0, 0, 6, 4, 2, 8, "x")
    with pytest.raises(ValueError, match=r"node 0 \(ranks 0-7\) needs 12 devices"):
        W.check_node_devices(0, 0, 8, 4, 2, 8, "cluster.devices_per_node")


def test_setup_on_npu_gives_the_groups_a_timeout_torch_npu_reads_as_set(monkeypatch, capsys):
    """cluster.timeout_s = 1800 (configs/vl3b.toml) is torch-npu's "unset" value: the groups get
    1799 s, HCCL_EXEC_TIMEOUT 90% of that, and rank 0 says so."""
    import datetime
    from types import SimpleNamespace
    import torch.distributed as dist

    import device as D
    got = {}

    class Stop(Exception):
        pass

    def init(**kw):
        got.update(kw)
        raise Stop
    monkeypatch.setattr(D, "torch_device", lambda dev, i: None)
    monkeypatch.setattr(D, "device_count", lambda dev: 8)
    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.delenv("HCCL_EXEC_TIMEOUT", raising=False)
    for k, v in dict(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, LOCAL_WORLD_SIZE=2).items():
        monkeypatch.setenv(k, str(v))
    with pytest.raises(Stop):
        W.setup(1, 1800.0, "cpu:gloo,npu:hccl", D.TABLE["npu"], None)
    assert got["timeout"] == datetime.timedelta(seconds=1799)
    assert os.environ["HCCL_EXEC_TIMEOUT"] == "1619"
    assert "torch-npu's 'unset' value" in capsys.readouterr().out


def test_too_few_devices_on_a_node_is_one_config_error_line_and_exit_2(monkeypatch, capsys):
    """The device-count refusal raised inside world.setup reaches failures.exit_bad_input (one
    `config error:` line from the node's first rank, exit 2), not the world-failed path (a
    traceback and "could not set up the world", exit 4)."""
    import torch.distributed as dist

    import device as D
    monkeypatch.setattr(train, "detect_device", lambda: D.TABLE["cuda"])
    monkeypatch.setattr(D, "device_count", lambda dev: 8)
    monkeypatch.setattr(D, "torch_device", lambda dev, i: pytest.fail("claimed a device"))
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: pytest.fail("started the group"))
    for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in dict(RANK=0, WORLD_SIZE=8, LOCAL_RANK=0, LOCAL_WORLD_SIZE=8, GROUP_RANK=0).items():
        monkeypatch.setenv(k, str(v))
    code = train.main([*TINY, "--cluster.gen_ranks=4", "--rollout.engine=vllm",
                       "--rollout.tensor_parallel_size=2"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("config error: node 0 (ranks 0-7) needs 12 "), err
    assert "cluster.gen_ranks" in lines[0] and "rollout.tensor_parallel_size=2" in lines[0], err
    assert "Traceback" not in err and "could not set up the world" not in err


def test_split_roles_per_node_puts_trainers_first_on_every_node():
    """cluster.layout = "per_node" (ROLL's second layout): gen_ranks spread evenly over the
    nodes, each node's last ranks generating; uneven spreads are one line naming the keys."""
    assert W.split_roles(16, 8, "per_node", 2) == ((0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15))
    assert W.split_roles(6, 2, "per_node", 2) == ((0, 1, 3, 4), (2, 5))
    assert W.split_roles(6, 2, "by_node", 2) == ((0, 1, 2, 3), (4, 5))
    assert W.split_roles(4, 1, "per_node", 1) == W.split_roles(4, 1)   # one node: the same split
    with pytest.raises(ValueError, match=r"cluster.layout = \"per_node\": cluster.gen_ranks=3 over 2 nodes"):
        W.split_roles(8, 3, "per_node", 2)
    with pytest.raises(ValueError, match="cluster.layout must be one of"):
        W.split_roles(4, 1, "interleaved")
    # devices: each node's trainers first (device = local rank), then its engines
    trainers, _ = W.split_roles(16, 8, "per_node", 2)
    assert [W.local_devices(r, r % 8, 8, trainers, 1) for r in range(16)] == [[r % 8] for r in range(16)]
    trainers, _ = W.split_roles(12, 4, "per_node", 2)   # 4 trainers + 2 engines of tp 2 per node
    assert [W.local_devices(r, r % 6, 6, trainers, 2) for r in range(6, 12)] == [[0], [1], [2], [3], [4, 5], [6, 7]]
    assert W.node_devices(6, 6, trainers, 2) == 8
    import tracking  # the start-up summary names interleaved roles by runs
    assert (tracking._runs([0, 1, 3, 4]), tracking._runs([2, 5]), tracking._runs([0, 1, 2])) == ("0-1,3-4", "2,5", "0-2")


def test_dry_run_draws_the_per_node_plan_on_npu(monkeypatch, capsys):
    """`--cluster.layout=per_node` with GRPO_DEVICE=npu draws 2 x (4 trainers + 4 engines): the
    FSDP2 mesh and the sync group built from that split."""
    import json
    monkeypatch.setenv("GRPO_DEVICE", "npu")
    cfg = str(ROOT / "configs" / "vl3b.toml")
    assert train.main(["--config", cfg, "--cluster.layout=per_node", "--dry-run"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    plan, groups = rows[:-1], rows[-1]["groups"]
    assert [(r["node"], r["role"]) for r in plan] == (
        [(0, "trainer")] * 4 + [(0, "generation")] * 4 + [(1, "trainer")] * 4 + [(1, "generation")] * 4)
    assert [r["device"] for r in plan] == [f"npu:{i}" for i in range(8)] * 2
    assert groups["trainers (FSDP2 mesh)"] == [0, 1, 2, 3, 8, 9, 10, 11]
    assert groups["sync (trainer 0 + engines)"] == [0, 4, 5, 6, 7, 12, 13, 14, 15]
    assert train.main(["--config", cfg, "--cluster.layout=per_node", "--cluster.gen_ranks=5",
                       "--rollout.prompts_per_step=10", "--dry-run"]) == 2
    assert "not an even spread" in capsys.readouterr().err


def test_per_node_refuses_nodes_of_different_sizes(monkeypatch):
    """A node whose process count differs from the others' would shift every role of the
    "per_node" split: that node refuses before any process group exists."""
    import device as D
    from errors import NodeConfigError
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    with pytest.raises(NodeConfigError, match="needs the same processes on every node: this node runs 4"):
        W.setup(2, 60, "gloo", D.TABLE["cpu"], layout="per_node")
