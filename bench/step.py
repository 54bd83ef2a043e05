"""Trainer step throughput and model FLOPs utilisation (MFU) of the real training path.

    python bench/step.py                                   # tiny model, CPU, fp32
    python bench/step.py --model 3b --seq-len 2048 --bf16  # Qwen2.5-VL-3B architecture, random init
    python bench/step.py --lora-rank 8                     # the same step with and without LoRA
    python bench/step.py --grpo --model 3b-depth           # one optimizer step as GRPO runs it (below)
    python bench/step.py --head 8192                       # the LM head's peak, chunked vs full (below)

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
(the decoder layers with `--checkpointing [full|selective]`; the vision tower is never
recomputed; 0 means checkpointing is not active; null with `--compile`, where the recomputation
runs inside each layer's compiled backward, uncounted). `--compile`: each decoder layer under
torch.compile (`model.compile`; with checkpointing, each layer's checkpoint inside its compiled
region). Both as trainer.build applies them (trainer.fewer_launches, sharding.apply_fsdp).

`--lora-rank R`: the step twice, side by side in one JSON object, each in a process of its own
(so each peak is its own): every parameter training, and LoRA of rank R on every linear layer of
the language model (lora.py, as `[model] lora_rank`; alpha 2R), with `trainable_params`,
`optimizer_state_mb` and the ratios. Peak memory: the accelerator's allocator peak, or on the
CPU the process's peak resident set (`peak_rss_gb`: Python, torch and the model included). FLOPs
use the 6 N convention for both (a LoRA step skips the frozen weights' gradient matmuls, about a
third of the step's; its MFU is then overstated by up to that much).

`--grpo` (:func:`run_grpo`): one optimizer step as update.py runs it, at the reference shapes:
Geometry3K-like prompts (one synthetic geometry image each, at vl3b.toml's pixel bounds) x
`--group` long-tailed responses, micro-batches of a `--mb-tokens` budget in the device's layout;
forward+backward time and MFU apart from the optimizer's, peak memory per phase, and per
micro-batch the aten operators and host syncs torch.profiler counts (`aten_ops_per_microbatch`:
the top-level operators, each at least one launch; `aten_ops_nested_per_microbatch`: every aten
event, nested ones too; `host_syncs_per_microbatch`; `host_reads_per_microbatch`: reads of host tensors inside
model.HOST_SCOPE, the micro-batch's plan and positions, which sync no device). `--model
3b-depth`: Qwen2.5-VL-3B's depth and vocabulary at a width a CPU runs. `--head N` (:func:`run_head`): the LM head's peak memory, forward + backward,
at N response tokens, head.py's chunks (`head_peak_mb`) against the full [N, V] computation
(`head_peak_mb_full`). docs/benchmarks.md has the figures and what each field counts.
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
    if a.head:
        print(json.dumps(head_one(a) if a.head_variant else run_head(a)))
        return
    if a.grpo:
        print(json.dumps(run_grpo(a)))
        return
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
    ap.add_argument("--model", choices=["tiny", "3b", "3b-depth"], default="tiny",
                    help="3b-depth: --grpo only")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--image-px", type=int, default=112)
    ap.add_argument("--bf16", action="store_true", help="FSDP2 bf16 mixed precision")
    ap.add_argument("--checkpointing", nargs="?", const="full", default="off",
                    choices=["full", "selective", "off"],
                    help="model.activation_checkpointing (alone: full)")
    ap.add_argument("--compile", action="store_true", help="model.compile: each decoder layer compiled")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float)
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="also run the step with LoRA of this rank, side by side")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # internal: one variant
    g = ap.add_argument_group("--grpo: one optimizer step as update.py runs it")
    g.add_argument("--grpo", action="store_true")
    g.add_argument("--prompts", type=int, default=4)
    g.add_argument("--group", type=int, default=4, help="rollout.group_size (vl3b.toml: 4)")
    g.add_argument("--max-new-tokens", type=int, default=512, help="vl3b.toml's")
    g.add_argument("--mb-tokens", type=int, default=2048, help="train.micro_batch_tokens")
    g.add_argument("--packing", default="auto", help="train.packing (auto: the device's choice)")
    g.add_argument("--min-pixels", type=int, default=262144, help="vl3b.toml's (512 x 512)")
    g.add_argument("--max-pixels", type=int, default=4194304, help="vl3b.toml's")
    g.add_argument("--no-profile", dest="profile", action="store_false",
                   help="skip counting operators and host syncs")
    h = ap.add_argument_group("--head N: the LM head's peak memory at N response tokens")
    h.add_argument("--head", type=int, default=0)
    h.add_argument("--head-measure", choices=["rss", "fake"], default="rss")
    h.add_argument("--head-variant", choices=["chunked", "full"], help=argparse.SUPPRESS)  # internal
    a = ap.parse_args(argv)
    if a.model == "3b-depth" and not a.grpo:
        ap.error("--model 3b-depth goes with --grpo")
    return a


def run_one(a, lora_rank: int) -> None:
    """One variant of the step (LoRA of `lora_rank`, 0: every parameter); prints its JSON."""
    import resource

    import torch
    import torch.distributed as dist
    from PIL import Image
    from torch.distributed.device_mesh import DeviceMesh

    import config as C
    import device as D
    import families as F
    import inputs as I
    import loss as L
    import model as M
    import sharding
    import trainer
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
        import lora
        model = lora.add_lora(model, C.ModelConfig(lora_rank=lora_rank, lora_alpha=2.0 * lora_rank))
    model.train()  # as trainer.build: transformers checkpoints layers only in train mode
    trainer.fewer_launches(model)  # as trainer.build
    sharding.apply_fsdp(model, DeviceMesh.from_group(dist.group.WORLD, dev.kind),
                 mixed_precision=a.bf16, checkpointing=a.checkpointing, compile=a.compile)
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
        "checkpointing": a.checkpointing, "compile": a.compile,
        "checkpoint_calls_per_step": _recomputed(a, max(recomputed))}))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- --grpo: a step as GRPO runs it
# the widths of `--model 3b-depth`: Qwen2.5-VL-3B's depth (36 decoder layers, 32 vision blocks,
# its vocabulary) at a width a CPU runs; the operator count does not depend on the width
WIDTHS = {"3b": dict(hidden=2048, inter=11008, heads=16, kv=2, head_dim=128, mrope=[16, 24, 24],
                     v_hidden=1280, v_inter=3420, v_heads=16),
          "3b-depth": dict(hidden=256, inter=512, heads=4, kv=2, head_dim=64, mrope=[8, 12, 12],
                           v_hidden=128, v_inter=256, v_heads=2)}
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero")  # .item()/float()/bool(); nonzero, bool indexing


def grpo_model(kind: str, path: str, device):
    """The tiny folder's model (`tiny`), or Qwen2.5-VL-3B's architecture on the tiny folder's
    tokenizer ids at `WIDTHS[kind]`: 36 decoder layers, 32 vision blocks (windows of 112 px, full
    attention in blocks 7/15/23/31), the 151,936-token vocabulary tied to the embeddings."""
    import families as F
    import model as M
    config = M.load_config(path)
    if kind == "tiny":
        return M.load_model(path, device=device)
    w, t, v = WIDTHS[kind], config.text_config, config.vision_config
    t.vocab_size, t.hidden_size, t.intermediate_size, t.num_hidden_layers = 151936, w["hidden"], w["inter"], 36
    t.num_attention_heads, t.num_key_value_heads, t.head_dim = w["heads"], w["kv"], w["head_dim"]
    t.rope_parameters = {**t.rope_parameters, "mrope_section": w["mrope"]}
    t.layer_types = ["full_attention"] * 36
    v.depth, v.hidden_size, v.intermediate_size, v.num_heads = 32, w["v_hidden"], w["v_inter"], w["v_heads"]
    v.out_hidden_size, v.window_size, v.fullatt_block_indexes = w["hidden"], 112, [7, 15, 23, 31]
    config.tie_word_embeddings = t.tie_word_embeddings = True
    with device:  # built where it runs (a 3B-sized model's random init on the host is slow)
        return F.auto_class(config).from_config(config, attn_implementation="sdpa")


def grpo_flops(model, batches: list[dict]) -> float:
    """Matmul FLOPs of forward + backward over the micro-batches as computed: 6 N per token through
    the decoder (embeddings and head excluded), 6 x head per predicted token, 12 L H per query-key
    pair the attention computes; vision 6 N_vis per patch + 12 depth H_v P^2 per image."""
    tc, vc = model.config.text_config, model.config.vision_config
    head = model.get_output_embeddings().weight.numel()
    body = sum(p.numel() for n, p in model.named_parameters()
               if "visual" not in n and "embed_tokens" not in n and "lm_head" not in n)
    vis = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
    out = 0.0
    for b in batches:
        out += 6 * body * float(b["tokens"]) + 6 * head * float(b["predicted"])
        out += 12 * tc.num_hidden_layers * tc.hidden_size * float(b["pairs"])
        out += sum(6 * vis * p + 12 * vc.depth * vc.hidden_size * p * p for p in b["patches"])
    return out


def grpo_setup(a, device):
    """The workload (bench/packing.py's long-tailed responses to synthetic geometry prompts,
    images at vl3b.toml's pixel bounds), planned as update.py plans a step."""
    from types import SimpleNamespace

    import torch.distributed as dist

    import families as F
    import inputs as I
    import microbatches as MB
    import update as U
    from bench.packing import workload
    from train import load_config

    path = str(F.build_tiny(Path(tempfile.gettempdir()) / "grpo-bench-tiny"))
    procs = I.load_processors(path, a.min_pixels, a.max_pixels)
    w = SimpleNamespace(prompts=a.prompts, group=a.group, max_new_tokens=a.max_new_tokens, seed=0)
    eps, images = workload(w, procs)
    cfg = load_config(None, [f"--rollout.max_new_tokens={a.max_new_tokens}", f"--rollout.group_size={a.group}",
                             f"--train.micro_batch_tokens={a.mb_tokens}", f"--train.packing={a.packing}"])
    MB.resolve_layout(cfg.train, procs, path, device)  # "auto": the device's choice, as train.py
    return path, procs, eps, images, cfg, U, SimpleNamespace(trainers=[0], trainer_index=0,
                                                              train_group=dist.group.WORLD)


def micro_batch_shapes(s, procs, device) -> list[dict]:
    """Each micro-batch of the step's one update as collated: tokens through the model, predicted
    tokens, query-key pairs, each image's patches."""
    import inputs as I
    u, out = s.updates[0], []
    for mb in u.plan:
        eps = [s.episodes[u.idx[j]] for j in mb]
        b = I.collate(eps, [I.episode_images(s.images, e) for e in eps], procs, device,
                      s.tr.layout, s.tr.pixels)
        grid = b.image_grid_thw
        out.append({"tokens": int(b.attention_mask.sum()), "predicted": int(b.response_mask.sum()),
                    "pairs": int(b.attention_pairs), "rows": int(b.input_ids.shape[0]),
                    "patches": [] if grid is None else [int(g.prod()) for g in grid]})
    return out


def count_ops(s, U) -> list[dict]:
    """aten operator events and host syncs (SYNC_OPS) of each micro-batch's forward + backward
    (update.accumulate_gradients over it alone), counted with torch.profiler: `aten_ops`, the
    top-level ones (called from Python or autograd, not from another aten op: each at least one
    launch, issue 51's count), and `aten_ops_nested`, every aten event, nested ones too
    (aten::linear and the aten::mm under it: its decomposition, an upper bound on the launches).
    `host_syncs`: the SYNC_OPS outside model.HOST_SCOPE, plus update.READ_SCOPE's one read of
    the step's metrics (a `.tolist()`: no aten event on a CPU); `host_reads`: the SYNC_OPS inside
    model.HOST_SCOPE (the plan and positions computed from host tensors: no device sync)."""
    from torch.profiler import ProfilerActivity, profile

    import model as M
    u, out = s.updates[0], []
    for mb in u.plan:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            U.accumulate_gradients(s, U.Update(u.idx, [mb], u.denom))
        events = [e for e in prof.events() if e.name.startswith("aten::")]
        syncs = [e for e in events if e.name in SYNC_OPS]
        host = sum(_under(e, lambda n: n == M.HOST_SCOPE) for e in syncs)
        reads = sum(e.name == U.READ_SCOPE for e in prof.events())
        out.append({"aten_ops": sum(not _under(e, lambda n: n.startswith("aten::")) for e in events),
                    "aten_ops_nested": len(events),
                    "host_syncs": len(syncs) - host + reads, "host_reads": host})
    s.tr.policy.zero_grad(set_to_none=True)
    return out


def _under(event, named) -> bool:
    """Whether a profiler event runs inside one whose name `named` accepts (aten::mm under
    aten::linear; an operator inside a record_function scope)."""
    p = event.cpu_parent
    while p is not None:
        if named(p.name):
            return True
        p = p.cpu_parent
    return False


def run_grpo(a) -> dict:
    """`--grpo`: one optimizer step as update.py runs it, timed by phase; prints one JSON object."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import device as D
    import microbatches as MB
    import model as M
    import sharding
    import trainer as T
    import world as W
    from tests.util import CheckpointCounter

    dev = D.detect()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(W.free_port()))
    dist.init_process_group(dev.backend, rank=0, world_size=1)
    device = D.torch_device(dev, 0)
    T.quiet_view_warning()  # as trainer.build
    path, procs, eps, images, cfg, U, world = grpo_setup(a, device)
    model = grpo_model(a.model, path, device)
    layout = MB.resolve_layout(cfg.train, procs, path, device)[0]  # as train.set_up decides it
    model.set_attn_implementation(M.attention_for(layout.packed))
    T.fewer_launches(model)  # as trainer.build
    policy = sharding.apply_fsdp(model.train(), DeviceMesh.from_group(dist.group.WORLD, dev.kind),
                          mixed_precision=a.bf16, checkpointing=a.checkpointing, compile=a.compile)
    count = CheckpointCounter(policy)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-6,
                            **D.adamw_options(dev.kind))
    from types import SimpleNamespace
    tr = SimpleNamespace(policy=policy, ref=None, base_ref=False, teacher=None, base_teacher=False,
                         device=device, pixels={}, kl_coef=None, version=0, opt=opt, layout=layout)
    s = U.Step(tr, world, procs, cfg.train, cfg.loss, cfg.rollout, 0, 0, eps, images)
    U.plan(s)
    U.denominators(s)
    U.advantages(s)
    shapes = micro_batch_shapes(s, procs, device)
    fb, step, peaks = [], [], {"forward_backward": 0.0, "optimizer": 0.0}
    for i in range(a.warmup + a.steps):
        count.reset()
        t_fb, m_fb = phase(dev, lambda: U.accumulate_gradients(s, s.updates[0]))
        t_opt, m_opt = phase(dev, lambda: T.optimizer_step(tr, cfg.train))
        if i >= a.warmup:
            fb.append(t_fb)
            step.append(t_opt)
            peaks = {"forward_backward": max(peaks["forward_backward"], m_fb),
                     "optimizer": max(peaks["optimizer"], m_opt)}
    recomputed = _recomputed(a, count.recomputes)
    ops = count_ops(s, U) if a.profile else []
    fb_s, opt_s = statistics.median(fb), statistics.median(step)
    flops = grpo_flops(model, shapes)
    peak = a.peak_tflops or (None if dev.kind == "cpu" else next(
        (v for k, v in PEAK_BF16_TFLOPS.items() if k in D.device_name(dev)), None))
    K = len(shapes)
    out = {"mode": "grpo", "model": a.model, "device": D.device_name(dev),
           "dtype": "bf16-mixed" if a.bf16 else "fp32", "checkpointing": a.checkpointing,
           "compile": a.compile, "layout": layout.packed or "padded",
           "adamw": D.TABLE[dev.kind].adamw, "episodes": len(eps), "micro_batches": K,
           "micro_batch_tokens": a.mb_tokens,
           "tokens": sum(b["tokens"] for b in shapes), "predicted_tokens": sum(b["predicted"] for b in shapes),
           "images_per_microbatch": [len(b["patches"]) for b in shapes],
           "forward_backward_s": round(fb_s, 4), "optimizer_s": round(opt_s, 4),
           "tokens_per_s": round(sum(b["tokens"] for b in shapes) / fb_s, 1),
           "tflops_per_s": round(flops / fb_s / 1e12, 4),
           "mfu_forward_backward": round(flops / fb_s / 1e12 / peak, 4) if peak else None,
           "peak_memory_mb": {k: round(v, 1) for k, v in peaks.items()},
           "peak_memory_measure": "allocator" if dev.kind != "cpu" else "VmHWM (process RSS peak, reset per phase)",
           "checkpoint_calls_per_step": recomputed,
           "aten_ops_per_microbatch": round(statistics.mean(o["aten_ops"] for o in ops)) if ops else None,
           "host_syncs_per_microbatch": round(statistics.mean(o["host_syncs"] for o in ops), 1) if ops else None,
           "aten_ops_nested_per_microbatch": round(statistics.mean(o["aten_ops_nested"] for o in ops)) if ops else None,
           "host_reads_per_microbatch": round(statistics.mean(o["host_reads"] for o in ops), 1) if ops else None,
           "per_microbatch": [b | o for b, o in zip(shapes, ops)] if ops else shapes}
    dist.destroy_process_group()
    return out


def _recomputed(a, counted: int) -> int | None:
    """checkpoint_calls_per_step: tests.util.CheckpointCounter's count (transformers'
    checkpointing), or None where each layer's checkpoint runs inside its compiled region
    (`--compile` with checkpointing: its backward recomputes compiled code, no layer forward)."""
    return None if a.compile and a.checkpointing != "off" else counted


def phase(dev, fn, base: bool = False) -> tuple[float, float]:
    """(seconds, peak MB) of `fn()`: the accelerator allocator's peak, or on the CPU the process's
    resident high-water mark (Linux: reset to the current resident size through
    /proc/self/clear_refs); `base`: less what was held when it started."""
    import device as D
    D.synchronize(dev)
    D.reset_peak_memory(dev)
    if dev.kind == "cpu":
        Path("/proc/self/clear_refs").write_text("5")
    start = _peak_mb(dev)
    t0 = time.perf_counter()
    fn()
    D.synchronize(dev)
    return time.perf_counter() - t0, _peak_mb(dev) - (start if base else 0.0)


def _peak_mb(dev) -> float:
    import device as D
    if dev.kind != "cpu":
        return D.peak_memory_gb(dev) * 1024
    hwm = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM"))
    return int(hwm.split()[1]) / 1024


# ----------------------------------------------------------------------------- --head: the LM head's peak
HEAD_V, HEAD_H = 151936, 2048  # Qwen2.5-VL-3B's vocabulary and hidden size


def run_head(a) -> dict:
    """`--head N`: the LM head's peak memory, forward + backward, at N response tokens: head.py's
    chunks (`head_peak_mb`) and the full [N, V] computation the trainer did before
    (`head_peak_mb_full`), each in a fresh process of its own."""
    import subprocess
    got = {}
    for variant in ("chunked", "full"):
        args = [sys.executable, __file__, "--head", str(a.head), "--head-measure", a.head_measure,
                "--head-variant", variant]
        p = subprocess.run(args, capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"bench/step.py --head ({variant}) failed:\n{p.stderr[-3000:]}")
        got[variant] = json.loads(p.stdout.strip().splitlines()[-1])
    c, f = got["chunked"], got["full"]
    return {"mode": "head", "tokens": a.head, "vocab": HEAD_V, "hidden": HEAD_H, "dtype": "fp32",
            "device": c["device"], "measure": c["measure"], "chunk_tokens": c["chunk_tokens"],
            "head_peak_mb": c["peak_mb"], "head_peak_mb_full": f["peak_mb"],
            "ratio": round(c["peak_mb"] / f["peak_mb"], 4), "head_s": c["seconds"],
            "head_s_full": f["seconds"]}


def head_one(a) -> dict:
    """One variant of `--head` in this process: the memory above what the inputs hold (hidden
    states [N, H], the weight [V, H]) at its peak, the weight's gradient included. `rss`: the
    accelerator's allocator, or on the CPU the resident high-water mark; `fake`: torch's
    MemTracker over fake tensors (nothing allocated: for a CPU with too little memory)."""
    import torch

    import device as D
    import head as H
    import model as M
    from types import SimpleNamespace
    dev = D.detect()
    device = D.torch_device(dev, 0)
    tokens = SimpleNamespace(suppressed=tuple(range(151643, 151665)))  # Qwen's special ids, as a run's

    def step(h, w, t):
        if a.head_variant == "chunked":
            lp, ent = H.logprobs(h, w, t, tokens.suppressed, 0.7, entropy_grad=True)
        else:
            logits = torch.nn.functional.linear(h, w)                # [N, V], held as the trainer did
            lp, ent = M.token_logprobs(logits, t, tokens, 0.7)
        (lp.sum() + 0.01 * ent.sum()).backward()

    def inputs():
        h = torch.empty(a.head, HEAD_H, device=device).normal_().requires_grad_()
        w = torch.empty(HEAD_V, HEAD_H, device=device).normal_(0, 0.02).requires_grad_()
        return h, w, torch.randint(0, 151643, (a.head,), device=device)

    info = {"device": D.device_name(dev), "chunk_tokens": H.chunk_tokens(HEAD_V)}
    if a.head_measure == "rss" and dev.kind == "cpu" and a.head_variant == "full":
        need = 7 * a.head * HEAD_V * 4 + 2 * HEAD_V * HEAD_H * 4  # ~6.4 [N, V] copies measured
        avail = next(int(l.split()[1]) * 1024 for l in Path("/proc/meminfo").read_text().splitlines()
                     if l.startswith("MemAvailable"))
        if need > 0.8 * avail:
            raise SystemExit(f"--head {a.head}: the full head needs ~{need / 2**30:.0f} GiB, this "
                             f"machine has {avail / 2**30:.0f} GiB available; use --head-measure fake")
    if a.head_measure == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed._tools.mem_tracker import MemTracker
        with FakeTensorMode():
            h, w, t = inputs()
            mt = MemTracker()
            mt.track_external(h, w)
            t0 = time.perf_counter()
            with mt:
                step(h, w, t)
            peak = mt.get_tracker_snapshot("peak")[h.device]["Total"] - (h.nbytes + w.nbytes)
        return info | {"measure": "fake tensors (torch MemTracker)", "peak_mb": round(peak / 2**20, 1),
                       "seconds": None}
    h, w, t = inputs()
    t_s, peak_mb = phase(dev, lambda: step(h, w, t), base=True)
    return info | {"measure": "allocator" if dev.kind != "cpu" else "VmHWM above the inputs",
                   "peak_mb": round(peak_mb, 1), "seconds": round(t_s, 3)}


if __name__ == "__main__":
    main()
