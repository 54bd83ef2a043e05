"""Every script under bench/ runs, in a tiny mode, and prints its one JSON object: a benchmark
nothing runs rots (bench/sync.py called a Receiver method that no longer existed).

Tiny modes are the scripts' own arguments turned down, not special code paths. bench/vs_trl.py
needs a TRL environment for its TRL side; here it runs only its own side (`--sides
ours_world1`), and tests/test_bench_vs_trl.py checks its pure parts. bench/device_check.sh runs
in its CPU mode in tests/test_device_check.py."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.util import ROOT, env, torchrun_parts

BENCH = ROOT / "bench"
# script -> where its smoke test is
SMOKED = {"sync.py": "here", "step.py": "here", "e2e.py": "here", "verifier.py": "here",
          "engine_time.py": "here (test_e2e_engine_time) + tests/test_bench_engine_time.py",
          "sync_memory.py": "here", "packing.py": "here", "colocate.py": "here",
          "vs_trl.py": "here + tests/test_bench_vs_trl.py",
          "device_check.sh": "tests/test_device_check.py"}


def run(*args: str, timeout: float = 300, e: dict | None = None) -> dict:
    p = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=e or env(),
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_every_bench_script_has_a_smoke_test():
    scripts = sorted(p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh"))
    assert scripts == sorted(SMOKED), scripts


def test_verifier(tmp_path):
    cases = tmp_path / "cases.jsonl"
    lines = (ROOT / "tests" / "data" / "verifier_cases.jsonl").read_text().splitlines()[:3]
    cases.write_text("\n".join(lines) + "\n")
    r = run(BENCH / "verifier.py", "--cases", cases, "--only", "project")
    assert r["verifier"] == "project" and r["cases"] == 3 and r["killed"] == 0


@pytest.mark.slow  # a fresh interpreter (about 4 s): the full tier, as the other scripts
def test_sync_memory():  # the meta device: shapes only
    r = run(BENCH / "sync_memory.py", "--bucket-mb", "64")
    assert r["buckets"] > 0 and 0 < r["peak_received_mib"] < r["model_mib"], r


@pytest.mark.slow
@pytest.mark.slow
def test_packing():
    """The three layouts on the same long-tailed episodes: the keys docs/benchmarks.md quotes,
    packed rows without padding and with less attention work than either padded layout of the
    same token budget, balanced ranks no worse than contiguous."""
    r = run(BENCH / "packing.py", "--prompts", "4", "--max-new-tokens", "64", "--reps", "1",
            "--bucket-ratios", "2")
    assert set(r) == {"workload", "padded", "packed", "padded_sorted", "speedup", "speedup_vs_sorted",
                      "rank_token_imbalance", "exact", "peak_memory_gb", "bucket_ratios"}
    # the same episodes give the same loss and gradients packed as padded (fp32)
    assert r["exact"]["entropy_rel_diff"] < 1e-6 and r["exact"]["grad_max_rel_diff"] < 1e-5
    assert r["packed"]["attention"] == "grpo_segments" and r["padded"]["attention"] == "sdpa"
    # --bucket-ratios: the packed layout again with fewer, wider calls (more pairs computed)
    assert set(r["bucket_ratios"]) == {"1.25", "2"} and r["bucket_ratios"]["1.25"]["speedup"] == r["speedup"]
    assert r["bucket_ratios"]["2"]["attention_frac"] >= r["packed"]["attention_frac"]
    for side in ("padded", "packed", "padded_sorted"):
        assert r[side]["tokens_per_s"] > 0 and 0 <= r[side]["padding_frac"] < 1
    assert r["packed"]["padding_frac"] == 0.0 and r["padded"]["padding_frac"] > 0
    assert r["packed"]["attention_frac"] < min(r["padded"]["attention_frac"], r["padded_sorted"]["attention_frac"])
    assert r["speedup"] > 0 and r["speedup_vs_sorted"] > 0 and r["workload"]["tokens"] > 0
    assert 1.0 <= r["rank_token_imbalance"]["balanced"] <= r["rank_token_imbalance"]["padded"]


def test_step():
    """With `--lora-rank` the script runs its plain step (the `full` part, what a run without the
    flag prints) and the LoRA one, each in a process of its own, and puts them side by side."""
    r = run(BENCH / "step.py", "--lora-rank", "4", "--steps", "1", "--warmup", "0", "--seq-len",
            "64", "--image-px", "56")
    full, low = r["full"], r["lora"]
    assert full["model"] == "tiny" and full["seq_len"] == 64 and full["step_s"] > 0
    assert (full["lora_rank"], low["lora_rank"]) == (0, 4)
    assert 0 < low["trainable_params"] < full["trainable_params"]
    assert 0 < low["optimizer_state_mb"] < full["optimizer_state_mb"]
    assert full["tokens_per_s"] > 0 and low["tokens_per_s"] > 0 and r["tokens_per_s_ratio"] > 0
    assert r["peak_memory_measure"] == "peak_rss_gb" and low["peak_rss_gb"] > 0   # CPU


@pytest.mark.slow
def test_sync():  # launches itself under torchrun: 1 trainer + 1 engine
    r = run(BENCH / "sync.py", "--mb", "1", "--tensors", "2", "--repeat", "1", "--no-tiny")
    assert r["bytes"] == 2**20 and r["tensors"] == 2 and r["engines"] == 1 and r["sync_s"] > 0


@pytest.mark.slow
def test_e2e():
    """One synchronous and one overlapped torchrun run of 2 steps (1 pooled), launched through
    the tests' warm launcher (GRPO_BENCH_LAUNCH: the same torchrun and train.py, forked from the
    warm server instead of importing afresh); the script's default launch command is checked
    against the real one."""
    import importlib.util
    import json
    e = env(warm=True)
    torchrun, entry = torchrun_parts(warm=True)
    e["GRPO_BENCH_LAUNCH"] = json.dumps({"torchrun": torchrun, "entry": entry})
    r = run(BENCH / "e2e.py", "--steps", "2", "--warmup", "1", "--nproc", "2", "--rounds", "1",
            timeout=600, e=e)
    assert r["sync_step_s"] > 0 and r["overlap_step_s"] > 0
    spec = importlib.util.spec_from_file_location("bench_e2e", BENCH / "e2e.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.launcher() == torchrun_parts(warm=False)  # without GRPO_BENCH_LAUNCH: the real one


@pytest.mark.slow
def test_e2e_staleness():
    """`--staleness 0,2 --partial`: one JSON object per run (k = 0, k = 2, k = 2 partial)."""
    e = env(warm=True)
    torchrun, entry = torchrun_parts(warm=True)
    e["GRPO_BENCH_LAUNCH"] = json.dumps({"torchrun": torchrun, "entry": entry})
    p = subprocess.run([sys.executable, str(BENCH / "e2e.py"), "--staleness", "0,2", "--partial",
                        "--steps", "4", "--warmup", "1", "--max-new-tokens", "8", "--rounds", "1"],
                       cwd=ROOT, env=e, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = [json.loads(x) for x in p.stdout.strip().splitlines()]
    assert [(r["staleness"], r["partial"]) for r in rows] == [(0, False), (2, False), (2, True)]
    for r in rows:
        assert {"tokens_per_s", "engine_idle_frac", "trainer_wait_frac", "staleness_mean",
                "staleness_max", "wall_s_to_reward"} <= set(r) and r["tokens_per_s"] > 0
    assert rows[0]["staleness_max"] == 0 and 1 <= rows[1]["staleness_max"] <= 2


@pytest.mark.slow
def test_e2e_engine_time():
    """`--engine-time`: k = 2 with partial off, "recompute" and "keep" on the modelled engine
    (bench/engine_time.py, launched as a module through the warm launcher), one JSON object."""
    e = env(warm=True)
    torchrun, entry = torchrun_parts(warm=True)
    e["GRPO_BENCH_LAUNCH"] = json.dumps({"torchrun": torchrun, "entry": entry})
    r = run(BENCH / "e2e.py", "--engine-time", "8b-h100", "--engine-scale", "0.2", "--staleness", "2",
            "--steps", "4", "--warmup", "1", "--rounds", "1", "--real-rounds", "0", timeout=600, e=e)
    assert r["engine_time"]["scale"] == 0.2 and r["real"] == []
    rows = {row["partial"]: row for row in r["modelled"]}
    assert list(rows) == [False, "recompute", "keep"] and all(x["staleness"] == 2 for x in rows.values())
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and 0 <= row["engine_idle_frac"] <= 1 and row["staleness_max"] <= 2
    assert rows["keep"]["reprefill_tokens"] == 0 and rows[False]["reprefill_tokens"] == 0
    assert rows[False]["batches_in_flight"] == 1 and rows["keep"]["batches_in_flight"] >= 2  # k + 1 = 3 may
    assert set(r["verdict"]["keep_over_recompute"]) == {"2"}


@pytest.mark.slow
def test_vs_trl_our_side():
    r = run(BENCH / "vs_trl.py", "--sides", "ours_world1", "--rounds", "1", "--steps", "2",
            "--warmup", "1")
    assert r["setup"]["steps"] == 2 and r["ours_world1"]["steps_pooled"] == 1


@pytest.mark.slow
def test_step_grpo():
    """`--grpo`: one optimizer step as update.py runs it, its phases apart, operators and host
    syncs counted per micro-batch with the profiler."""
    r = run(BENCH / "step.py", "--grpo", "--prompts", "1", "--steps", "1", "--warmup", "0",
            "--max-new-tokens", "64")
    assert r["mode"] == "grpo" and r["layout"] == "segments" and r["adamw"] == "foreach"   # CPU
    assert r["forward_backward_s"] > 0 and r["optimizer_s"] > 0 and r["tflops_per_s"] > 0
    assert set(r["peak_memory_mb"]) == {"forward_backward", "optimizer"}
    assert len(r["per_microbatch"]) == r["micro_batches"] == len(r["images_per_microbatch"]) >= 1
    assert r["aten_ops_per_microbatch"] > 1000 and r["host_syncs_per_microbatch"] >= 1  # the read
    # the contract's count is the top-level operators; the nested total is their decomposition
    assert r["aten_ops_nested_per_microbatch"] > r["aten_ops_per_microbatch"]
    assert all(o["aten_ops_nested"] > o["aten_ops"] > 0 for o in r["per_microbatch"])
    assert r["host_reads_per_microbatch"] > 0                   # the plan, built on the host


@pytest.mark.slow
def test_step_head():
    """`--head N`: the head's peak chunked and full, each in a process of its own (fake tensors:
    nothing allocated; the full head of 8,192 tokens needs ~32 GB)."""
    r = run(BENCH / "step.py", "--head", "8192", "--head-measure", "fake")
    assert r["mode"] == "head" and r["vocab"] == 151936 and r["hidden"] == 2048
    assert r["head_peak_mb"] <= r["head_peak_mb_full"] / 8          # issue 51's acceptance


@pytest.mark.slow  # a fresh interpreter, as the other scripts
def test_colocate():
    """bench/colocate.py at device_check.sh's CPU size: one colocated step (generate, sleep,
    train, wake, load) in one process; its memory figures are 0 on the CPU, its load time not."""
    r = run(BENCH / "colocate.py", "--model", "tiny", "--prompts", "2", "--prompt-len", "16",
            "--new-tokens", "8", "--seq-len", "64")
    assert r["model"] == "tiny" and r["prompts"] == 2 and r["load_s"] > 0
    assert {"peak_generate_gb", "peak_train_gb", "sleep_freed_gb", "sleep_s", "wake_s"} <= set(r)

