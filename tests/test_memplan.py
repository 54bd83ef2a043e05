"""The memory plan (memplan.py) against docs/memory.md's formulas, written out here by hand from
the published shape of Qwen2.5-VL-3B (3.75B parameters; hidden 2048, 36 layers, MLP 11008, 2 KV
heads of 128), for the three EasyR1 layouts on one device: full on 40 GiB (bf16 master weights)
and on 80 GiB (fp32 master, bf16 compute), LoRA on 24 GiB; each term within 15%, each plan
fitting, and a plan that cannot fit refused in one line naming the knob."""
from __future__ import annotations

import re

import pytest

import config as C
import memplan as MP
from errors import ConfigError
from tests.util import ROOT

EASYR1 = str(ROOT / "configs" / "vl3b_easyr1.toml")
ONE_GPU = ["--cluster.colocate=true", "--rollout.engine=vllm", "--train.micro_batch_tokens=8192",
           "--sync.bucket_mb=256"]
LAYOUTS = {
    "full, 40 GiB": (40, ["--model.mixed_precision=false", "--train.master_dtype=bfloat16",
                          "--rollout.gpu_memory_utilization=0.28"]),
    "full, 80 GiB": (80, ["--rollout.gpu_memory_utilization=0.25"]),
    "LoRA, 24 GiB": (24, ["--model.lora_rank=64", "--rollout.gpu_memory_utilization=0.35"]),
}
P, H, L, I, KV, V = 3.75e9, 2048, 36, 11008, 256, 151936
GIB = 2**30


def docs_terms(mem: float, lora: int, master: int, util: float) -> dict[str, float]:
    """docs/memory.md's formulas, one device, micro-batch of N = 8192 tokens, bf16 compute."""
    n = 8192
    lora_p = L * lora * ((H + H) * 2 + (H + KV) * 2 + (H + I) * 3)  # every linear of the LM
    trainable = lora_p if lora else P
    state = 4 if lora else master
    return {
        "parameters": (P - lora_p) * master + lora_p * 4 if lora else P * master,
        "reference": 0 if lora else P * master,
        "gradients": trainable * state,
        "optimizer": 2 * trainable * state,
        "activations": L * n * H * 2 + n * 2 * (7 * H + 2 * KV + 4 * I) + 3 * 256 * 2**20,
        "engine (gpu_memory_utilization)": util * mem * GIB,
        "engine weights": P * 2,
    }


@pytest.mark.parametrize("name", LAYOUTS)
def test_easyr1_layouts_within_15_percent_of_the_docs(name):
    mem, extra = LAYOUTS[name]
    cfg = C.load(EASYR1, [*ONE_GPU, *extra, f"--cluster.device_memory_gib={mem}"])
    master = 4 if cfg.model.mixed_precision or cfg.train.master_dtype == "float32" else 2
    want = docs_terms(mem, cfg.model.lora_rank, master, cfg.rollout.gpu_memory_utilization)
    lines = MP.plan_lines(cfg, 1)          # fits: no ConfigError
    assert len(lines) == 4 and "generate" in lines[1] and "train" in lines[2], lines
    shape = MP.shape_of(cfg.model.path)
    for phase, parts in MP.phases(cfg, shape, 1, mem * GIB, "full").items():
        assert sum(parts.values()) <= mem * GIB, (phase, parts)
        for term, got in parts.items():
            if term in want and want[term]:
                assert abs(got / want[term] - 1) <= 0.15, (name, phase, term, got / GIB, want[term] / GIB)


def test_a_plan_that_cannot_fit_names_the_knob():
    full = C.load(EASYR1, [*ONE_GPU, "--cluster.device_memory_gib=24"])
    with pytest.raises(ConfigError, match=r"^memory plan: the generate phase needs .* of a 24 GiB "
                                          r"device; set model.lora_rank > 0 \(LoRA\), or launch more ranks$"):
        MP.plan_lines(full, 1)
    lora = C.load(EASYR1, [*ONE_GPU, "--model.lora_rank=64", "--rollout.gpu_memory_utilization=0.35",
                           "--cluster.device_memory_gib=24", "--train.micro_batch_tokens=262144"])
    with pytest.raises(ConfigError, match="the train phase .* lower train.micro_batch_tokens"):
        MP.plan_lines(lora, 1)


