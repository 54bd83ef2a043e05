"""The device table, and that device differences stay in device.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import device as D
from tests.util import ROOT


def test_table_rows():
    assert D.TABLE["cpu"] == D.Device("cpu", "gloo", None, "gloo", fan_out=True, vllm_workers="fork",
                                      vllm_eager_helpers=True, vllm_cpu_moe_fix=True,
                                      vllm_linear_attention=False, vllm_routed_experts=False,
                                      vllm_chunked_prefill=False, vllm_sleep_mode=False)
    # vLLM's CPU build dies on a seeded request's chunked prefill; GPU and NPU keep vLLM's default
    assert [D.vllm_engine_args(d) for d in D.TABLE.values()] == [{"enable_chunked_prefill": False}, {}, {}]
    assert D.TABLE["cpu"].packed_attention == "segments" and D.TABLE["cpu"].auto_packing == "always"
    assert D.TABLE["cpu"].bucket_ratio == 1.25
    assert D.TABLE["cuda"] == D.Device("cuda", "cpu:gloo,cuda:nccl", "CUDA_VISIBLE_DEVICES", "pynccl",
                                       auto_packing="rows", bucket_ratio=4.0, varlen_fp32=False, adamw="fused",
                                       weight_transfer=("nccl", "vllm.distributed.weight_transfer.nccl_engine",
                                                        "NCCLWeightTransferEngine"))
    assert D.TABLE["cuda"].packed_attention == "segments"
    assert D.TABLE["npu"] == D.Device("npu", "cpu:gloo,npu:hccl", "ASCEND_RT_VISIBLE_DEVICES", "pyhccl",
                                      experts="eager", packed_attention="varlen", auto_packing="never",
                                      varlen_package=None, varlen_max_seqs=1024, adamw="fused",
                                      weight_transfer=("hccl", "vllm_ascend.distributed.weight_transfer.hccl_engine",
                                                       "HCCLWeightTransferEngine"))
    assert D.TABLE["cpu"].adamw == "foreach"
    # weight buckets: point to point only where the device's tensors travel over gloo
    assert [k for k, d in D.TABLE.items() if d.fan_out] == ["cpu"]


def test_detect_on_this_machine_and_forced(monkeypatch):
    monkeypatch.setenv("GRPO_DEVICE", "npu")
    assert D.detect().kind == "npu"
    monkeypatch.delenv("GRPO_DEVICE")
    assert D.detect().kind == "cpu"  # no accelerator here; torch_npu absent


def test_narrow_visible(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    D.narrow_visible(D.TABLE["cuda"], [2])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    D.narrow_visible(D.TABLE["cuda"], [2, 3])  # a tensor-parallel engine: two devices
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    with pytest.raises(ValueError, match=r"CUDA_VISIBLE_DEVICES=4,5,6: this rank needs devices \[2, 3\]"):
        D.narrow_visible(D.TABLE["cuda"], [2, 3])
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    D.narrow_visible(D.TABLE["npu"], [3])
    assert os.environ["ASCEND_RT_VISIBLE_DEVICES"] == "3"
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES")
    D.narrow_visible(D.TABLE["cpu"], [5])  # CPU: nothing to narrow
    assert "ASCEND_RT_VISIBLE_DEVICES" not in os.environ


def test_hccl_env_against_the_watchdog():
    """HCCL_EXEC_TIMEOUT and HCCL_CONNECT_TIMEOUT must stay below cluster.timeout_s (torch-npu's
    watchdog): derived when unset, refused when set at or above it; AIV expansion mode is refused
    for training."""
    both = lambda v: {"HCCL_EXEC_TIMEOUT": v, "HCCL_CONNECT_TIMEOUT": v}  # noqa: E731
    assert D.hccl_env(2000.0, {}) == both("1800")
    assert D.hccl_env(1800.0, {}) == both("1619")  # 90% of 1799 (below)
    assert D.hccl_env(1800.0, both("1740")) == {}
    assert D.hccl_env(1800.0, {"HCCL_EXEC_TIMEOUT": "1740"}) == {"HCCL_CONNECT_TIMEOUT": "1619"}
    for name in ("HCCL_EXEC_TIMEOUT", "HCCL_CONNECT_TIMEOUT"):
        for bad in ("2000", "3600", "0", "abc"):
            with pytest.raises(ValueError, match=f"{name}={bad} must be in .*cluster.timeout_s=2000"):
                D.hccl_env(2000.0, {name: bad})
        with pytest.raises(ValueError, match=rf"{name}=1799 must be in \[1, cluster.timeout_s=1800\) "
                                             r"\(used as 1799 s\)"):
            D.hccl_env(1800.0, {name: "1799"})
    with pytest.raises(ValueError, match="HCCL_OP_EXPANSION_MODE=AIV"):
        D.hccl_env(1800.0, {"HCCL_OP_EXPANSION_MODE": "AIV", "HCCL_EXEC_TIMEOUT": "100"})
    assert D.hccl_env(2000.0, {"HCCL_OP_EXPANSION_MODE": "HOST"}) == both("1800")


def test_hccl_connect_timeout_is_not_a_fixed_default_of_npu_env(tmp_path):
    """launch/npu_env.sh leaves HCCL_CONNECT_TIMEOUT to device.hccl_env (a fixed 1800 there would
    be refused against the tiny config's cluster.timeout_s = 300) and sets the trainers'
    TASK_QUEUE_ENABLE=2 / CPU_AFFINITY_CONF=1, which the engines' processes take back
    (device.vllm_spawn_env)."""
    import subprocess
    script = (f"source {ROOT / 'launch' / 'npu_env.sh'}; "
              'echo "${HCCL_CONNECT_TIMEOUT-unset} $TASK_QUEUE_ENABLE $CPU_AFFINITY_CONF"')
    env = {k: v for k, v in os.environ.items()
           if k not in ("HCCL_CONNECT_TIMEOUT", "TASK_QUEUE_ENABLE", "CPU_AFFINITY_CONF")}
    out = subprocess.run(["bash", "-c", script], env={**env, "HOME": str(tmp_path)},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["unset", "2", "1"]
    assert D.vllm_spawn_env(D.TABLE["npu"], {})["TASK_QUEUE_ENABLE"] == "1"
    assert D.vllm_spawn_env(D.TABLE["npu"], {})["CPU_AFFINITY_CONF"] == "0"
    assert "TASK_QUEUE_ENABLE" not in D.vllm_spawn_env(D.TABLE["cuda"], {})


def test_varlen_in_fp32_is_refused_where_the_kernel_takes_half_precision_only():
    """C1: flash-attn refuses fp32 (the CUDA row); npu_fusion_attention takes it; "segments" and
    padded rows never reach a varlen kernel."""
    line = D.packing_refusal("cuda", "varlen", mixed_precision=False)
    assert "train.packing" in line and "model.mixed_precision" in line and "\n" not in line
    assert D.packing_refusal("cuda", "varlen", mixed_precision=True) == ""
    for packing in (True, "auto", "segments", False):  # CUDA's packed layout is "segments"
        assert D.packing_refusal("cuda", packing, mixed_precision=False) == ""
    for packing in (True, "varlen"):
        assert D.packing_refusal("npu", packing, mixed_precision=False) == ""
        assert D.packing_refusal("cpu", packing, mixed_precision=False) == ""


def test_varlen_fp32_is_one_config_error_at_start_and_in_a_dry_run(monkeypatch, capsys):
    import config as C
    import train
    import world as W
    from errors import ConfigError
    cfg = C.load(None, ["--train.packing=varlen"])
    with pytest.raises(ConfigError, match="train.packing.*model.mixed_precision"):
        W.validate_world(cfg, 1, "cuda")
    W.validate_world(cfg, 1, "cpu")
    monkeypatch.setenv("GRPO_DEVICE", "cuda")
    assert train.main(["--train.packing=varlen", "--cluster.nproc_per_node=3", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "config error: train.packing = 'varlen'" in err and "model.mixed_precision" in err
    assert train.main(["--train.packing=varlen", "--model.mixed_precision=true", "--dry-run"]) == 0


def test_engines_run_vllms_v1_model_runner_unless_told():
    """A1: vLLM 0.23 would run a dense Qwen3 on its V2 model runner on GPU; the engine's processes
    get VLLM_USE_V2_MODEL_RUNNER=0 on every device unless the variable is set."""
    for kind in ("cpu", "cuda", "npu"):
        assert D.vllm_spawn_env(D.TABLE[kind], {})["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in D.vllm_spawn_env(D.TABLE["cuda"], {"VLLM_USE_V2_MODEL_RUNNER": "1"})


def test_vision_chunks_keep_each_call_under_the_limit():
    """V1: images in order, runs of at most `limit` sequences (an image over it alone)."""
    assert D.TABLE["npu"].varlen_max_seqs == 1024 and D.TABLE["cuda"].varlen_max_seqs is None
    assert D.vision_chunks([84] * 16, None) == [range(16)]
    assert D.vision_chunks([], 1024) == []
    runs = D.vision_chunks([84] * 16, 1024)
    assert runs == [range(0, 12), range(12, 16)]
    assert D.vision_chunks([5, 2000, 5, 5], 10) == [range(0, 1), range(1, 2), range(2, 4)]
    import random
    rng = random.Random(0)
    for _ in range(200):
        seqs, limit = [rng.randint(1, 50) for _ in range(rng.randint(1, 40))], rng.randint(1, 120)
        runs = D.vision_chunks(seqs, limit)
        assert [i for r in runs for i in r] == list(range(len(seqs)))
        assert all(len(r) == 1 or sum(seqs[i] for i in r) <= limit for r in runs)
        # greedy: no run could take the next image
        assert all(sum(seqs[i] for i in a) + seqs[b[0]] > limit for a, b in zip(runs, runs[1:]))


def test_group_timeout_avoids_torch_npus_unset_sentinel():
    """torch-npu takes a process-group timeout of exactly 1,800,000 ms as "unset" and then waits
    HCCL_EXEC_TIMEOUT + 1800 s: on NPU that value becomes 1799 s, with a line saying why; every
    other value, and every value on CPU/CUDA, is kept."""
    assert D.HCCL_UNSET_TIMEOUT_MS == 1_800_000
    for t in (1800.0, 1800, 1800.0004):  # timedelta keeps microseconds, torch-npu milliseconds
        got, note = D.group_timeout("npu", t)
        assert got == 1799.0 and "torch-npu's 'unset' value" in note and "1799 s" in note
    for t in (1799.999, 1800.001, 300.0, 3600.0):
        assert D.group_timeout("npu", t) == (t, "")
    for kind in ("cpu", "cuda"):
        assert D.group_timeout(kind, 1800.0) == (1800.0, "")
    assert D.hccl_env(1800.0, {}) == D.hccl_env(1799.0, {})  # HCCL_EXEC_TIMEOUT below what runs


def test_world_backend_gloo_where_the_process_never_uses_its_device():
    for kind in ("cpu", "cuda", "npu"):
        assert D.world_backend(D.TABLE[kind], uses_device=True) == D.TABLE[kind].backend
        assert D.world_backend(D.TABLE[kind], uses_device=False) == "gloo"


def test_fork_rng_names_the_device_type(monkeypatch):
    """On an NPU the HF engine's generator fork goes to torch.npu's generators, never to CUDA's
    (torch's default device type: "cuda" before 2.13); the states are restored afterwards."""
    import torch
    calls = []

    class FakeNPU:
        @staticmethod
        def get_rng_state(device):
            calls.append(("get", str(device)))
            return torch.zeros(1)

        @staticmethod
        def set_rng_state(state, device):
            calls.append(("set", str(device)))

        @staticmethod
        def device_count():
            return 8

    real = torch.get_device_module

    def get_device_module(kind=None):
        if kind == "cuda":
            raise AssertionError("Torch not compiled with CUDA enabled")
        return FakeNPU if kind == "npu" else real(kind)
    monkeypatch.setattr(torch, "get_device_module", get_device_module)
    class NPU3:  # torch.device("npu", 3) parses only once torch_npu renamed privateuse1
        type = "npu"

        def __str__(self):
            return "npu:3"
    before = torch.get_rng_state()
    with D.fork_rng(NPU3()):
        torch.manual_seed(123)
        torch.rand(3)
    assert calls == [("get", "npu:3"), ("set", "npu:3")]
    assert torch.equal(torch.get_rng_state(), before)
    calls.clear()
    with D.fork_rng(torch.device("cpu")):  # CPU: only the CPU generator
        torch.manual_seed(5)
    assert calls == [] and torch.equal(torch.get_rng_state(), before)


def test_no_accelerator_calls_outside_device_py():
    """Device-dependent calls (accelerator modules, RNG forks, streams and events, device
    modules, memory statistics) go through device.py."""
    pattern = (r"torch\.(cuda|npu|xpu|mps|accelerator)\.|import torch_npu|random\.fork_rng|"
               r"torch\.(Stream|Event)\(|get_device_module|max_memory_|memory_allocated|"
               r"mem_get_info|empty_cache|set_device\(")
    out = subprocess.run(["git", "grep", "-n", "-E", pattern, "--", "*.py", ":!device.py",
                          ":!tests/*", ":!bench/*"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode in (0, 1), out.stderr
    assert out.stdout == "", out.stdout
    # the pattern finds what it is for
    probe = subprocess.run(["git", "grep", "-c", "-E", pattern, "--", "device.py"], cwd=ROOT,
                           capture_output=True, text=True)
    assert int(probe.stdout.strip().rpartition(":")[2] or 0) >= 10, probe.stdout


def test_accelerator_packages_are_not_imported_at_module_level():
    code = ("import sys, train, rollout, sync, model, device, data, loss, config, trainer, world, "
            "failures, vllm_engine, synthetic, checkpoint; "
            "bad = [m for m in ('vllm', 'vllm_ascend', 'torch_npu') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_every_collective_names_its_group():
    """Ranks may join the world with different backends (device.world_backend: gloo alone where
    the process never touches its device), so no collective may run on the world group by
    default: `dist.barrier()` there would pick NCCL/HCCL on some ranks and gloo on others."""
    import ast
    collectives = {"barrier", "all_reduce", "broadcast", "all_gather", "all_gather_object",
                   "broadcast_object_list", "gather_object", "scatter_object_list", "reduce",
                   "reduce_scatter", "all_gather_into_tensor", "reduce_scatter_tensor",
                   "all_to_all", "monitored_barrier", "gather", "scatter"}
    files = subprocess.run(["git", "ls-files", "*.py", ":!tests/*", ":!bench/*"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    unnamed, seen = [], 0
    for f in files:
        for node in ast.walk(ast.parse((ROOT / f).read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "dist"
                    and node.func.attr in collectives):
                seen += 1
                if not any(k.arg == "group" for k in node.keywords):
                    unnamed.append(f"{f}:{node.lineno} dist.{node.func.attr}")
    assert seen >= 20 and not unnamed, unnamed


MIXED_WORLD = r'''
import json, os, sys
sys.path.insert(0, sys.argv[1])
from types import SimpleNamespace
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeProcessGroup
import device as D, world as W

built = []  # the groups this process built a device backend for (torch-npu: ProcessGroupHCCL)
def creator(opts, pg_options):
    built.append(opts.group_id)
    return FakeProcessGroup._create_internal(opts.group_rank, opts.group_size)
dist.Backend.register_backend("fakeacc", creator, extended_api=True, devices=["cuda"])
dev = D.Device("cuda", "cpu:gloo,cuda:fakeacc", "CUDA_VISIBLE_DEVICES", "pynccl")
D.torch_device = lambda dev, i: None          # no device to claim here
D.device_count = lambda dev: 8
world = W.setup(1, 60, dev.backend, dev, engine_devices=1)
got = [None] * world.size
dist.all_gather_object(got, world.rank, group=world.ctrl)
ctrl = torch.tensor([7 if world.is_root else 0])
if world.is_root or world.is_gen:
    dist.broadcast(ctrl, 0, group=world.sync_group)
    box = [{"plan": 1} if world.is_root else None]
    dist.broadcast_object_list(box, 0, group=world.sync_group)
if world.is_trainer:
    x = torch.ones(1)
    dist.all_reduce(x, group=world.train_group)
dist.barrier(group=world.ctrl)
with open(f"rank{world.rank}.json", "w") as f:  # ranks share stdout: one file each
    json.dump({"rank": world.rank, "built": built, "gathered": got, "ctrl": int(ctrl),
               "backend": dist.get_backend_config()}, f)
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_world_with_gloo_only_engine_ranks_is_legal(tmp_path):
    """3 ranks under torchrun: two trainers with a device backend (a stand-in for HCCL, registered
    for "cuda"), one vLLM generation rank with gloo alone. Every group is created on every rank
    and works; the generation rank builds no device backend, the trainers build theirs for the
    world and their own group only (the sync group is gloo)."""
    import json
    import sys

    from tests.util import env
    script = tmp_path / "mixed.py"
    script.write_text(MIXED_WORLD)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=3", str(script), str(ROOT)], cwd=tmp_path, env=env(),
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [r["rank"] for r in rows] == [0, 1, 2]
    assert all(r["gathered"] == [0, 1, 2] for r in rows)
    assert rows[0]["ctrl"] == rows[2]["ctrl"] == 7
    assert rows[2]["built"] == [] and rows[2]["backend"] == "cpu:gloo,cuda:gloo"
    assert rows[0]["built"] == rows[1]["built"] and len(rows[0]["built"]) == 2  # world + trainers
    assert "fakeacc" in rows[0]["backend"]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3"])
def test_experts_implementation_follows_the_device_row(tmp_path, model_type):
    """NPU runs transformers' "eager" experts loop (device.Device.experts: torch-npu has no
    grouped_mm kernel); CPU and CUDA keep transformers' default. A dense model takes the
    argument and ignores it. Built on the meta device: the row is asked by device type only."""
    import families as F
    import model as M
    path = str(F.build_tiny(tmp_path / model_type, model_type=model_type))
    npu = M.model_from_config(path, meta=True, device_type="npu")
    cpu = M.model_from_config(path, meta=True)
    assert M._kernels("npu") == {"experts_implementation": "eager"}
    assert M._kernels("cuda") == {} == M._kernels("cpu")
    if model_type.endswith("moe"):
        assert npu.config._experts_implementation == "eager"
        assert cpu.config._experts_implementation != "eager"


def test_staging_memory_line_counts_the_copy_and_refuses_where_it_cannot_fit():
    """A2: without partial rollouts an engine running ahead stages a full copy of what a sync
    sends, outside gpu_memory_utilization: the start-up line says how much, and a device whose
    slack cannot hold it is refused (the 3B in bf16 on a 64 GiB NPU at vl3b's 0.9)."""
    import config as C
    ro = C.RolloutConfig(engine="vllm", max_staleness=2, gpu_memory_utilization=0.9)
    n3b = 3_754_622_976  # about Qwen2.5-VL-3B's (docs/vllm.md: 7.5 GB in bf16)
    line, fits = D.staging_memory(ro, "bfloat16", n3b, 64 * 2**30)
    assert not fits and "\n" not in line
    assert "staging a received version holds 7.0 GiB (3.75 B parameters in bfloat16" in line
    assert "leaves 6.4 GiB of each 64 GiB device" in line
    assert "rollout.gpu_memory_utilization to 0.89 or less" in line and "rollout.partial = true" in line
    line, fits = D.staging_memory(C.RolloutConfig(engine="vllm", max_staleness=2, gpu_memory_utilization=0.85),
                                  "bfloat16", n3b, 64 * 2**30)
    assert fits and "leaves 9.6 GiB" in line
    assert D.staging_memory(ro, "float32", 1000, 0) == (
        D.staging_memory(ro, "float32", 1000, 0)[0], True)           # CPU: said, not checked
    assert "not checked" in D.staging_memory(ro, "float32", 1000, 0)[0]
    # nothing is staged: partial rollouts load at once; k = 1 "wait" receives between batches
    import pipeline
    assert pipeline.stages_received(ro)
    for kw in (dict(partial=True), dict(max_staleness=1), dict(max_staleness=0), dict(engine="hf")):
        assert not pipeline.stages_received(C.RolloutConfig(**{**dict(engine="vllm", max_staleness=2), **kw})), kw
    assert pipeline.stages_received(C.RolloutConfig(engine="vllm", max_staleness=1, stale="drop"))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_chunked_vision_tower_equals_one_call(tiny_dir, family):
    """V1: the vision tower run in runs of at most `limit` sequences (windows, or frames) gives
    one call's features and gradients; the tiny model's tower, three images of other sizes."""
    import torch

    import model as M
    grid = torch.tensor([[1, 8, 8], [1, 4, 8], [1, 8, 4]])
    outs = []
    path = tiny_dir(family)  # built first: building draws random numbers
    for limit in (None, 2):
        torch.manual_seed(0)  # the same random tower twice
        m = M.model_from_config(path)
        visual = m.model.visual
        assert D.chunk_vision(m, limit) is (limit is not None)
        vc = visual.config
        width = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        x = torch.randn(int(grid.prod(-1).sum()), width, generator=torch.Generator().manual_seed(1))
        calls = []
        visual.blocks[0].register_forward_hook(lambda *a: calls.append(1))
        out = visual(x, grid_thw=grid)
        out.pooler_output.sum().backward()
        grads = torch.cat([p.grad.flatten() for p in visual.blocks[0].parameters()])
        outs.append((out.pooler_output, grads, len(calls)))
    (one, g_one, n_one), (chunked, g_chunked, n_chunked) = outs
    assert n_one == 1 and n_chunked > 1                       # really split
    torch.testing.assert_close(chunked, one)
    torch.testing.assert_close(g_chunked, g_one)


def test_chunked_vision_tower_under_fsdp2_equals_one_call(tiny_dir):
    """The chunked tower calls each FSDP2 vision block once per run: the same features and
    gradients as one unsharded call (a gloo world of one)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import model as M
    import sharding
    from world import free_port
    path, grid = tiny_dir("qwen2_5_vl"), torch.tensor([[1, 8, 8], [1, 4, 8], [1, 8, 4]])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        outs = []
        for limit in (None, 2):
            torch.manual_seed(0)
            m = M.model_from_config(path)
            D.chunk_vision(m, limit)
            if limit:  # the root's own weights (the patch embedding) gathered as its forward would
                sharding.apply_fsdp(m, DeviceMesh.from_group(dist.group.WORLD, "cpu")).unshard()
            vc = m.model.visual.config
            x = torch.randn(int(grid.prod(-1).sum()), vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2,
                            generator=torch.Generator().manual_seed(1))
            out = m.model.visual(x, grid_thw=grid).pooler_output
            out.sum().backward()
            g = m.model.visual.blocks[0].mlp.down_proj.weight.grad
            outs.append((out.detach(), g.full_tensor() if hasattr(g, "full_tensor") else g))
        torch.testing.assert_close(outs[1][0], outs[0][0])
        torch.testing.assert_close(outs[1][1], outs[0][1])
    finally:
        dist.destroy_process_group()


def test_the_staging_line_at_start_and_its_refusal(tiny_dir, monkeypatch):
    """pipeline.staging_memory_line, as set_up calls it on trainer rank 0 of a world of one: the
    tiny model's figure on CPU (not checked), and a ConfigError where the copy cannot fit."""
    from types import SimpleNamespace

    import torch

    import config as C
    import pipeline
    from errors import ConfigError
    cfg = C.load(None, ["--rollout.engine=vllm", "--rollout.max_staleness=2", "--loss.tis_cap=2"])
    one = SimpleNamespace(rank=0, size=1)
    line = pipeline.staging_memory_line(cfg, one, D.TABLE["cpu"], torch.device("cpu"), tiny_dir())
    assert line.startswith("engine memory: staging a received version holds") and "not checked" in line
    monkeypatch.setattr(D, "total_memory", lambda dev, device: 1000)  # a device smaller than the copy
    with pytest.raises(ConfigError, match="does not fit; lower rollout.gpu_memory_utilization"):
        pipeline.staging_memory_line(cfg, one, D.TABLE["cuda"], torch.device("cpu"), tiny_dir())
    cfg.rollout.partial = True
    assert pipeline.staging_memory_line(cfg, one, D.TABLE["cuda"], torch.device("cpu"), tiny_dir()) == ""
