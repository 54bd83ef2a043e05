"""Checkpoints: an HF-format export for evaluation tools, and the exact training state to resume.

A checkpoint is a folder `<out_dir>/checkpoints/step_<N>/` (N = optimizer steps done):
- `hf/`: safetensors weights, config, tokenizer and image-processor files. `transformers`
  `from_pretrained`, vLLM and VLMEvalKit load it directly.
- `state/`: the sharded policy and optimizer through `torch.distributed.checkpoint` (each trainer
  rank writes its own shards), plus `meta.pt`: step, weight version, LR schedule, RNG states of
  every trainer rank, consecutive skipped steps. The data position is the step itself (the
  problem stream is a pure function of seed and step).

Written to `step_<N>.tmp/`, renamed when every trainer rank has finished: a folder without the
suffix is complete. Killing the job mid-write leaves a `.tmp` folder that is ignored (and
removed by the next save). The last `keep_last` complete checkpoints are kept.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)

from failures import fault_active

_STEP = re.compile(r"^step_(\d+)$")


def root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def complete(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    r = root(out_dir)
    if not r.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in r.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest(out_dir: str | Path) -> Path | None:
    c = complete(out_dir)
    return c[-1] if c else None


def save(path_final: Path, *, policy, opt, sched, meta: dict, rng: dict, tokenizer,
         image_processor, dtype: torch.dtype, train_group, is_root: bool, keep_last: int) -> None:
    """Collective over the trainer ranks. Rank 0 writes the HF export and renames at the end."""
    tmp = path_final.with_name(path_final.name + ".tmp")
    if is_root:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "state").mkdir(parents=True)
    dist.barrier(group=train_group)
    # (a) the HF export: full tensors gathered to every rank (collective), written by rank 0.
    full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True,
                                                                  cpu_offload=True))
    if is_root:
        export_hf(tmp / "hf", full, policy.config, tokenizer, image_processor, dtype)
    del full
    # (b) the training state, sharded: every trainer rank writes its own part.
    model_sd, optim_sd = get_state_dict(policy, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "state"),
             process_group=train_group)
    metas: list = [None] * dist.get_world_size(train_group)
    dist.all_gather_object(metas, rng, group=train_group)
    if is_root:
        torch.save({**meta, "sched": sched.state_dict(), "rng": metas}, tmp / "state" / "meta.pt")
    dist.barrier(group=train_group)
    if fault_active("checkpoint_before_rename", meta["step"]):  # tests: die mid-write
        os.kill(os.getpid(), signal.SIGKILL)
    if is_root:
        tmp.rename(path_final)  # the commit point
        for old in complete(path_final.parent.parent)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def export_hf(out: Path, full: dict, config, tokenizer, image_processor, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    tied = bool(getattr(config, "tie_word_embeddings", False) or
                getattr(getattr(config, "text_config", None), "tie_word_embeddings", False))
    state = {k: v.to(dtype).contiguous() for k, v in full.items()
             if not (tied and k == "lm_head.weight")}  # safetensors refuses shared storage
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)


def load(path: Path, *, policy, opt, sched, train_group, rank_in_group: int) -> dict:
    """Restore policy, optimizer, schedule in place; returns meta (step, version, rng, ...)."""
    state = path / "state"
    model_sd, optim_sd = get_state_dict(policy, opt)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=str(state), process_group=train_group)
    set_state_dict(policy, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    meta = torch.load(state / "meta.pt", weights_only=False)
    sched.load_state_dict(meta["sched"])
    meta["rng"] = meta["rng"][rank_in_group]
    return meta


def read_meta(path: Path) -> dict:
    return torch.load(Path(path) / "state" / "meta.pt", weights_only=False)


def resume_plan(cfg, out_dir: str | Path, resume: str | None, world_size: int) -> dict:
    """Where a run starts (rank 0, before anything is built): the checkpoint (`resume`, else the
    latest complete one), its progress, whether the run is already finished, and what changed.

    Keys that change what the run means (config.MEANING_KEYS, and the number of ranks) must
    match the checkpoint's saved config unless `run.allow_config_change`: otherwise "error" holds
    the one line naming every difference. Optimizer keys (config.OPTIMIZER_KEYS) may change;
    they are listed in "optimizer_changes" (the trainer applies them after the restore), with
    run.steps when a decaying schedule is stretched or shortened by it.
    """
    import config as C
    plan = {"path": None, "meta": None, "finished": False, "meaning_changes": [],
            "optimizer_changes": [], "error": None}
    path = Path(resume) if resume else latest(out_dir)
    if path is None:
        return plan
    meta = read_meta(path)
    old = meta.get("config", {})
    changes = C.changed_keys(old, cfg, C.MEANING_KEYS)
    if meta.get("world_size", world_size) != world_size:
        changes.append(("ranks (world size)", meta["world_size"], world_size))
    schedule = C.OPTIMIZER_KEYS + (("run.steps",) if cfg.train.lr_schedule != "constant" else ())
    plan.update(path=str(path), finished=meta["step"] >= cfg.run.steps, meaning_changes=changes,
                optimizer_changes=C.changed_keys(old, cfg, schedule),
                meta={k: meta[k] for k in ("step", "version", "skipped_in_row", "skipped_total")})
    if changes and not cfg.run.allow_config_change:
        plan["error"] = (f"resuming {path}: " + "; ".join(f"{k} {a!r} -> {b!r}" for k, a, b in changes)
                         + " would change what the run means; set --run.allow_config_change=true "
                         "to resume anyway, or use another run.out_dir")
    return plan

