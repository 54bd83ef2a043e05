"""The vLLM engine path's pure parts, without vLLM: prompts, sampling arguments, completions,
the bucket plan as RPC data, the environment for vLLM's spawned processes, and the worker
extension's receive-unpack-load with a real torch module standing in for vLLM's model."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import channel as CH
import families as F
import inputs as I
import model as M
import hf_engine as HF
import episode as E
import sync as S
import vllm_engine as V
import vllm_worker as W

# hand-made ids: 0 pad, 2 eos, 4/5/6 vision start/pad/end, 9 an unused row past the tokenizer
TOKENS = I.Tokens(image_pad=5, vision_start=4, vision_end=6, eos=2, pad=0, vocab_size=10,
                  suppressed=(0, 4, 5, 6, 9))


# --------------------------------------------------------------------------- prompts
def test_prompt_keeps_ids_and_one_unexpanded_placeholder_per_image():
    img_a, img_b = object(), object()
    ids = [1, 4, 5, 6, 3, 3]
    p = V.vllm_prompt(ids, [img_a], TOKENS)
    assert p == {"prompt_token_ids": ids, "multi_modal_data": {"image": img_a}}
    two = V.vllm_prompt([4, 5, 6, 4, 5, 6, 3], [img_a, img_b], TOKENS)
    assert two["multi_modal_data"]["image"] == [img_a, img_b]
    assert V.vllm_prompt([1, 3], [], TOKENS) == {"prompt_token_ids": [1, 3]}


@pytest.mark.parametrize("ids,n_images", [
    ([4, 5, 5, 5, 5, 6, 3], 1),   # already expanded (transformers' form): vLLM would expand again
    ([4, 5, 6, 3], 2),            # fewer placeholders than images
    ([4, 5, 6, 3], 0),            # a placeholder without an image
])
def test_prompt_refuses_placeholder_count_mismatch(ids, n_images):
    with pytest.raises(ValueError, match="placeholder"):
        V.vllm_prompt(ids, [object()] * n_images, TOKENS)


def test_prompt_ids_from_model_are_accepted(tmp_path):
    """inputs.prompt_ids (what rollout() sends) has exactly one placeholder per image."""
    path = str(F.build_tiny(tmp_path / "tiny", seed=0))
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    ids = I.prompt_ids(procs, "Find x.", 1)
    assert V.vllm_prompt(ids, ["im"], procs.tokens)["prompt_token_ids"] == ids


# --------------------------------------------------------------------------- sampling
def test_sampling_kwargs_sample():
    sp = E.Sampling(n=4, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=12)
    kw = V.vllm_sampling_kwargs(sp, TOKENS, seed=11)
    bias = kw.pop("logit_bias")
    assert kw == dict(n=4, temperature=0.7, top_p=0.9, top_k=5, max_tokens=12, logprobs=0,
                      seed=11, stop_token_ids=[2], detokenize=False)
    # every suppressed id (specials, the unused row 9) and only those are forbidden
    assert sorted(bias) == [0, 4, 5, 6, 9] and all(v == -math.inf for v in bias.values())


def test_sampling_kwargs_defaults_mean_off_in_vllm():
    kw = V.vllm_sampling_kwargs(E.Sampling(n=2), TOKENS, seed=0)
    assert (kw["top_p"], kw["top_k"], kw["temperature"]) == (1.0, 0, 1.0)  # vLLM: 0 = no top-k


def test_sampling_kwargs_greedy_is_one_sample_at_temperature_zero():
    kw = V.vllm_sampling_kwargs(E.Sampling(n=4, temperature=0.7, greedy=True), TOKENS, seed=3)
    assert kw["n"] == 1 and kw["temperature"] == 0.0
    assert "top_p" not in kw and "top_k" not in kw
    assert sorted(kw["logit_bias"]) == list(TOKENS.suppressed)


# --------------------------------------------------------------------------- completions
def _lp(d: dict[int, float]) -> dict:
    return {t: SimpleNamespace(logprob=v) for t, v in d.items()}


def test_completion_reads_sampled_token_logprobs_and_length_stop():
    # logprobs=0: each position holds the sampled token (and may hold others; ignore them)
    c = V.vllm_completion((7, 3, 2), [_lp({7: -1.5}), _lp({3: -0.25, 8: -0.1}), _lp({2: -2.0})], "stop")
    assert c == E.Completion([7, 3, 2], [-1.5, -0.25, -2.0], truncated=False)
    c = V.vllm_completion([7, 3], [_lp({7: -1.0}), _lp({3: -0.5})], "length")
    assert c.truncated and c.ids == [7, 3] and c.logprobs == [-1.0, -0.5]
    with pytest.raises(ValueError):  # a logprob missing for a token is an error, not a shorter list
        V.vllm_completion([7, 3], [_lp({7: -1.0})], "length")


# --------------------------------------------------------------------------- plan as RPC data
def _specs():
    return [("a.weight", (3, 5), "bfloat16"), ("a.bias", (5,), "bfloat16"),
            ("big", (40, 8), "float32"), ("c", (), "float32")]


def test_plan_round_trips_as_plain_data():
    plan = S.plan_buckets(_specs(), bucket_bytes=256)
    plain = S.plan_to_plain(plan)

    def leaves(x):
        if isinstance(x, (list, dict)):
            for v in (x.values() if isinstance(x, dict) else x):
                yield from leaves(v)
        else:
            yield x
    assert all(type(v) in (str, int) for v in leaves(plain))  # no tuples, dtypes or Slots
    # JSON, like msgpack, turns tuples into lists and keeps str/int
    back = S.plan_from_plain(json.loads(json.dumps(plain)))
    assert back == plan and all(isinstance(s.shape, tuple) for b in back for s in b)
    assert [[s.name for s in b] for b in back] == [["a.weight", "a.bias"], ["big"], ["c"]]


# --------------------------------------------------------------------------- environment
def test_prepare_spawn_environment(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    V._prepare_spawn()
    V._prepare_spawn()  # idempotent
    root = str(Path(V.__file__).resolve().parent)
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"  # the engine core: spawned
    assert "TORCHELASTIC_USE_AGENT_STORE" not in os.environ
    assert os.environ["PYTHONPATH"].split(os.pathsep) == ["/somewhere", root]
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # vLLM's own start-up deadline follows rollout.start_timeout_s, unless set by the user
    monkeypatch.delenv("VLLM_ENGINE_READY_TIMEOUT_S", raising=False)
    V._prepare_spawn(900.5)
    assert os.environ["VLLM_ENGINE_READY_TIMEOUT_S"] == "901"
    monkeypatch.setenv("VLLM_ENGINE_READY_TIMEOUT_S", "42")
    V._prepare_spawn(900.0)
    assert os.environ["VLLM_ENGINE_READY_TIMEOUT_S"] == "42"


def test_engine_core_starts_its_workers_and_compiles_as_the_device_says(monkeypatch):
    """The rank spawns vLLM's engine core; the core (where the process hook runs when it
    unpickles vLLM's config) starts the workers by the device's method (fork on CPU) and, on CPU
    under enforce_eager, runs vLLM's torch.compile'd helpers eagerly. The hook run in the rank
    itself (a copy of the config) leaves the rank alone."""
    import device as D
    assert D.TABLE["cpu"].vllm_workers == "fork"
    assert D.TABLE["cuda"].vllm_workers == D.TABLE["npu"].vllm_workers == "spawn"
    import torch._dynamo
    for key in ("VLLM_WORKER_MULTIPROC_METHOD", V.WORKERS_ENV, V.FRONT_END_ENV, V.EAGER_ENV):
        monkeypatch.setenv(key, "")  # given back after the test
    monkeypatch.setattr(torch._dynamo.config, "disable", False)
    monkeypatch.setattr(V, "_image_only_processor", lambda: None)  # the hook's vLLM patches
    moe_fixes = []
    monkeypatch.setattr(V, "_cpu_moe_activation", lambda: moe_fixes.append(1))
    monkeypatch.setenv(V.CPU_MOE_ENV, "")
    for kind in D.TABLE:
        for eager in (True, False):  # rollout.enforce_eager
            torch._dynamo.config.disable = False
            dev = D.TABLE[kind]
            moe_fixes.clear()
            V._prepare_spawn(workers=dev.vllm_workers,
                             eager_helpers=dev.vllm_eager_helpers and eager,
                             cpu_moe_fix=dev.vllm_cpu_moe_fix)
            V._vllm_process_hook()                      # in the rank: nothing changes
            assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
            assert torch._dynamo.config.disable is False
            os.environ[V.FRONT_END_ENV] = str(os.getpid() + 1)  # as seen from the engine core
            V._vllm_process_hook()
            assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == dev.vllm_workers, kind
            # vLLM's compiled helpers run eagerly on CPU under enforce_eager only
            assert torch._dynamo.config.disable is (kind == "cpu" and eager), (kind, eager)
            # the CPU MoE workaround: CPU processes only (GPU/NPU never import its module)
            assert bool(moe_fixes) is (kind == "cpu"), (kind, moe_fixes)
    with pytest.raises(ValueError, match="'forkserver'"):
        V._prepare_spawn(workers="forkserver")


def test_train_py_as_a_spawned_childs_main_only_imports(capsys):
    """`python train.py` under torchrun: vLLM's engine core is spawned, and multiprocessing's
    spawn re-runs the parent's main script there as `__mp_main__`. train.py then only imports
    and defines: no signal handler, no output, no run. (The tests' vLLM launches are forks of
    the warm server, whose main module is `-c`: they do not show this.)"""
    import runpy
    import signal
    before = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    ns = runpy.run_path(str(Path(V.__file__).parent / "train.py"), run_name="__mp_main__")
    assert callable(ns["main"])
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == before
    out = capsys.readouterr()
    assert out.out == out.err == ""


def test_prepare_spawn_cuts_vllm_logging_to_warnings_unless_verbose(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    V._prepare_spawn()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    monkeypatch.delenv("VLLM_LOGGING_LEVEL")
    V._prepare_spawn(verbose=True)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")       # the user's own level stays
    V._prepare_spawn()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"


@pytest.mark.slow  # imports vLLM (seconds)
def test_vllm_reads_the_level_before_it_logs():
    """What the setting does in a process that imports vLLM afterwards (as vLLM's spawned
    engine and worker do): INFO lines gone, warnings kept. (Needs vLLM installed.)"""
    pytest.importorskip("vllm")
    code = ("import os; os.environ['VLLM_LOGGING_LEVEL'] = 'WARNING'\n"
            "from vllm.logger import init_logger\n"
            "log = init_logger('vllm.grpo_test'); log.info('INFO-LINE'); log.warning('WARN-LINE')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "WARN-LINE" in p.stdout + p.stderr and "INFO-LINE" not in p.stdout + p.stderr


def test_environ_restored_undoes_edits(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.delenv("GRPO_TEST_NEW", raising=False)
    with V._environ_restored():
        os.environ["LOCAL_WORLD_SIZE"] = "1"
        os.environ["GRPO_TEST_NEW"] = "x"
    assert os.environ["LOCAL_WORLD_SIZE"] == "8" and "GRPO_TEST_NEW" not in os.environ


def test_rendezvous_hides_torchrun_agent_store(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with CH._without_agent_store():
        assert "TORCHELASTIC_USE_AGENT_STORE" not in os.environ
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_unknown_communicator_is_refused_before_any_rendezvous():
    with pytest.raises(ValueError, match="unknown communicator"):
        CH.open_channel("mpi", "127.0.0.1", 1, 0, 2, torch.device("cpu"))


def test_process_hook_is_identity_and_unpickles_through_the_patch():
    hook = V._VLLMProcessHook()
    cfg = object()
    assert hook(cfg) is cfg
    assert hook.__reduce__() == (V._vllm_process_hook, ())


@pytest.fixture
def fake_llm(monkeypatch) -> dict:
    """vllm.LLM replaced by a stand-in that records its arguments (nothing starts)."""
    captured: dict = {}

    class FakeLLM:
        def __init__(self, **kw):
            captured.update(kw)
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=FakeLLM))
    monkeypatch.setattr(V, "_image_only_processor", lambda: None)
    monkeypatch.setattr(V, "_prepare_spawn", lambda *a, **kw: None)
    return captured


@pytest.mark.parametrize("kind", ["cpu", "cuda", "npu"])
def test_engine_processes_run_vllms_v1_model_runner(monkeypatch, fake_llm, kind):
    """A1: vLLM 0.23 runs dense Qwen3 (configs/qwen3_4b_math.toml) on its V2 model runner on GPU
    by default; nothing here ever ran that path, so the engine's processes inherit
    VLLM_USE_V2_MODEL_RUNNER=0 (device.vllm_spawn_env) when vLLM starts; on NPU also the
    engines' own TASK_QUEUE_ENABLE / CPU_AFFINITY_CONF. The variable is one vLLM 0.23 reads."""
    import importlib.util

    import config as C
    seen = {}
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    for k in ("TASK_QUEUE_ENABLE", "CPU_AFFINITY_CONF"):
        monkeypatch.setenv(k, "2")  # as launch/npu_env.sh sets them for the trainers
    sys.modules["vllm"].LLM.__init__ = lambda self, **kw: seen.update(os.environ)
    V.VLLMEngine("m", TOKENS, C.RolloutConfig(engine="vllm"), C.ModelConfig(min_pixels=1, max_pixels=2),
                 seed=0, device_kind=kind)
    assert seen["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert (seen["TASK_QUEUE_ENABLE"], seen["CPU_AFFINITY_CONF"]) == (("1", "0") if kind == "npu" else ("2", "2"))
    monkeypatch.delitem(sys.modules, "vllm")
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vLLM is not installed: the variable's name is not checked")
    root = Path(spec.origin).parent  # no vLLM import
    assert '"VLLM_USE_V2_MODEL_RUNNER": lambda' in (root / "envs.py").read_text()
    assert "use_v2_model_runner = envs.VLLM_USE_V2_MODEL_RUNNER" in (root / "config" / "vllm.py").read_text()


def test_engine_turns_async_scheduling_off_on_every_device(monkeypatch, fake_llm):
    """vLLM 0.23 turns async scheduling on by default on GPU/NPU, while its CPU build forces it
    off: the engine turns it off itself, so what runs here (generate, reset_prefix_cache, the
    weight reload) is what runs on every device; the name is a field of vLLM's EngineArgs."""
    import importlib.util
    import sys

    import config as C
    V.VLLMEngine("m", TOKENS, C.RolloutConfig(engine="vllm"), C.ModelConfig(min_pixels=1, max_pixels=2),
                 seed=0)
    assert fake_llm["async_scheduling"] is False
    monkeypatch.delitem(sys.modules, "vllm")
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vLLM is not installed: the argument name is not checked")
    args = (Path(spec.origin).parent / "engine" / "arg_utils.py").read_text()  # no vLLM import
    assert "\n    async_scheduling: bool | None = " in args


# --------------------------------------------------------------------------- worker extension
class _RecordingChannel:
    """Trainer side: keeps a copy of every broadcast bucket."""

    def __init__(self):
        self.sent: list[torch.Tensor] = []

    def broadcast(self, buf):
        self.sent.append(buf.clone())
        return SimpleNamespace(wait=lambda: None)


class _ReplayChannel:
    """Worker side: each broadcast fills the receive buffer with the next recorded bucket."""

    def __init__(self, sent):
        self.sent = list(sent)
        self.buffers: list[torch.Tensor] = []

    def broadcast(self, buf):
        self.buffers.append(buf)
        buf.copy_(self.sent.pop(0))
        return SimpleNamespace(wait=lambda: None)


class _BufferingRunner:
    """vLLM's CPU reload stand-in: like its layerwise reload it holds every tensor it is given
    until the end, then copies them into `model` by name."""

    def __init__(self, model):
        self.model = model
        self.received: list[tuple[str, torch.Tensor]] = []

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        assert is_checkpoint_format
        self.received = list(weights_iterator)
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in self.received:
                params[name].copy_(t)


class _Worker(W.VLLMWorkerExtension):
    def __init__(self, model, channel, device_type: str = "cpu", quantization=None):
        self.device, self.rank = torch.device(device_type), 0
        self.model_config = SimpleNamespace(quantization=quantization)
        self.model_runner = _BufferingRunner(model)
        self.weight_channel = channel


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 300))


