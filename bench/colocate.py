"""One colocated step's memory on one device (bench/device_check.sh's `colocate` step): a trainer
and an HF engine (hf_engine.HFEngine's own sleep / wake_up) sharing the device, Qwen2.5-VL-3B's
architecture at random init (nothing downloaded; `--model tiny` on CPU), bf16 weights.

    python bench/colocate.py --model 3b --prompts 8 --new-tokens 256

The step as train.py runs it colocated: generate (engine awake, the trainer's parameters and
AdamW state resident) -> engine.sleep() -> train (one optimizer step on a micro-batch of
--seq-len tokens, activation checkpointing) -> wake_up -> the weights copied into the engine.
Prints one JSON object: the peak device memory of the generate and the train phase, the memory
the engine's sleep freed, and the seconds of sleep, wake and load (memory figures are 0 on CPU).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import device as D  # noqa: E402
import families as F  # noqa: E402
import model as M  # noqa: E402
from bench.step import QWEN25_VL_3B  # noqa: E402
from hf_engine import HFEngine  # noqa: E402


def build(kind: str, device: torch.device):
    if kind == "tiny":
        return M.load_model(str(F.build_tiny(Path(tempfile.gettempdir()) / "grpo-bench-tiny")),
                            dtype=torch.bfloat16, device=device)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    with torch.device(device):
        return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**QWEN25_VL_3B)).to(torch.bfloat16)


def timed(dev: D.Device, fn) -> float:
    D.synchronize(dev)
    t0 = time.perf_counter()
    fn()
    D.synchronize(dev)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "3b"], default="tiny")
    ap.add_argument("--prompts", type=int, default=8, help="rows the engine generates at once")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens of the train micro-batch")
    a = ap.parse_args()
    dev = D.detect()
    device = D.torch_device(dev, 0)
    torch.manual_seed(0)
    policy = build(a.model, device).train()
    policy.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6, **D.adamw_options(device.type))
    engine = HFEngine.__new__(HFEngine)  # the engine's own sleep / wake_up on a built model
    engine.model, engine.device, engine.asleep = build(a.model, device).eval(), device, False
    vocab = policy.config.text_config.vocab_size

    def train_step() -> None:
        ids = torch.randint(10, min(vocab, 1000), (1, a.seq_len), device=device)
        policy(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def generate() -> None:
        ids = torch.randint(10, min(vocab, 1000), (a.prompts, a.prompt_len), device=device)
        with torch.no_grad():
            engine.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                  max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                                  output_logits=True, return_dict_in_generate=True, pad_token_id=0)

    engine.sleep()
    train_step()  # AdamW's state exists from here, as in every step after the first
    engine.wake_up()
    D.reset_peak_memory(dev)
    generate()
    peak_generate = D.peak_memory_gb(dev)
    before = D.allocated_gb(dev)
    sleep_s = timed(dev, engine.sleep)
    freed = before - D.allocated_gb(dev)
    D.reset_peak_memory(dev)
    train_step()
    peak_train = D.peak_memory_gb(dev)
    wake_s = timed(dev, lambda: engine.wake_up(["weights"]))
    with torch.no_grad():
        load_s = timed(dev, lambda: [e.copy_(p) for e, p in zip(engine.model.parameters(), policy.parameters())])
    engine.wake_up(["kv_cache"])
    print(json.dumps({
        "device": D.device_name(dev), "model": a.model, "dtype": "bf16", "prompts": a.prompts,
        "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "seq_len": a.seq_len,
        "peak_generate_gb": round(peak_generate, 3), "peak_train_gb": round(peak_train, 3),
        "sleep_freed_gb": round(freed, 3), "sleep_s": round(sleep_s, 4), "wake_s": round(wake_s, 4),
        "load_s": round(load_s, 4)}))


if __name__ == "__main__":
    main()
