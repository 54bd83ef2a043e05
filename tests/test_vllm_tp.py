"""A tensor-parallel vLLM engine (tensor_parallel_size = 2, vLLM's CPU build, two worker
processes): both workers join the weight channel (world 1 + 2, ranks 1 and 2), each receives
every bucket and loads its shard through the layerwise reload; the engine then matches the
updated trainer. About a minute (one engine start); needs 2 cores (one OpenMP thread each)."""
from __future__ import annotations

import os
import time

import pytest

from tests.test_vllm import (CPU, MAX_PX, MIN_PX, _max_diff, _perturb,  # noqa: F401
                             cpu_build,
                             _problems, _prompts, _thread, tiny, world)
from tests.util import free_port  # noqa: E402

import channel as CH  # noqa: E402
import config as C  # noqa: E402
import model as M  # noqa: E402
import episode as E  # noqa: E402
import sync as S  # noqa: E402
import vllm_engine as V  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp_engine(world, tiny):  # noqa: F811
    if (os.cpu_count() or 1) < 2:
        pytest.skip("tensor_parallel_size=2 on vLLM's CPU build binds one core per worker: needs 2")
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    # vLLM's default ("auto") wants one NUMA node per worker; give each worker a core instead
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    t0 = time.perf_counter()
    eng = V.VLLMEngine(tiny.path, tiny.tokens,
                       C.RolloutConfig(engine="vllm", max_model_len=512, tensor_parallel_size=2),
                       C.ModelConfig(min_pixels=MIN_PX, max_pixels=MAX_PX), seed=0, timeout_s=300)
    print(f"\nvLLM tp=2 engine start: {time.perf_counter() - t0:.1f} s")
    try:
        yield eng
    finally:
        eng.shutdown()
        if saved is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved


def test_tp2_workers_join_the_channel_and_load_their_shards(tp_engine, tiny, monkeypatch):  # noqa: F811
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # trainer rank 0 has it
    problems = _problems(2, seed=6)
    prompts = _prompts(tiny, problems)
    sp = E.Sampling(n=2, max_new_tokens=8)
    policy = M.load_model(tiny.path).eval()
    original = M.load_model(tiny.path).eval()
    out = tp_engine.generate(prompts, sp, seed=1)
    assert _max_diff(original, tiny, problems, prompts, out, 1.0) <= 1e-4

    port = free_port()
    size = 1 + 1 * 2  # trainer rank 0 + one engine of two workers (channel.open_engine_channel)
    opened = _thread(CH.open_channel, "gloo", "127.0.0.1", port, 0, size, CPU)
    tp_engine.join_weight_channel("127.0.0.1", port, 1, size)
    sender = S.Sender(policy, "float32", bucket_mb=0.05, channel=opened())
    assert len(sender.plan) > 3  # layers span buckets: the reload buffers them across buckets
    _perturb(policy, seed=1)
    sent = _thread(sender.send, 1)
    assert tp_engine.receive_weights(S.LocalControl(1, sender.plan)) == 1
    sent()
    out = tp_engine.generate(prompts, sp, seed=2)
    after = _max_diff(policy, tiny, problems, prompts, out, 1.0)
    before = _max_diff(original, tiny, problems, prompts, out, 1.0)
    print(f"tp=2 after sync: vs perturbed {after:.2e}, vs original {before:.2e}")
    # a shard that kept its old weights would leave a gap to the perturbed trainer
    assert after <= 1e-4 and before > 1e-2