def _deeper_net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 7),
                               torch.nn.LayerNorm(7), torch.nn.Linear(7, 7), torch.nn.LayerNorm(7),
                               torch.nn.Linear(7, 300))


def test_worker_receives_unpacks_and_loads_bitwise():
    trainer, engine = _deeper_net(0), _deeper_net(1).to(torch.bfloat16)
    out = _RecordingChannel()
    sender = S.Sender(trainer, "bfloat16", bucket_mb=256 / 2**20, channel=out,  # 256-byte buckets
                      solo_mb=400 / 2**20)
    assert len(sender.plan) >= 3 and any(len(b) > 1 for b in sender.plan)
    solo = [b for b in sender.plan if len(b) == 1]
    assert solo and len(sender.plan) - len(solo) >= 3  # both kinds, 3+ packed buckets
    sender.send(version=7)
    # the plan crosses collective_rpc as plain data
    plain = json.loads(json.dumps(S.plan_to_plain(sender.plan)))
    worker = _Worker(engine, _ReplayChannel(out.sent))
    assert worker.receive_weights(7, plain) == len(list(trainer.parameters()))
    assert worker.weight_version == 7
    got = dict(engine.named_parameters())
    for name, p in trainer.named_parameters():
        assert got[name].shape == p.shape
        assert torch.equal(got[name], p.detach().to(torch.bfloat16)), name
    # packed buckets land in two receive buffers reused for the sync, and the loader got copies
    # (it may keep them past the buffer's next use); a one-tensor bucket is its own buffer,
    # handed over as it is
    bufs = worker.weight_channel.buffers
    assert len(bufs) == len(sender.plan)
    assert len({b.untyped_storage().data_ptr() for b in bufs}) == 2 + len(solo)
    ring = {b.untyped_storage().data_ptr() for b, bucket in zip(bufs, sender.plan) if len(bucket) > 1}
    assert len(ring) == 2
    owner = {t.untyped_storage().data_ptr() for _, t in worker.model_runner.received}
    assert not owner & ring
    assert {b.untyped_storage().data_ptr() for b, bucket in zip(bufs, sender.plan)
            if len(bucket) == 1} <= owner
    assert [n for n, _ in worker.model_runner.received] == [s.name for b in sender.plan for s in b]
    # the buffering loader held everything to the end; then every received byte is freed
    worker.model_runner.received = bufs[:] = owner = ring = []
    assert worker.weight_sync_memory()["now"] == 0


