"""The generation rank's own deadline on vLLM worker calls, with a real stuck worker.

The engine uses vLLM's single-process executor, as on a GPU/NPU with tensor_parallel_size 1
(vLLM's CPU build defaults to its multiprocess executor, which would honour vLLM's own timeout):
there `collective_rpc(timeout=...)` is ignored. The worker is stuck for real: it waits for weight
buckets that trainer rank 0 never sends. The call must fail within the deadline (+ vLLM's 5 s
shutdown grace), name the rank and method, and leave no engine process behind."""
from __future__ import annotations

import time

import psutil
import pytest
import torch

from tests.test_vllm import CPU, MAX_PX, MIN_PX, _free_port, _thread, tiny, world  # noqa: F401

import config as C  # noqa: E402
import sync as S  # noqa: E402
import vllm_engine as V  # noqa: E402

pytestmark = pytest.mark.slow


def test_stuck_worker_call_fails_within_the_deadline_and_stops_the_engine(world, tiny, monkeypatch):  # noqa: F811
    from vllm.v1.executor.uniproc_executor import UniProcExecutor
    eng = V.VLLMEngine(tiny.path, torch.float32, tiny.tokens,
                       C.RolloutConfig(engine="vllm", max_model_len=512), MIN_PX, MAX_PX, seed=0,
                       timeout_s=120, llm_kwargs={"distributed_executor_backend": UniProcExecutor})
    # vLLM's engine core (and anything it started); not multiprocessing's resource tracker,
    # which belongs to this process and lives as long as it does
    kids = [p for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())]
    assert kids, "vLLM spawned no engine process"
    try:
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        port = _free_port()
        opened = _thread(S.open_channel, "gloo", "127.0.0.1", port, 0, 2, CPU)
        eng.join_weight_channel("127.0.0.1", port, 1, 2)
        policy = torch.nn.Linear(4, 4)
        plan = S.Sender(policy, "float32", bucket_mb=1, channel=opened()).plan
        eng.timeout_s = 3.0
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as e:
            eng.receive_weights(S.LocalControl(1, plan))  # nobody sends: the worker waits
        took = time.monotonic() - t0
    finally:
        eng.shutdown()
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
