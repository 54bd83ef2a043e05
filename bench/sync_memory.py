"""What a vLLM weight sync holds outside vLLM's memory budget, for Qwen2.5-VL-3B, on no device.

    python bench/sync_memory.py                 # bf16, sync.bucket_mb 256 (the default)
    python bench/sync_memory.py --bucket-mb 1024

Runs the worker's real receiving side (`vllm_worker.VLLMWorkerExtension.weight_stream`, the
bucket plan of `sync.Sender`) on the meta device (shapes only, nothing allocated), with a
stand-in for vLLM 0.23's layerwise reload that does what matters for memory: it keeps a layer's
tensors until the layer has all of them, then drops them (q/k/v go to one `qkv_proj`, gate/up to
one `gate_up_proj`, as vLLM stacks them). Prints one JSON object: the plan and the most received
bytes alive at once (`sync.LiveBytes`). Not counted: the copy of each layer vLLM's reload makes
while processing it (inside vLLM, at most the largest layer). Measured for real with vLLM's CPU
build and the tiny model in tests/test_vllm.py.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import sync as S  # noqa: E402
import vllm_worker as V  # noqa: E402
from bench.step import QWEN25_VL_3B  # noqa: E402


def vllm_layer(name: str) -> str:
    """The vLLM layer an HF tensor loads into (Qwen2.5-VL, tensor_parallel_size 1)."""
    name = re.sub(r"\.(weight|bias)$", "", name)
    name = re.sub(r"self_attn\.[qkv]_proj$", "self_attn.qkv_proj", name)
    return re.sub(r"mlp\.(gate|up)_proj$", "mlp.gate_up_proj", name)


class LayerwiseReload:
    def __init__(self, names: list[str]):
        self.need: dict[str, int] = {}
        for n in names:
            self.need[vllm_layer(n)] = self.need.get(vllm_layer(n), 0) + 1

    def reload_weights(self, weights_iterator, is_checkpoint_format: bool) -> None:
        held: dict[str, list] = {}
        for name, t in weights_iterator:
            layer = held.setdefault(vllm_layer(name), [])
            layer.append(t)
            if len(layer) == self.need[vllm_layer(name)]:
                del held[vllm_layer(name)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bucket-mb", type=float, default=256.0)
    ap.add_argument("--solo-mb", type=float, default=4.0)
    args = ap.parse_args()
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**QWEN25_VL_3B))
    specs = [(n, shape, "bfloat16") for n, shape, _, _ in S.wire_pieces(model)]  # as Sender
    plan = S.plan_buckets(specs, int(args.bucket_mb * 2**20), int(args.solo_mb * 2**20))
    worker = V.VLLMWorkerExtension.__new__(V.VLLMWorkerExtension)
    worker.device = torch.device("meta")
    worker.weight_channel = SimpleNamespace(broadcast=lambda buf: SimpleNamespace(wait=lambda: None))
    LayerwiseReload([n for n, _, _ in specs]).reload_weights(worker.weight_stream(plan), True)
    mib = 2**20
    packed = [S.bucket_size(b) for b in plan if len(b) > 1]
    print(json.dumps({
        "model": "Qwen2.5-VL-3B bf16", "bucket_mb": args.bucket_mb, "solo_mb": args.solo_mb,
        "model_mib": round(sum(S.bucket_size(b) for b in plan) / mib, 1), "buckets": len(plan),
        "packed_buckets": len(packed), "largest_packed_mib": round(max(packed) / mib, 1),
        "largest_tensor_mib": round(max(S.bucket_size(b) for b in plan) / mib, 1),
        "peak_received_mib": round(worker.receive_memory.peak / mib, 1),
        "left_after_sync_mib": round(worker.receive_memory.now / mib, 1)}))


if __name__ == "__main__":
    main()