class _LayerwiseRunner(_BufferingRunner):
    """vLLM 0.23's layerwise reload, as far as memory goes: it keeps each layer's tensors until
    the layer has all of them, then loads the layer and drops them; a layer that never completes
    (`delayed`: vLLM's padded vocabulary) keeps them until the end of the sync."""

    def __init__(self, model, delayed):
        super().__init__(model)
        self.delayed = delayed

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        params = dict(self.model.named_parameters())
        layer_of = {n: n.rpartition(".")[0] for n in params}
        need = {}
        for n, layer in layer_of.items():
            need[layer] = need.get(layer, 0) + 1
        held: dict = {}
        for name, t in weights_iterator:
            layer = layer_of[name]
            held.setdefault(layer, []).append((name, t))
            if len(held[layer]) == need[layer] and layer not in self.delayed:
                with torch.no_grad():
                    for n, x in held.pop(layer):
                        params[n].copy_(x)
        with torch.no_grad():
            for named in held.values():
                for n, x in named:
                    params[n].copy_(x)


def test_sync_memory_is_bounded_by_the_buckets_not_the_model():
    """What a sync holds outside vLLM's budget: two packed buckets, plus the tensors of layers
    not yet complete at their own size. A layer that stays incomplete until the end (one per
    bucket here) no longer keeps its whole bucket alive: with a buffer per bucket this sync held
    the whole model at once."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32)) for _ in range(8)]
    trainer = torch.nn.Sequential(*blocks)
    engine = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32))
                                   for _ in range(8)])
    delayed = {f"{i}.1" for i in range(8)}  # every block's norm: held to the end
    out = _RecordingChannel()
    sender = S.Sender(trainer, "float32", bucket_mb=(32 * 33 * 4 + 2 * 32 * 4 + 256) / 2**20,
                      channel=out, solo_mb=1.0)
    assert len(sender.plan) == 8 and all(len(b) > 1 for b in sender.plan)  # a block per bucket
    sender.send(version=1)
    worker = _Worker(engine, _ReplayChannel(out.sent))
    worker.model_runner = _LayerwiseRunner(engine, delayed)
    worker.receive_weights(1, S.plan_to_plain(sender.plan))
    for (n, p), q in zip(trainer.named_parameters(), engine.parameters()):
        assert torch.equal(p, q), n
    model = sum(S.bucket_size(b) for b in sender.plan)
    bucket = max(S.bucket_size(b) for b in sender.plan)
    held_to_end = 8 * 2 * 32 * 4                 # the norms' own bytes
    layer = 32 * 33 * 4                          # the largest layer in progress
    peak = worker.weight_sync_memory()["peak"]
    print(f"peak {peak} B: model {model} B, bucket {bucket} B")
    assert peak <= 2 * bucket + held_to_end + layer < model
    worker.weight_channel.buffers.clear()  # the stand-in channel's own references
    assert worker.weight_sync_memory()["now"] == 0


def test_worker_refuses_quantized_and_nz_models(monkeypatch):
    """A bf16 Hugging Face update cannot land in quantized weights or vllm-ascend's FRACTAL_NZ
    layout: refused when the channel is joined, before any weight moves."""
    import sys
    with pytest.raises(RuntimeError, match="quantized \\(fp8\\)"):
        _Worker(_net(0), None, quantization="fp8").refuse_unloadable()
    _Worker(_net(0), None).refuse_unloadable()  # bf16 / fp32 on CPU: fine

    def fake_ascend(nz_mode: int, p310: bool):
        mods = {"vllm_ascend": SimpleNamespace(),
                "vllm_ascend.ascend_config": SimpleNamespace(
                    get_ascend_config=lambda: SimpleNamespace(weight_nz_mode=nz_mode)),
                "vllm_ascend.utils": SimpleNamespace(is_310p=lambda: p310)}
        for k, v in mods.items():
            monkeypatch.setitem(sys.modules, k, v)
    worker = _Worker(_net(0), None, device_type="meta")
    worker.device = SimpleNamespace(type="npu")
    for nz, p310, ok in ((0, False, True), (1, False, False), (2, False, False), (0, True, False)):
        fake_ascend(nz, p310)
        if ok:
            worker.refuse_unloadable()
        else:
            with pytest.raises(RuntimeError, match="VLLM_ASCEND_ENABLE_NZ=0"):
                worker.refuse_unloadable()


def test_front_end_refuses_nz_before_starting_vllm(monkeypatch):
    monkeypatch.delenv("VLLM_ASCEND_ENABLE_NZ", raising=False)
    V.refuse_npu_nz("cuda")
    with pytest.raises(RuntimeError, match="VLLM_ASCEND_ENABLE_NZ=1 \\(unset\\)"):
        V.refuse_npu_nz("npu")
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "2")
    with pytest.raises(RuntimeError, match="VLLM_ASCEND_ENABLE_NZ=2"):
        V.refuse_npu_nz("npu")
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    V.refuse_npu_nz("npu")


# --------------------------------------------------------------------------- RPC deadline
class _StuckLLM:
    """vLLM's LLM whose worker never returns (as UniProcExecutor ignores `timeout`)."""

    def __init__(self):
        self.release = __import__("threading").Event()
        self.stopped = False
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=self._stop))

    def _stop(self):
        self.stopped = True

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.release.wait(60)
        return [method]


