"""The memory plan (memplan.py) against docs/memory.md's formulas, written out here by hand from
the published shape of Qwen2.5-VL-3B (3.75B parameters; hidden 2048, 36 layers, MLP 11008, 2 KV
heads of 128), for the three EasyR1 layouts on one device: full on 40 GiB (bf16 master weights)
and on 80 GiB (fp32 master, bf16 compute), LoRA on 24 GiB; each term within 15%, each plan
fitting, and a plan that cannot fit refused in one line naming the knob."""
from __future__ import annotations

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
    for phase, parts in MP.phases(cfg, shape, 1, mem * GIB).items():
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
