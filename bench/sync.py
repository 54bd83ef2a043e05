"""Weight-sync benchmark: sync.py's bucketed path vs one raw broadcast of the same bytes.

    python bench/sync.py                  # 256 MB + the tiny model, 1 trainer -> 1 engine (gloo)
    python bench/sync.py --mb 1024 --engines 2 --bucket-mb 64
    python bench/sync.py --lora-rank 8    # LoRA: every tensor vs merged adapted layers vs adapters

Launches itself under torchrun (1 + engines ranks). Rank 0 holds a model whose parameters total
`--mb` megabytes (16 MB tensors unless `--tensors`) plus the tiny Qwen2.5-VL's parameters; it
syncs them to every engine rank through `sync.Sender` / `sync.Receiver` (control message,
packing of small tensors, zero-copy sends of large ones, receives into reused buffers, the
engine adopting them as its weights), then broadcasts the same number of bytes as ONE raw tensor
on the same group. After a warm-up, `--repeat` sync/raw pairs run interleaved, so drift in the
machine's load hits both alike. Prints one JSON object: bytes, sync_s and raw_s (medians),
ratio (= raw_s / sync_s; 1.0 means no overhead), gbps (sync), each side's minimum, and `path`:
what carries the weights here, for both engines: sync.py's buckets over gloo (on GPU / NPU a vLLM
engine's weights go through vLLM's own NCCL / HCCL weight-transfer engine instead, not measured
by this CPU bench: docs/vllm.md, "Weight transfer").

`--lora-rank R`: the LoRA question instead (README: LoRA). Every rank builds a model of the
tiny family's architecture at `--hidden` / `--layers` (random, the same on every rank); rank 0
puts LoRA of rank R on it (lora.py, all-linear, alpha 2R) with moved adapters, and syncs it
three ways, interleaved, each to every engine through sync.Sender / sync.Receiver:
- `full`: every tensor, as a run without LoRA sends every step;
- `merged`: what a LoRA run sends after its first sync (the adapted linear layers and their
  siblings, each adapted weight merged on the trainer: W + (B A) * alpha / r);
- `adapters`: the A and B tensors alone: the transport a vLLM-LoRA design would need (vLLM's
  loading of the adapters and its LoRA kernels during generation are not in this figure).
Prints one JSON object: bytes and median seconds per sync of each.

Seen here (2 shared cores, gloo over loopback): one gloo broadcast per bucket cost ~0.5 ms each
beyond its bytes (gloo queues broadcasts on two worker threads); sync.py therefore sends buckets
point to point, every receive posted at once, which streams as fast as the raw broadcast.
Packing everything into big buckets is slower here (the memcpy competes for the same two cores:
ratio ~0.7 with `--solo-mb 1000`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=256.0, help="synthetic parameter megabytes")
    ap.add_argument("--tensors", type=int, default=0,
                    help="synthetic tensors (default: 16 MB each, about Qwen2.5-VL-3B's mean "
                         "tensor size in bf16: 7.5 GB over 434 tensors)")
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--solo-mb", type=float, default=None,
                    help="tensors this large go out zero-copy as their own bucket (default: Sender's)")
    ap.add_argument("--repeat", type=int, default=15, help="interleaved sync/raw pairs")
    ap.add_argument("--no-tiny", action="store_true", help="leave the tiny model out")
    ap.add_argument("--lora-rank", type=int, default=0, help="the LoRA mode (see above) at this rank")
    ap.add_argument("--hidden", type=int, default=1024, help="LoRA mode: the model's hidden size")
    ap.add_argument("--layers", type=int, default=8, help="LoRA mode: its decoder layers")
    return ap.parse_args(argv)


def build(args):
    import torch
    params = {}
    n = args.tensors or max(1, round(args.mb / 16))
    per = int(args.mb * 2**20 / 4 / n)
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        params[f"synthetic.{i}"] = torch.randn(per, generator=g)
    if not args.no_tiny:
        import tempfile
        import families as F
        import model as M
        path = F.build_tiny(Path(tempfile.gettempdir()) / "grpo-bench-tiny", seed=0)
        for k, v in M.load_model(str(path)).named_parameters():
            params[f"tiny.{k}"] = v.detach()
    m = torch.nn.Module()
    for k, v in params.items():
        m.register_parameter(k.replace(".", "_"), torch.nn.Parameter(v, requires_grad=False))
    return m


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import sync as S
    from channel import transfer_path
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(list(range(dist.get_world_size())))
    model = build(args)  # every rank builds the same shapes; engines overwrite theirs
    total = sum(p.numel() * 4 for p in model.parameters())
    if rank == 0:
        kw = {} if args.solo_mb is None else {"solo_mb": args.solo_mb}
        sender = S.Sender(model, "float32", args.bucket_mb, group=group, src=0, **kw)
    else:
        receiver = S.Receiver(group, src=0)
        params = dict(model.named_parameters())
    raw = torch.empty(total, dtype=torch.uint8)
    if rank == 0:
        raw.fill_(7)

    def do_sync(version):
        if rank == 0:
            sender.send(version)
        else:
            receiver.control()  # (version, plan): the plan travels once, on the first sync
            for named in receiver.buckets():  # adopt the receive buffers as the weights, as HFEngine does
                for name, t in named:
                    if params[name].data_ptr() != t.data_ptr():
                        params[name].data = t

    def timed(fn):
        dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        dist.barrier(group)
        return time.perf_counter() - t0

    do_sync(0)                                       # warm-up: plan metadata, first connection
    dist.broadcast(raw, 0, group=group)
    # Interleaved pairs: drift in the machine's load hits both alike.
    sync_t, raw_t = [], []
    for i in range(args.repeat):
        sync_t.append(timed(lambda: do_sync(2 + i)))
        raw_t.append(timed(lambda: dist.broadcast(raw, 0, group=group)))
    sync_s, raw_s = statistics.median(sync_t), statistics.median(raw_t)
    if rank == 1:  # the engine really holds the sender's weights
        ref = build(args)
        assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))
    if rank == 0:
        print(json.dumps({"bytes": total, "tensors": len(list(model.parameters())),
                          "buckets": len(sender.plan), "engines": args.engines,
                          "bucket_mb": args.bucket_mb, "sync_s": round(sync_s, 4),
                          "raw_s": round(raw_s, 4), "ratio": round(raw_s / sync_s, 3),
                          "gbps": round(total / sync_s / 1e9, 3),
                          "sync_min_s": round(min(sync_t), 4), "raw_min_s": round(min(raw_t), 4),
                          "repeat": args.repeat, "path": transfer_path("cpu")}), flush=True)
    dist.destroy_process_group()


def build_lora(args, rank: int):
    """(plain model, LoRA model, module of the adapters alone) on rank 0; the plain model elsewhere."""
    import tempfile

    import torch
    import config as C
    import families as F
    import lora
    import model as M
    path = F.build_tiny(Path(tempfile.gettempdir()) / f"grpo-bench-sync-{args.hidden}x{args.layers}",
                        seed=0, hidden=args.hidden, layers=args.layers)
    plain = M.load_model(str(path)).requires_grad_(False)
    if rank:
        return plain, None, None
    adapted = lora.add_lora(M.load_model(str(path)), C.ModelConfig(lora_rank=args.lora_rank,
                                                                 lora_alpha=2.0 * args.lora_rank))
    adapters = torch.nn.Module()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if ".lora_" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.01)  # B starts at zero
                adapters.register_parameter(n.replace(".", "_"), p)
    return plain, adapted, adapters


def lora_worker(args) -> None:
    import torch
    import torch.distributed as dist
    import sync as S
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(list(range(dist.get_world_size())))
    plain, adapted, adapters = build_lora(args, rank)
    modes = ("full", "merged", "adapters")
    if rank == 0:
        ends = {m: S.Sender(x, "float32", args.bucket_mb, group=group, src=0)
                for m, x in zip(modes, (plain, adapted, adapters))}
    else:
        ends = {m: S.Receiver(group, src=0) for m in modes}

    def do_sync(mode, version):
        end = ends[mode]
        if rank == 0:
            return end.send(version)
        end.control()
        for _ in end.buckets():
            pass
        return 0

    def timed(mode, version):
        dist.barrier(group)
        t0 = time.perf_counter()
        sent = do_sync(mode, version)
        dist.barrier(group)
        return time.perf_counter() - t0, sent

    for m in modes:  # warm-up: plans, first connection; the LoRA sender's every-tensor sync
        do_sync(m, 0)
    times = {m: [] for m in modes}
    sent = {}
    for i in range(args.repeat):  # interleaved: drift in the machine's load hits all alike
        for m in modes:
            t, sent[m] = timed(m, 1 + i)
            times[m].append(t)
    if rank == 0:
        out = {"lora_rank": args.lora_rank, "hidden": args.hidden, "layers": args.layers,
               "engines": args.engines, "bucket_mb": args.bucket_mb, "repeat": args.repeat,
               "params": sum(p.numel() for p in plain.parameters())}
        for m in modes:
            out[m] = {"bytes": sent[m], "sync_s": round(statistics.median(times[m]), 4),
                      "min_s": round(min(times[m]), 4)}
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> None:
    args = parse()
    if "RANK" in os.environ:
        return lora_worker(args) if args.lora_rank else worker(args)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={1 + args.engines}", __file__, *sys.argv[1:]]
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