def _engine_with(llm, timeout_s):
    eng = V.VLLMEngine.__new__(V.VLLMEngine)
    eng.llm, eng.timeout_s, eng.who = llm, timeout_s, "rank 9 (generation)"
    return eng


def test_rpc_deadline_stops_the_engine_and_names_rank_and_method():
    import time
    llm = _StuckLLM()
    eng = _engine_with(llm, 0.5)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        eng.join_weight_channel("127.0.0.1", 1, 1, 2)
    took = time.monotonic() - t0
    llm.release.set()
    assert 0.5 <= took < 3, took
    msg = str(e.value)
    assert "rank 9 (generation)" in msg and "'init_weight_sync'" in msg and "\n" not in msg
    assert llm.stopped and eng.llm is None


def test_rpc_returns_and_reraises_within_the_deadline():
    llm = _StuckLLM()
    llm.release.set()
    assert _engine_with(llm, 5)._rpc("whoami") == ["whoami"]

    def boom(method, timeout=None, args=(), kwargs=None):
        raise ValueError("worker failed")
    llm.collective_rpc = boom
    with pytest.raises(ValueError, match="worker failed"):
        _engine_with(llm, 5)._rpc("receive_weights", 1, [])
    assert not llm.stopped


# --------------------------------------------------------------------------- image processor
def test_checked_processor_forces_pil_and_refuses_another_class(capsys, monkeypatch):
    want = F.image_processor_cls()
    seen = {}

    def load(**kw):
        seen.update(kw)
        return SimpleNamespace(image_processor=want())
    monkeypatch.setattr(V, "IMAGE_PROCESSOR_SEEN", {})
    V.checked_processor(load, use_fast=True, min_pixels=1)  # vLLM asks for use_fast=True
    assert seen == {"use_fast": False, "min_pixels": 1} and "backend" not in seen
    assert f"image processor {want.__name__}" in capsys.readouterr().out

    class Other:
        pass
    with pytest.raises(RuntimeError, match="Other; the trainer uses Qwen2VLImageProcessorPil"):
        V.checked_processor(lambda **kw: SimpleNamespace(image_processor=Other()))


