"""Trainer step throughput and model FLOPs utilisation (MFU) of the real training path.

    python bench/step.py                                   # tiny model, CPU, fp32
    python bench/step.py --model 3b --seq-len 2048 --bf16  # Qwen2.5-VL-3B architecture, random init
    python bench/step.py --lora-rank 8                     # the same step with and without LoRA

One process, FSDP2 over a world of one (the trainer's wrapping), `model.sequence_logprobs` +
`loss.policy_loss` + backward + AdamW: exactly what train.py runs per micro-batch. The sequence
holds one image (`--image-px` square, its patch tokens counted in the sequence length) followed
by text; the second half of the text is the "response". `--model 3b` builds Qwen2.5-VL-3B's
architecture from its published config numbers with random weights (nothing is downloaded).

FLOPs per step (forward + backward = 3 x forward), counted as matmul FLOPs only:
- text: 6 * N_text * T + 12 * layers * hidden * T^2 (N_text: decoder + lm_head parameters,
  embeddings excluded; the attention term counts the full T x T score and value matmuls);
- vision: 6 * N_vision * P + 12 * depth * hidden_v * P^2 (P patches; windowed blocks counted as
  full attention, a slight over-count for images larger than one window).
MFU = FLOPs / step time / peak. Peak: `--peak-tflops`, else a table by device name (H200/H100
bf16 dense 989 TFLOP/s, A100 312, Ascend 910B 313); null on CPU. Prints one JSON object, with
`checkpoint_calls_per_step`: the layer forwards recomputed during the backward of one step
(vision blocks + decoder layers with `--checkpointing`; 0 means checkpointing is not active).

`--lora-rank R`: the step twice, side by side in one JSON object, each in a process of its own
(so each peak is its own): every parameter training, and LoRA of rank R on every linear layer of
the language model (lora.py, as `[model] lora_rank`; alpha 2R), with `trainable_params`,
`optimizer_state_mb` and the ratios. Peak memory: the accelerator's allocator peak, or on the
CPU the process's peak resident set (`peak_rss_gb`: Python, torch and the model included). FLOPs
use the 6 N convention for both (a LoRA step skips the frozen weights' gradient matmuls, about a
third of the step's; its MFU is then overstated by up to that much).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "910B": 313.0}

# Qwen2.5-VL-3B-Instruct's config.json numbers (published with the model).
QWEN25_VL_3B = dict(
    text_config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                     num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                     max_position_embeddings=128000, rms_norm_eps=1e-6, tie_word_embeddings=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                      "mrope_section": [16, 24, 24]}),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                       out_hidden_size=2048, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                       tokens_per_second=2),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
    vision_end_token_id=151653, tie_word_embeddings=True)


def count_params(model) -> tuple[int, int]:
    text = sum(p.numel() for n, p in model.named_parameters()
               if "visual" not in n and "embed_tokens" not in n)
    if getattr(model.config.text_config, "tie_word_embeddings", False) or model.config.tie_word_embeddings:
        text += model.lm_head.weight.numel()  # tied: the lm_head matmul still runs
    vision = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
    return text, vision


def flops_per_step(model, T: int, P: int, counts: tuple[int, int] | None = None) -> float:
    tc, vc = model.config.text_config, model.config.vision_config
    n_text, n_vis = counts or count_params(model)
    text = 6 * n_text * T + 12 * tc.num_hidden_layers * tc.hidden_size * T * T
    vision = 6 * n_vis * P + 12 * vc.depth * vc.hidden_size * P * P
    return float(text + vision)


def main() -> None:
    a = parse()
    if a.lora_rank and a.one is None:  # both variants, each in its own process
        import subprocess
        runs = {}
        for name, rank in (("full", 0), ("lora", a.lora_rank)):
            args = sys.argv[1:] + ["--one", str(rank)]
            out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"bench/step.py ({name}) failed:\n{out.stderr[-3000:]}")
            runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
        full, lora = runs["full"], runs["lora"]
        peak = "peak_memory_gb" if full["peak_memory_gb"] else "peak_rss_gb"
        print(json.dumps({"lora_rank": a.lora_rank, "full": full, "lora": lora,
                          "tokens_per_s_ratio": round(lora["tokens_per_s"] / full["tokens_per_s"], 3),
                          "peak_memory_ratio": round(lora[peak] / full[peak], 3),
                          "peak_memory_measure": peak}))
        return
    run_one(a, a.lora_rank if a.one is None else a.one)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "3b"], default="tiny")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--image-px", type=int, default=112)
    ap.add_argument("--bf16", action="store_true", help="FSDP2 bf16 mixed precision")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float)
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="also run the step with LoRA of this rank, side by side")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # internal: one variant
    return ap.parse_args(argv)


def run_one(a, lora_rank: int) -> None:
    """One variant of the step (LoRA of `lora_rank`, 0: every parameter); prints its JSON."""
    import resource

    import torch
    import torch.distributed as dist
    from PIL import Image
    from torch.distributed.device_mesh import DeviceMesh

    import device as D
    import families as F
    import inputs as I
    import loss as L
    import model as M
    import world as W
    from tests.util import CheckpointCounter

    dev = D.detect()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # a free port, as train.py's world of one: a fixed one collided with a second bench process
    # (the tests run bench/step.py from two modules at once)
    os.environ.setdefault("MASTER_PORT", str(W.free_port()))
    dist.init_process_group(dev.backend, rank=0, world_size=1)
    device = D.torch_device(dev, 0)
    if a.model == "tiny":
        path = str(F.build_tiny(Path(tempfile.gettempdir()) / "grpo-bench-tiny"))
        model = M.load_model(path, device=device)
        ip = I.load_image_processor(path, 56 * 56, a.image_px ** 2)
    else:
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        cfg = Qwen2_5_VLConfig(**QWEN25_VL_3B)
        with torch.device(device):
            model = Qwen2_5_VLForConditionalGeneration(cfg).to(torch.float32)
        ip = F.image_processor_cls()(min_pixels=56 * 56, max_pixels=a.image_px ** 2)
    tc = model.config
    tokens = I.Tokens(image_pad=tc.image_token_id, vision_start=tc.vision_start_token_id,
                      vision_end=tc.vision_end_token_id, eos=1, pad=0,
                      vocab_size=tc.text_config.vocab_size, suppressed=())
    n_text, n_vis = count_params(model)
    flops_model = model
    if lora_rank:  # as trainer.build: adapters on the language model's linear layers
        import config as C
        import lora
        model = lora.add_lora(model, C.ModelConfig(lora_rank=lora_rank, lora_alpha=2.0 * lora_rank))
    model.train()  # as trainer.build: transformers checkpoints layers only in train mode
    M.apply_fsdp(model, DeviceMesh.from_group(dist.group.WORLD, dev.kind),
                 mixed_precision=a.bf16, checkpointing=a.checkpointing)
    count = CheckpointCounter(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-6)

    img = Image.new("RGB", (a.image_px, a.image_px), (200, 100, 50))
    mm = I.image_inputs(ip, [img] * a.batch)
    n_img = I.n_image_tokens(mm["image_grid_thw"])[0]
    n_patches = int(mm["image_grid_thw"][0].prod())
    T = a.seq_len
    if T <= n_img + 8:
        raise SystemExit(f"--seq-len {T} must exceed the image's {n_img} tokens")
    g = torch.Generator().manual_seed(0)
    # ordinary tokens only: the special (vision/chat) ids sit above these in both tokenizers
    top = min(tc.image_token_id, tc.video_token_id, tc.vision_start_token_id, tc.vision_end_token_id) - 10
    text = torch.randint(2, top, (a.batch, T - n_img - 2), generator=g)
    ids = torch.cat([torch.full((a.batch, 1), tokens.vision_start),
                     torch.full((a.batch, n_img), tokens.image_pad),
                     torch.full((a.batch, 1), tokens.vision_end), text], 1)
    resp = torch.zeros_like(ids)
    resp[:, T - (T - n_img) // 2:] = 1
    none = torch.zeros(())  # the counts the metrics read: not read here
    batch = M.MicroBatch(ids, torch.ones_like(ids), resp, torch.zeros(ids.shape), torch.full_like(ids, -1),
                         none, none, none, mm["pixel_values"], mm["image_grid_thw"]).to(device)
    adv = torch.randn(a.batch, device=device)

    times, recomputed = [], []
    for i in range(a.warmup + a.steps):
        D.synchronize(dev)
        count.reset()
        t0 = time.perf_counter()
        lp, _ = M.sequence_logprobs(model, batch, tokens, 1.0)
        mask = batch.response_mask.float()
        loss, _ = L.policy_loss(lp, lp.detach(), adv, mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        D.synchronize(dev)
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
            recomputed.append(count.recomputes)
    step_s = statistics.median(times)
    flops = flops_per_step(flops_model, T, n_patches, (n_text, n_vis)) * a.batch
    peak = a.peak_tflops
    if peak is None and dev.kind != "cpu":
        name = D.device_name(dev)
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    print(json.dumps({
        "model": a.model, "device": D.device_name(dev), "dtype": "bf16-mixed" if a.bf16 else "fp32",
        "params_text": n_text, "params_vision": n_vis, "seq_len": T, "batch": a.batch,
        "image_tokens": n_img, "step_s": round(step_s, 4),
        "tokens_per_s": round(T * a.batch / step_s, 1),
        "tflops_per_s": round(flops / step_s / 1e12, 4),
        "mfu": round(flops / step_s / 1e12 / peak, 4) if peak else None,
        "peak_memory_gb": round(D.peak_memory_gb(dev), 2),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "lora_rank": lora_rank, "trainable_params": sum(p.numel() for p in trainable),
        "optimizer_state_mb": round(sum(v.numel() * v.element_size() for st in opt.state.values()
                                        for v in st.values() if torch.is_tensor(v)) / 2**20, 3),
        "checkpointing": a.checkpointing, "checkpoint_calls_per_step": max(recomputed)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
