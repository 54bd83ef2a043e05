"""What a resumed run must agree with: the config keys that change a run's meaning (a resume with
other values stops unless `run.allow_config_change`), the optimizer keys it re-applies, and the base
weights it started from (a fingerprint, unless `run.allow_new_base`). checkpoint.plan asks here
once the checkpoint to resume is picked. Rules: docs/checkpoints.md, "Resume"."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

import config as C
from errors import ConfigError


# Keys that change what a run means: resuming a checkpoint with other values would silently
# continue a different experiment, so they stop the run unless run.allow_config_change is set.
# (reward.functions, reward.models: what reward/mean measures; train.mini_batches, train.ppo_epochs and
# loss.kl_coef: what one step's update and the loss are; the model.lora_* keys: what trains, and
# the saved adapters would not fit another rank or target set.) Every other changed key is listed in
# one line at resume (resume_plan "other_changes").
MEANING_KEYS = ("model.path", "data.source", "data.sources", "data.n_synthetic", "data.image_size",
                "data.problem_column", "data.answer_column", "data.images_column", "data.template",
                "data.system_prompt", "data.enable_thinking",
                "data.image_crop", "data.delete_text", "loss.advantage_norm", "train.master_dtype",
                "rollout.group_size", "rollout.prompts_per_step", "loss.objective",
                "loss.advantage", "loss.aggregation", "cluster.gen_ranks", "train.mini_batches",
                "train.ppo_epochs", "reward.functions", "reward.models", "loss.kl_coef", "model.lora_rank",
                "model.teacher_path", "loss.distill_coef",
                "model.lora_alpha", "model.lora_target_modules", "model.lora_vision")
# Optimizer keys: a resumed run applies the values configured now to the restored optimizer and
# schedule (and says so).
OPTIMIZER_KEYS = ("train.lr", "train.weight_decay", "train.beta1", "train.beta2",
                  "train.lr_schedule", "train.warmup_steps", "train.min_lr_ratio", "train.grad_clip")


def lookup(tree: dict, dotted: str, default: Any = None) -> Any:
    section, key = dotted.split(".", 1)
    return tree.get(section, {}).get(key, default)


def changed_keys(old: dict, new: C.Config, keys: tuple[str, ...]) -> list[tuple[str, Any, Any]]:
    """(key, old, new) for each of `keys` that differs between the config dict a checkpoint saved
    and `new`; a key the old config lacks (an older checkpoint) counts as its default."""
    now, defaults = C.to_dict(new), C.to_dict(C.Config())
    out = []
    for k in keys:
        if lookup(now, k, KeyError) is KeyError:  # not a key of this version (or of its parts)
            continue
        after = lookup(now, k)
        before = lookup(old, k, lookup(defaults, k, after))
        if before != after:
            out.append((k, before, after))
    return out


def resume_plan(cfg: C.Config, picked: tuple[Path, dict] | None, world_size: int, n_trainers: int) -> dict:
    """Where a run starts (rank 0): the picked checkpoint, its progress, whether the run is
    finished, and what changed: "meaning_changes" (MEANING_KEYS, the rank split; "error"
    unless `run.allow_config_change`), "optimizer_changes" (OPTIMIZER_KEYS, and run.steps
    under a decaying schedule), "other_changes" (docs/checkpoints.md, "Resume")."""
    plan = {"path": None, "meta": None, "finished": False, "meaning_changes": [],
            "optimizer_changes": [], "other_changes": [], "error": None}
    if picked is None:
        return plan
    path, meta = picked
    old = meta.get("config", {})
    changes = changed_keys(old, cfg, MEANING_KEYS)
    saved = (meta.get("trainers", n_trainers), meta.get("world_size", world_size))
    if saved != (n_trainers, world_size):  # resharding works, but it is another experiment
        changes.append(("the rank split (trainers of ranks)", f"{saved[0]} of {saved[1]}",
                        f"{n_trainers} of {world_size}"))
    schedule = OPTIMIZER_KEYS + (("run.steps",) if cfg.train.lr_schedule != "constant" else ())
    listed = set(MEANING_KEYS + schedule)
    # A checkpoint written before optimizer_steps was kept: its steps times the updates configured.
    n_opt = meta["step"] * cfg.train.mini_batches * cfg.train.ppo_epochs
    plan.update(path=str(path), finished=meta["step"] >= cfg.run.steps, meaning_changes=changes,
                optimizer_changes=changed_keys(old, cfg, schedule),
                other_changes=changed_keys(old, cfg, tuple(  # every other key, its parts' too
                    f"{s}.{k}" for s, table in C.to_dict(cfg).items() for k in table
                    if f"{s}.{k}" not in listed)),
                meta={**{k: meta[k] for k in ("step", "version", "skipped_in_row",
                                              "skipped_total")},
                      "optimizer_steps": meta.get("optimizer_steps", n_opt),
                      "kl_coef": meta.get("kl_coef"), "stream": meta.get("stream", []),
                      "base": meta.get("base", {})})
    if changes and not cfg.run.allow_config_change:
        plan["error"] = (f"resuming {path}: " + "; ".join(f"{k} {a!r} -> {b!r}" for k, a, b in changes)
                         + " would change what the run means; set --run.allow_config_change=true "
                         "to resume anyway, or use another run.out_dir")
    return plan


# ----------------------------------------------------------------------------- the base weights
PIECES, PIECE = 64, 64  # per tensor: this many evenly spaced pieces of this many bytes


def fingerprint(model_path: str) -> str:
    """A fingerprint of the weights in `model_path`'s safetensors files, read without loading
    them: every tensor's name, dtype, shape and PIECES evenly spaced PIECE-byte pieces of its
    data (all of it when smaller). A retrained or re-initialised tensor changes it; a few values
    changed inside one large tensor may not. "" for a folder without safetensors."""
    h, parts = hashlib.blake2b(digest_size=8), []
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
            for name in sorted(k for k in header if k != "__metadata__"):
                t = header[name]
                start, end = t["data_offsets"]
                size = end - start
                spots = [0] if size <= PIECES * PIECE else [i * (size - PIECE) // (PIECES - 1)
                                                             for i in range(PIECES)]
                chunk = b""
                for at in spots:
                    fh.seek(8 + n + start + at)
                    chunk += fh.read(min(size, PIECE) if size > PIECES * PIECE else size)
                h.update(f"{name}:{t['dtype']}:{t['shape']}".encode() + chunk)
                parts.append(name)
    return f"{h.hexdigest()}-{len(parts)}" if parts else ""


def check_base(cfg: C.Config, world, model_path: str, progress, resumed: str | None) -> None:
    """Collective over the world: rank 0 fingerprints `model_path`; a resume whose checkpoint
    records another base stops every rank with one line naming both, unless
    `run.allow_new_base`. Then `progress.base` is the base this run trains on."""
    verdict = [None, None]
    if world.is_root:
        now = {"path": model_path, "fingerprint": fingerprint(model_path)}
        old = progress.base
        if resumed and old and old.get("fingerprint") != now["fingerprint"] and not cfg.run.allow_new_base:
            verdict[0] = (f"resuming {resumed}: its base weights were {old.get('path')} (fingerprint "
                          f"{old.get('fingerprint')}); model.path={model_path} now holds other "
                          f"weights ({now['fingerprint']}); set --run.allow_new_base=true to go on "
                          "on the new base, or use another run.out_dir")
        verdict[1] = now
    dist.broadcast_object_list(verdict, 0, group=world.ctrl)
    if verdict[0]:
        raise ConfigError(verdict[0])
    progress.base = verdict[1]