def test_use_fast_false_gives_the_pil_class_where_torchvision_is_installed(tmp_path, monkeypatch):
    """transformers picks the torchvision image processor whenever torchvision is available (so
    on GPU/NPU); the forced use_fast=False gives the trainer's PIL class there too."""
    from transformers.models.auto import image_processing_auto as auto
    monkeypatch.setattr(auto, "is_torchvision_available", lambda: True)  # as on GPU / NPU
    assert auto._resolve_backend(None, None, "Qwen2VLImageProcessor") == "torchvision"
    assert auto._resolve_backend(None, False, "Qwen2VLImageProcessor") == "pil"
    path = str(F.build_tiny(tmp_path / "tiny", seed=0))
    from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
    cls = V.image_only_processor_cls(Qwen2_5_VLProcessor)
    proc = V.checked_processor(lambda **kw: cls.from_pretrained(path, **kw),
                               min_pixels=56 * 56, max_pixels=112 * 112)
    assert type(proc.image_processor) is F.image_processor_cls()


# --------------------------------------------------------------------------- prefix caching
def test_prefix_caching_auto_is_off_for_linear_attention_models():
    """rollout.prefix_caching = "auto": off for a model with linear-attention layers (Qwen3.5's
    Gated DeltaNet: vLLM 0.23's mamba prefix caching is experimental), on otherwise; "on" /
    "off" as said; the engine passes the decision to vLLM."""
    q35, vl = M.peek_config("tiny-qwen3_5"), M.peek_config("tiny")
    on, why = V.prefix_caching("auto", q35)
    assert not on and "linear-attention layers" in why and "--rollout.prefix_caching=on" in why
    assert V.prefix_caching("auto", vl) == (True, "auto: every text layer is full attention")
    assert V.prefix_caching("on", q35)[0] and not V.prefix_caching("off", vl)[0]
    assert V.prefix_caching("auto", None)[0]  # a hub id in a dry run: decided at start
    assert M.peek_config("Qwen/Qwen2.5-VL-3B-Instruct") is None  # nothing downloaded
    assert V.VLLMEngine.start_note(SimpleNamespace(prefix_caching="auto"), q35).startswith(
        "vLLM prefix caching off (auto: ")
    assert HF.HFEngine.start_note(SimpleNamespace(prefix_caching="auto"), q35) == ""


