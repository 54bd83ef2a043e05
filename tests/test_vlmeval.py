"""The seed's table (issue 47): the HF export keeps the hub processor's pixel bounds, and
launch/vlmeval.sh / launch/vlmeval_table.py (commands under --dry-run, the table from
VLMEvalKit's result files)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

import checkpoint as ckpt
import inputs


def test_export_keeps_the_source_processors_pixel_bounds(tiny_dir, tmp_path):
    """The run's model.min/max_pixels (vl3b.toml: 4.19 MP) bound its own images; the export's
    image processor is the source's (Qwen2.5-VL-3B: 12.8 MP), so VLMEvalKit bounds a checkpoint's
    images as it does the base model's."""
    from transformers import AutoModelForImageTextToText
    src = tiny_dir("qwen2_5_vl")
    own = json.loads((Path(src) / "preprocessor_config.json").read_text())
    procs = inputs.load_processors(src, min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    run_size = {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 64}
    assert dict(procs.image_processor.size) == run_size != own["size"]  # what the run resizes with
    model = AutoModelForImageTextToText.from_pretrained(src)
    ckpt.export_hf(tmp_path / "hf", model.state_dict(), model, procs, src, torch.float32)
    out = json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())
    assert out["size"] == own["size"]  # transformers 5 keeps min/max_pixels as this size
    for key in ("min_pixels", "max_pixels"):
        assert out.get(key) == own.get(key)
