"""Packed rows against padded micro-batches of the same token budget, on long-tailed lengths.

    python bench/packing.py                      # tiny Qwen2.5-VL, CPU, fp32
    python bench/packing.py --no-share-prompt    # one sequence per episode (no shared prompts)
    python bench/packing.py --shapes 3b --layers 1 --prompts 8   # Qwen2.5-VL-3B's text layers

The workload: `--prompts` synthetic geometry prompts x `--group` responses whose lengths are
long-tailed as GRPO's are (half 8-32 tokens, a tenth at `--max-new-tokens`, the rest between;
seeded), random ordinary tokens. Three layouts run the trainer's own path (`update.plan` ->
`update.accumulate_gradients`: forward + backward of every micro-batch, one mini-batch),
alternating, `--reps` times each; the median time counts:
- "padded": micro-batches of `--rows` sequences in the step's order, each padded to its longest
  (`train.micro_batch_size`, the reference configs' layout);
- "packed": `train.packing = true` with the same token budget (`train.micro_batch_tokens = 0`:
  `--rows` x the longest sequence), one row per micro-batch (the device's layout, or the one
  `--layout` names: "segments" is attention.py's kernel);
- "padded_sorted": the token-budget planner (`train.micro_batch_tokens` = that budget), which
  sorts the sequences by length before padding them: the strongest padded baseline.
`--shapes 3b`: Qwen2.5-VL-3B's decoder layers (hidden 2048, 16 heads, 2 KV heads, head dim
128, MLP 11008), `--layers` of them, with the tiny vision tower and vocabulary.
`rank_token_imbalance` is `microbatches.rank_shares` over 2 trainer ranks: contiguous slices
(padded) against the balanced split (packed). `exact`: the loss and gradients of a last, untimed
pass of the packed layout against the padded one's (fp32: ~1e-7). The device is the one
`device.detect` finds (GRPO_DEVICE forces one); `--bf16` / `--checkpointing` as the trainer's
`model.mixed_precision` / `model.activation_checkpointing`. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from dataclasses import replace
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def lengths(n: int, max_new: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        u = rng.random()
        out.append(rng.randint(8, 32) if u < 0.5 else max_new if u < 0.6 else rng.randint(33, max_new - 1))
    return out


def workload(a, procs):
    import data
    import inputs as I
    import episode as R
    import synthetic
    problems = synthetic.make_synthetic(a.prompts, seed=3)
    rng = random.Random(a.seed)
    top = min(procs.tokens.image_pad, procs.tokens.vision_start, procs.tokens.pad, procs.tokens.eos) - 1
    lens = lengths(a.prompts * a.group, a.max_new_tokens, a.seed)
    eps = []
    for g, p in enumerate(problems):
        prompt = I.prompt_ids(procs, data.user_text(p), len(p.images))
        for k in range(a.group):
            n = lens[g * a.group + k]
            eps.append(R.Episode(p.index, g, prompt, [rng.randrange(3, top) for _ in range(n)],
                                 [0.0] * n, float(rng.random() < 0.5), {}, 0, n == a.max_new_tokens))
    return eps, {p.index: p.images for p in problems}


def run(a) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import device as D
    import families as F
    import inputs as I
    import microbatches as MB
    import model as M
    import sharding
    import update as U
    import world as W
    from train import load_config

    dev = D.detect()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(W.free_port()))
    dist.init_process_group(dev.backend, rank=0, world_size=1)
    device = D.torch_device(dev, 0)
    path = str(F.build_tiny(Path(tempfile.gettempdir()) / "grpo-bench-tiny"))
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    eps, images = workload(a, procs)
    model = M.load_model(path, device=device) if a.shapes == "tiny" else shaped_3b(path, a.layers, device)
    policy = sharding.apply_fsdp(model.train(), DeviceMesh.from_group(dist.group.WORLD, dev.kind),
                          mixed_precision=a.bf16, checkpointing=a.checkpointing)
    world = SimpleNamespace(trainers=[0], trainer_index=0, train_group=dist.group.WORLD)
    tr = dict(policy=policy, ref=None, base_ref=False, device=device, pixels={}, kl_coef=None, version=0,
              teacher=None, base_teacher=False)
    base = [f"--rollout.max_new_tokens={a.max_new_tokens}", f"--rollout.group_size={a.group}",
            f"--train.micro_batch_size={a.rows}", f"--train.share_prompt={str(a.share_prompt).lower()}"]
    packed = f"--train.packing={a.layout or 'true'}"
    share = MB.resolve_layout(load_config(None, base + [packed]).train, procs, path, device)[0].share_prompt
    budget = a.rows * max(MB._units(eps, list(range(len(eps))), images, procs, share)[1])
    variants = {"padded": base + ["--train.packing=false"], "packed": base + [packed],
                "padded_sorted": base + ["--train.packing=false", f"--train.micro_batch_tokens={budget}"]}
    row = D.TABLE[dev.kind]
    ratios = {"packed": row.bucket_ratio} | {f"packed@{r:g}": r for r in a.bucket_ratios}
    variants |= {name: variants["packed"] for name in ratios if name != "packed"}
    steps, times, stats, attention, peak, grads = {}, {k: [] for k in variants}, {}, {}, {}, {}
    layouts = {}
    for name, over in variants.items():
        cfg = load_config(None, over)
        # the row layout and attention the trainer builds its models with (train.set_up, trainer.build)
        layouts[name] = MB.resolve_layout(cfg.train, procs, path, device)[0]
        attention[name] = M.attention_for(layouts[name].packed)
        s = U.Step(SimpleNamespace(**tr, layout=layouts[name]), world, procs, cfg.train, cfg.loss,
                   cfg.rollout, 0, 0, eps, images)
        U.plan(s)
        U.denominators(s)
        U.advantages(s)
        steps[name] = s
    for rep in range(a.reps + 1):  # the last pass keeps each layout's gradients (not timed)
        for name, s in steps.items():
            policy.set_attn_implementation(attention[name])
            # the "segments" kernel's bucket ratio for this variant (device.Device.bucket_ratio)
            D.TABLE[dev.kind] = replace(row, bucket_ratio=ratios.get(name, row.bucket_ratio))
            policy.zero_grad(set_to_none=True)
            D.synchronize(dev)
            D.reset_peak_memory(dev)
            t0 = time.perf_counter()
            stats[name] = U.accumulate_gradients(s, s.updates[0])
            D.synchronize(dev)
            if rep < a.reps:
                times[name].append(time.perf_counter() - t0)
                peak[name] = max(peak.get(name, 0.0), D.peak_memory_gb(dev))
            else:
                grads[name] = {n: p.grad.full_tensor().float() for n, p in policy.named_parameters()
                               if p.grad is not None} if name in ("padded", "packed") else {}
    out = {}
    for name, st in stats.items():
        t = statistics.median(times[name])
        out[name] = {"tokens_per_s": round(st["episode_tokens"] / t, 1), "step_s": round(t, 4),
                     "padding_frac": round(1 - st["tokens"] / st["slots"], 4),
                     "attention_frac": round(st["pairs"] / st["episode_pairs"], 4),
                     "micro_batches": int(st["micro_batches"]), "attention": attention[name]}
    D.TABLE[dev.kind] = row
    imb = {}
    for name, variant in (("padded", "padded"), ("balanced", "packed")):
        imb[name] = round(MB.rank_shares(eps, images, procs, load_config(None, variants[variant]).train,
                                         layouts[variant], 2)[1], 4)
    dist.destroy_process_group()
    tps = {k: v["tokens_per_s"] for k, v in out.items()}
    return {"workload": {"model": f"{a.shapes} qwen2_5_vl" + (f", {a.layers} layer(s)" if a.shapes != "tiny" else ""),
                         "device": D.device_name(dev), "dtype": "bf16-mixed" if a.bf16 else "fp32",
                         "checkpointing": a.checkpointing,
                         "prompts": a.prompts, "group": a.group, "max_new_tokens": a.max_new_tokens,
                         "rows": a.rows, "budget": budget, "share_prompt": a.share_prompt,
                         "tokens": int(stats["padded"]["episode_tokens"]), "reps": a.reps},
            "padded": out["padded"], "packed": out["packed"], "padded_sorted": out["padded_sorted"],
            "speedup": round(tps["packed"] / tps["padded"], 3),
            "speedup_vs_sorted": round(tps["packed"] / tps["padded_sorted"], 3),
            "rank_token_imbalance": imb, "exact": exactness(stats, grads),
            "bucket_ratios": {f"{r:g}": {"speedup": round(tps[n] / tps["padded"], 3),
                                         "attention_frac": out[n]["attention_frac"]}
                              for n, r in ratios.items()} if len(ratios) > 1 else None,
            "peak_memory_gb": {k: round(v, 2) for k, v in peak.items()} if dev.kind != "cpu" else None}


def exactness(stats: dict, grads: dict) -> dict:
    """Packed against padded on the same episodes: the summed entropy of the response tokens
    (it depends on every logit; the loss's value does not, its ratio being 1) and the largest
    gradient difference, each relative (fp32: ~1e-7; bf16: its rounding)."""
    pk, pd = grads["packed"], grads["padded"]
    top = max(float(g.abs().max()) for g in pd.values())
    diff = max(float((pk[n] - g).abs().max()) for n, g in pd.items())
    ent = stats["padded"]["entropy"]
    return {"entropy_rel_diff": abs(stats["packed"]["entropy"] - ent) / abs(ent),
            "grad_max_rel_diff": diff / top if top else diff}


def shaped_3b(path: str, layers: int, device):
    """A random model with Qwen2.5-VL-3B's decoder layers (`layers` of them) on the tiny
    folder's vocabulary and vision tower (its output projected to the 3B's hidden size)."""
    import families as F
    import model as M
    config = M.load_config(path)
    t = config.text_config
    t.hidden_size, t.intermediate_size, t.num_hidden_layers = 2048, 11008, layers
    t.num_attention_heads, t.num_key_value_heads, t.head_dim = 16, 2, 128
    t.rope_parameters = {**t.rope_parameters, "mrope_section": [16, 24, 24]}  # 3B's: head_dim / 2
    t.layer_types = ["full_attention"] * layers
    config.vision_config.out_hidden_size = 2048
    with device:  # built where it runs (a 3B-sized model's random init on the host is slow)
        return F.auto_class(config).from_config(config, attn_implementation="sdpa")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--rows", type=int, default=8, help="train.micro_batch_size of the padded layout")
    ap.add_argument("--shapes", choices=["tiny", "3b"], default="tiny")
    ap.add_argument("--layers", type=int, default=1, help="decoder layers with --shapes 3b")
    ap.add_argument("--no-share-prompt", dest="share_prompt", action="store_false")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layout", choices=["segments", "varlen"],
                    help="the packed layout (train.packing's name for it); default the device's")
    ap.add_argument("--bf16", action="store_true", help="FSDP2 bf16 mixed precision (model.mixed_precision)")
    ap.add_argument("--checkpointing", action="store_true", help="model.activation_checkpointing")
    ap.add_argument("--bucket-ratios", type=lambda v: [float(x) for x in v.split(",")], default=[],
                    help="also time the packed layout with these bucket ratios (comma-separated; "
                         "device.Device.bucket_ratio: the segments kernel's)")
    ap.add_argument("--seed", type=int, default=0)
    print(json.dumps(run(ap.parse_args(argv))))


if __name__ == "__main__":
    main()