def test_engine_passes_the_prefix_caching_decision(fake_llm):
    import config as C
    captured = fake_llm
    for setting, want in (("auto", True), ("off", False), ("on", True)):
        V.VLLMEngine("m", TOKENS, C.RolloutConfig(engine="vllm", prefix_caching=setting),
                     C.ModelConfig(min_pixels=1, max_pixels=2), seed=0)
        assert captured["enable_prefix_caching"] is want, setting


def test_dry_run_of_a_qwen3_5_config_says_prefix_caching_is_off_and_why(capsys, monkeypatch):
    import train
    monkeypatch.setenv("GRPO_DEVICE", "cpu")
    args = ["--config", str(Path(V.__file__).parent / "configs" / "tiny.toml"),
            "--model.path=tiny-qwen3_5", "--rollout.engine=vllm", "--dry-run"]
    assert train.main(args) == 0
    assert ("vLLM prefix caching off (auto: the model has linear-attention layers"
            in capsys.readouterr().out)
    assert train.main(args + ["--rollout.prefix_caching=on"]) == 0
    assert "vLLM prefix caching on (rollout.prefix_caching = on)" in capsys.readouterr().out


def test_partial_reload_exempts_every_vocabulary_layer_by_suffix():
    """vLLM's padded vocabulary layers load "in part" by design; vllm-ascend's subclasses
    (AscendParallelLMHead, AscendVocabParallelEmbedding) are the same layers."""
    import logging
    f = W.PartialReload(active=True)
    for name in ("ParallelLMHead", "VocabParallelEmbedding", "AscendParallelLMHead",
                 "AscendVocabParallelEmbedding", "QKVParallelLinear"):
        f.filter(logging.LogRecord("x", logging.DEBUG, "", 0, "%s: Delayed processing",
                                   (name,), None))
    assert f.partly == ["QKVParallelLinear"]