def test_unknown_shape_and_unjudged_device():
    cfg = C.load(None, ["--model.path=someone/unknown-model"])
    assert "not known" in MP.plan_lines(cfg, 1)[0]
    cfg = C.load(EASYR1, [])
    lines = MP.plan_lines(cfg, 8)       # the static split, device memory not given: printed only
    assert "not judged" in lines[0] and lines[1].startswith("   train (trainer device)"), lines


def test_too_large_an_engine_share_names_it_and_what_fits():
    cfg = C.load(EASYR1, [*ONE_GPU, "--cluster.device_memory_gib=80", "--rollout.gpu_memory_utilization=0.6"])
    with pytest.raises(ConfigError, match=r"lower rollout.gpu_memory_utilization \(at most 0.30 fits\)"):
        MP.plan_lines(cfg, 1)


VL3B = str(ROOT / "configs" / "vl3b.toml")  # Qwen2.5-VL-3B, 8 trainers, 4 x 2,560-token micro-batches
SAY = 'activation checkpointing: model.activation_checkpointing = "auto" -> '


@pytest.mark.parametrize("mem, mode, why", [
    (80, "off", r'"off": its train phase needs 48\.5 of 80 GiB \(cluster\.device_memory_gib\)$'),
    (40, "selective", r'"selective": its train phase needs 31\.7 of 40 GiB .*; "off" would need 48\.5$'),
    (16, "full", r'"full": its train phase needs 10\.6 of 16 GiB .*; "off" would need 48\.5; "selective" would need 31\.7$'),
    (8, "full", r'"full": no mode\'s train phase fits 8 GiB .*; "full" would need 10\.6$'),
    (0, "full", r'"full" \(cluster\.device_memory_gib not given: the safe choice\)$'),
])
def test_auto_checkpointing_is_the_cheapest_mode_that_fits(mem, mode, why):
    """model.activation_checkpointing = "auto" at vl3b.toml's shapes: the first of off, selective,
    full whose train phase (8 trainers: parameters to activations) fits the device; "full" where
    none fits or the device is not given, each with the line that says why. The plan's own
    activations term is the chosen mode's, and the plan ends with the line."""
    cfg = C.load(VL3B, ["--model.activation_checkpointing=auto", f"--cluster.device_memory_gib={mem}"])
    got, line = MP.checkpointing(cfg, 8)
    assert got == mode and line.startswith(SAY), line
    assert re.search(why, line), line
    if mem == 8:  # none fits: the plan refuses, at full's figure
        with pytest.raises(ConfigError, match=r"the train \(trainer device\) phase needs 10\.6 GiB of a 8 GiB"):
            MP.plan_lines(cfg, 8)
    elif mem:
        lines = MP.plan_lines(cfg, 8)
        train = {"off": 48.5, "selective": 31.7, "full": 10.6}[mode]
        assert lines[-1] == f"   {line}" and lines[1].startswith(f"   train (trainer device): {train} ="), lines
    set_to = C.load(VL3B, [f"--model.activation_checkpointing={mode}", f"--cluster.device_memory_gib={mem}"])
    assert MP.checkpointing(set_to, 8) == (mode, "")  # a mode the user wrote is kept, no line


def test_auto_checkpointing_of_an_unknown_shape_is_full():
    cfg = C.load(None, ["--model.path=someone/unknown-model", "--model.activation_checkpointing=auto",
                        "--cluster.device_memory_gib=80"])
    assert MP.checkpointing(cfg, 1) == ("full", SAY + '"full" (the shape of someone/unknown-model is not '
                                        "known: the safe choice)")
    assert MP.plan_lines(cfg, 1)[1] == MP.checkpointing(cfg, 1)[1]


def test_auto_never_reaches_the_sharding_unresolved():
    import sharding
    with pytest.raises(ValueError, match='"auto" reached the sharding unresolved'):
        sharding.checkpointing_options("auto")
    assert [sharding.checkpointing_mode(v) for v in (True, False, "selective")] == ["full", "off", "selective"]


def test_dry_run_prints_the_auto_choice(monkeypatch, capsys):
    import train
    monkeypatch.setenv("GRPO_DEVICE", "cuda")
    assert train.main(["--config", VL3B, "--model.activation_checkpointing=auto",
                       "--cluster.device_memory_gib=80", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f'   {SAY}"off": its train phase needs 48.5 of 80 GiB' in out, out[-2000:]
    assert "activations 41.2" in out  # the plan's own term is off's (full: 3.3)
