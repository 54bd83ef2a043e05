"""Checkpoints: an HF-format export for evaluation tools, and the exact training state to resume.

A checkpoint is `<out_dir>/checkpoints/step_<N>/` (`hf/`, `adapter/` with LoRA, `state/`,
`manifest.json`), written to `step_<N>.tmp/` and renamed when complete; resume picks the newest
intact one; rank 0 locks the run folder. Layout and protocol: docs/checkpoints.md.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_state_dict)

import config as C
import device as D
import families as F
import lora
import resume_rules
from checkpoint_read import (MANIFEST, Refused, crc as _crc, eval_problem as _eval_problem,  # noqa: F401
                             eval_step, file_problem as _file_problem, read_meta)
from errors import ConfigError, StartError, causes, one_line
from failures import Fatal, fault_active, together

_STEP = re.compile(r"^step_(\d+)$")
LOCK = "run.lock"
_HELD: list = []  # the run folder's lock: an open file, held as long as this process lives


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


# ----------------------------------------------------------------------------- the run folder
def claim_run_dir(run, world, resume: str | None = None, eval_checkpoint: str | None = None) -> None:
    """Before anything is built, collective over `world.ctrl`: rank 0 locks `run.out_dir` and
    checks that it (and `checkpoints/` when saving) is writable and that `--resume` /
    `--checkpoint` exist; every rank raises the same :class:`StartError`."""
    saves = run.keep_last > 0 and eval_checkpoint is None
    problem = _bcast(_claim(Path(run.out_dir), saves, resume, eval_checkpoint)
                     if world.is_root else None, world.ctrl)
    if problem:
        raise StartError(problem[1], prefix=problem[0])


def _claim(out_dir: Path, checkpoints: bool, resume: str | None,
           eval_checkpoint: str | None) -> tuple[str, str] | None:
    if resume is not None and not (Path(resume) / "state").is_dir():
        return ("config error", f"--resume: no such checkpoint folder {resume}" if not
                Path(resume).exists() else f"--resume: {resume} is not a checkpoint (no state/)")
    if eval_checkpoint is not None and not Path(eval_checkpoint).is_dir():
        return "config error", f"--checkpoint: no such folder {eval_checkpoint}"
    if eval_checkpoint is not None and not any(
            (Path(eval_checkpoint) / f).is_file() for f in ("hf/config.json", "config.json")):
        return "config error", (f"--checkpoint: {eval_checkpoint} holds no model (neither "
                                "hf/config.json nor config.json)")
    if eval_checkpoint is not None and (problem := _eval_problem(Path(eval_checkpoint))):
        return "error", problem
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        f = open(out_dir / LOCK, "a+")
    except OSError as e:
        return "error", _unwritable(out_dir, e)
    import fcntl
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().split()
        f.close()
        who = (f"host {holder[0]}, pid {holder[1]}" if len(holder) == 2 else "holder unknown")
        return "error", (f"run folder {out_dir} is in use by another job ({who}); stop that job "
                         "or pass another --run.out_dir")
    except OSError as e:  # a file system without locks (Lustre without -o flock, ...)
        print(f"warning: cannot lock {out_dir / LOCK} ({e.strerror}): a second job on this run "
              "folder would not be detected", file=sys.stderr, flush=True)
    f.truncate(0)
    f.write(f"{socket.gethostname()} {os.getpid()}\n")
    f.flush()
    _HELD.append(f)
    for d in [out_dir] + ([root(out_dir)] if checkpoints else []):
        probe = d / f".write-test-{os.getpid()}"
        try:
            d.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            return "error", _unwritable(d, e)
    return None


def _unwritable(d: Path, e: OSError) -> str:
    return (f"cannot write to {d} ({type(e).__name__}: {e.strerror or e}); fix its permissions "
            "or pass another --run.out_dir")


# ----------------------------------------------------------------------------- saving
@dataclass
class Progress:
    """What a checkpoint must carry beyond the weights (the data position is the step)."""
    step: int = 0
    version: int = 0           # weight version the engines hold
    skipped_in_row: int = 0    # consecutive non-finite steps
    skipped_total: float = 0.0
    resumed_from: str = ""     # the checkpoint this run resumed from (rotation keeps it)
    optimizer_steps: int = 0   # optimizer steps taken (train/optimizer_steps)
    kl_coef: float | None = None  # the adaptive KL coefficient (loss.kl_target), None: loss.kl_coef
    stream: list = field(default_factory=list)  # running-ahead engines: [batch, groups taken] each (pipeline.py)
    base: dict = field(default_factory=dict)    # the base weights the run started from: path, fingerprint


class Export(NamedTuple):  # what the HF export (export_hf) is made of besides the weights
    procs: Any
    source: str         # the model folder the run started from (its generation config)
    dtype: torch.dtype
    keep_every: int = 0  # run.export_every: which exports outlive their checkpoints' rotation


def save_progress(cfg: C.Config, world, tr, procs, source: str, dev, out_dir: Path,
                  progress: Progress) -> None:
    """The loop's save, every `run.save_every` steps and at the end: trainer `tr` at `progress`
    (collective over the trainer ranks, a no-op elsewhere); `source`: the starting model folder."""
    r, done = cfg.run, progress.step
    due = any(k and done % k == 0 for k in (r.save_every, r.export_every)) or done == r.steps
    if r.keep_last <= 0 or not due or tr is None:
        return
    meta = {k: v for k, v in vars(progress).items() if k != "resumed_from"}  # step = done
    save(root(out_dir) / f"step_{done:06d}", (tr.policy, tr.opt, tr.sched), rng=D.rng_state(dev),
         ref=tr.ref if cfg.train.ref_update_every else None,  # a moving one
         meta={**meta, "config": C.to_dict(cfg), "world_size": world.size},
         export=Export(procs, source, getattr(torch, cfg.model.dtype), r.export_every),
         train_group=world.train_group, is_root=world.is_root, keep_last=r.keep_last, protect=progress.resumed_from)


def save(path_final: Path, state: tuple, *, meta: dict, rng: dict, export: Export, train_group,
         is_root: bool, keep_last: int, protect: str | Path | None = None, ref=None) -> None:
    """Collective over the trainer ranks; `state`: (policy, optimizer, LR schedule); `ref`: a
    moving reference policy, saved too. A failure raises `failures.Fatal` naming the cause (the
    previous checkpoint stays). Keeps the last `keep_last`, never `protect` (the resume point)."""
    tmp = path_final.with_name(path_final.name + ".tmp")
    try:
        _write(tmp, state, meta, rng, export, train_group, is_root, ref)
    except (Exception, CheckpointException) as e:
        raise Fatal(_save_failed(path_final, tmp, e, is_root)) from e
    if fault_active("checkpoint_before_rename", meta["step"]):  # tests: die mid-write
        os.kill(os.getpid(), signal.SIGKILL)
    if is_root:
        if path_final.exists():  # never on a normal run (the branch was cleared at resume)
            _move_aside(path_final.parent, [path_final])
        tmp.rename(path_final)  # the commit point
        if fault_active("checkpoint_after_rename", meta["step"]):  # tests: die right after it
            os.kill(os.getpid(), signal.SIGKILL)
        keep = Path(protect).resolve() if protect else None
        for old in complete(path_final.parent.parent)[:-keep_last]:
            if old.resolve() != keep:
                _keep_export(old, export.keep_every)
                shutil.rmtree(old, ignore_errors=True)


def _keep_export(old: Path, every: int) -> None:
    """run.export_every: a rotated checkpoint's HF export (and LoRA adapters) at a multiple of
    `every` steps moves to <run>/exports/step_N (a rename: no copy)."""
    if every and int(_STEP.match(old.name).group(1)) % every == 0:
        dest = old.parent.parent / "exports" / old.name
        dest.mkdir(parents=True, exist_ok=True)
        for part in ("hf", "adapter"):
            if (old / part).is_dir():
                (old / part).rename(dest / part)


def _write(tmp: Path, state: tuple, meta, rng, export: Export, train_group, is_root, ref) -> None:
    policy, opt, sched = state
    if is_root:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "state").mkdir(parents=True)
    dist.barrier(group=train_group)
    # (a) the HF export: full tensors gathered to every rank (collective), written by rank 0.
    full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True,
                                                                  cpu_offload=True))
    together(train_group, "checkpoint: the HF export", lambda: export_hf(
        tmp / "hf", full, policy, export.procs, export.source, export.dtype), is_root)
    del full
    if fault_active("checkpoint_mid_write", meta["step"]):  # tests: a rank killed mid-save
        os.kill(os.getpid(), signal.SIGKILL)
    # (b) the training state, sharded: every trainer rank writes its own part.
    model_sd, optim_sd = _trained_state(policy, opt)
    sharded = {"model": model_sd, "optim": optim_sd}
    if ref is not None:
        sharded["ref"] = get_model_state_dict(ref)

    def training_state() -> None:
        dcp.save(sharded, checkpoint_id=str(tmp / "state"), process_group=train_group)
        if fault_active("checkpoint_enospc", meta["step"]):  # tests: a full disk (any rank)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "state"))
    together(train_group, "checkpoint: the training state", training_state)
    metas: list = [None] * dist.get_world_size(train_group)
    dist.all_gather_object(metas, rng, group=train_group)
    if is_root:
        torch.save({**meta, "sched": sched.state_dict(), "rng": metas}, tmp / "state" / "meta.pt")
    dist.barrier(group=train_group)
    write_manifest(tmp, train_group, is_root)


def write_manifest(folder: Path, train_group, is_root: bool) -> None:
    """`manifest.json` (every file's size and CRC-32), collective: the ranks share the sums."""
    files = _bcast(sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                          if p.is_file()) if is_root else None, train_group)
    sums: list = [None] * dist.get_world_size(train_group)
    dist.all_gather_object(sums, {f: [(folder / f).stat().st_size, _crc(folder / f)]
                                  for f in _share(files, train_group)}, group=train_group)
    if is_root:
        entries = dict(sorted((k, v) for part in sums for k, v in part.items()))
        (folder / MANIFEST).write_text(json.dumps({"files": entries}))
    dist.barrier(group=train_group)


def _save_failed(final: Path, tmp: Path, e: BaseException, is_root: bool) -> str:
    """One line: which checkpoint was not saved and why; rank 0 removes the partial folder."""
    try:
        free = shutil.disk_usage(final.parent).free
    except OSError:
        free = -1
    full = any(isinstance(c, OSError) and c.errno == errno.ENOSPC or "No space left" in str(c)
               for c in causes(e)) or 0 <= free < 1 << 20
    why = (f"No space left on device ({final.parent}: {free / 2**20:.1f} MiB free)" if full
           else one_line(e))
    if is_root:
        shutil.rmtree(tmp, ignore_errors=True)
    prev = latest(final.parent.parent)
    return (f"checkpoint {final.name} not saved: {why}; " +
            (f"the previous checkpoint {prev.name} is intact" if prev else "no earlier checkpoint"))


def _trained_state(policy, opt) -> tuple[dict, dict]:
    """The (model, optimizer) state dicts of what trains: with LoRA the adapters only (every
    frozen name left out, tied aliases too); without LoRA the state dicts as they are."""
    model_sd, optim_sd = get_state_dict(policy, opt)
    frozen = {n for n, p in policy.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_sd.items() if k not in frozen}, optim_sd


def export_hf(out: Path, full: dict, model, procs, source: str, dtype: torch.dtype) -> None:
    """Write `hf/` (docs/checkpoints.md, "Layout") from `full` (in-memory names; with LoRA
    merged, and the adapters to `adapter/` beside `out`); `source`: its generation config."""
    out.mkdir(parents=True, exist_ok=True)
    F.write_weights(out, lora.plain_model(model), lora.merged_state_dict(model, full), dtype)
    if lora.has_lora(model):
        lora.write_adapter(out.parent / "adapter", model, full, source)
    model.config.save_pretrained(out)
    gen = Path(source) / "generation_config.json"
    if gen.is_file():
        shutil.copyfile(gen, out / gen.name)
    procs.tokenizer.save_pretrained(out)
    if not (out / "chat_template.jinja").is_file():  # a VLM whose template is the processor's
        (out / "chat_template.jinja").write_text(procs.chat.template)
    if procs.image_processor is not None:  # the source's own, not the run's model.min/max_pixels:
        # an evaluator (VLMEvalKit) then bounds images as it would for the base model (a source
        # folder without one, e.g. a hand-made test model: the run's)
        own = (Path(source) / "preprocessor_config.json").is_file()
        (F.image_processor_cls().from_pretrained(source) if own else procs.image_processor).save_pretrained(out)


# ----------------------------------------------------------------------------- resuming
class Resumed(NamedTuple):
    path: Path
    meta: dict        # step, version, skipped_in_row, skipped_total, sched, rng (every trainer's)
    rng: dict | None  # this trainer rank's RNG state; None: keep the seeded one (resharded)


def plan(cfg: C.Config, world, out_dir: Path, named: str | None) -> dict:
    """Collective over the world, before anything is built: :func:`pick`, then
    :func:`resume_rules.resume_plan` on rank 0, on every rank with its :class:`Progress` under "progress"; a
    refused resume is a ConfigError on every rank."""
    picked = pick(out_dir, named, ctrl=world.ctrl, train_group=world.train_group,
                  is_root=world.is_root, is_trainer=world.is_trainer)
    p = _bcast(resume_rules.resume_plan(cfg, picked, world.size, len(world.trainers)) if world.is_root else None,
               world.ctrl)
    if p["error"]:
        raise ConfigError(p["error"])
    m = p.pop("meta")
    p["progress"] = Progress(**m, resumed_from=p["path"]) if m else Progress()
    if m and world.is_root and not p["finished"]:
        abandon_newer(out_dir, m["step"])  # this run owns its branch from here on
    return p


def pick(out_dir: Path, named: str | None, *, ctrl, train_group, is_root: bool,
         is_trainer: bool) -> tuple[Path, dict] | None:
    """The checkpoint to resume from, collective over every rank: `named`, else the newest
    whose manifest and meta.pt check out (a damaged one is named and skipped; a damaged `named`
    raises :class:`StartError`). Returns (path, meta without RNG and schedule) or None."""
    cands = _bcast(([str(p) for p in reversed(complete(out_dir))] if named is None else [named])
                   if is_root else None, ctrl)
    damaged = []
    for c in cands:
        problem = _verify(Path(c), train_group, is_root) if is_trainer else None
        meta = refused = None
        if is_root and problem is None:
            try:
                meta = read_meta(Path(c))
                for key in ("step", "version", "skipped_in_row", "skipped_total", "rng", "sched"):
                    meta[key]  # noqa: B018 - a KeyError names what is missing
                meta["trainers"] = len(meta.pop("rng"))
                meta.pop("sched")
            except Refused as e:
                refused, meta = str(e), None
            except Exception as e:  # noqa: BLE001 - a damaged file raises anything
                problem, meta = f"state/meta.pt: cannot be loaded ({one_line(e)})", None
        problem, meta, refused = _bcast((problem, meta, refused) if is_root else None, ctrl)
        if refused:
            raise Refused(refused)
        if problem is None:
            return Path(c), meta
        if named is not None:
            raise StartError(f"checkpoint {c} is damaged: {problem}")
        damaged.append(f"{Path(c).name}: {problem}")
        if is_root:
            print(f"warning: checkpoint {c} is damaged ({problem}); trying the next older one",
                  file=sys.stderr, flush=True)
    if damaged:
        raise StartError(f"no intact checkpoint in {root(out_dir)} ({'; '.join(damaged)}); "
                         "move them away to start fresh, or pass --resume")
    return None


def load(path: Path, state: tuple, train_group, is_root: bool, rank_in_group: int,
         ref=None, changes: list | None = None) -> dict | None:
    """Restore `state` (policy, optimizer, schedule), and `ref` when saved, in place; collective
    over the trainer ranks. Returns this rank's RNG state, or None when another number of
    trainer ranks wrote it (resharded; the seeded RNG stays). A failure raises :class:`StartError`:
    "incompatible with this config" when `changes` (the meaning changes run.allow_config_change
    let through: (key, old, new)) are there, else "damaged"."""
    problem, meta = _load(path, state, train_group, is_root, ref)  # the same problem on every rank
    if problem is not None and changes:
        raise StartError(f"checkpoint {path} is incompatible with this config: "
                         + "; ".join(f"{k} {a!r} -> {b!r}" for k, a, b in changes)
                         + f" ({problem}); resume without that change, or use another run.out_dir")
    if problem is not None:
        raise StartError(f"checkpoint {path} is damaged: {problem}; move it aside to resume from "
                         "an older one")
    n_saved, n_now = len(meta["rng"]), dist.get_world_size(train_group)
    if n_saved == n_now:
        return meta["rng"][rank_in_group]
    if is_root:
        print(f"resuming a checkpoint of {n_saved} trainer rank(s) on {n_now}: weights and "
              "optimizer state resharded; RNG states not restored (each trainer rank keeps its "
              "seeded state), so this run is not bit-exact with an uninterrupted one", flush=True)
    return None


def resume(out_dir: Path, named: str | None, *, ctrl, train_group, is_root: bool,
           rank_in_group: int, state: tuple | None) -> Resumed | None:
    """:func:`pick`, :func:`abandon_newer` and :func:`load` in one call (scripts and tests);
    `state`: (policy, optimizer, schedule) on trainer ranks, None elsewhere."""
    picked = pick(out_dir, named, ctrl=ctrl, train_group=train_group, is_root=is_root,
                  is_trainer=state is not None)
    if picked is None:
        return None
    path, meta = picked
    if is_root:
        abandon_newer(out_dir, meta["step"])
    rng = load(path, state, train_group, is_root, rank_in_group) if state is not None else None
    return Resumed(path, meta, rng)


def abandon_newer(out_dir: Path, step: int) -> None:
    """A resumed run owns its branch: move every checkpoint newer than `step` aside (rank 0)."""
    newer = [p for p in complete(out_dir) if int(p.name.split("_")[1]) > step]
    if newer:
        dest = _move_aside(root(out_dir), newer)
        print(f"moved {len(newer)} checkpoint(s) newer than step {step} aside (this run continues "
              f"from step {step}): {', '.join(p.name for p in newer)} -> {dest}", flush=True)


def _verify(path: Path, train_group, is_root: bool) -> str | None:
    """The first damaged file of checkpoint `path` ("state/__0_0.distcp: 12 bytes, expected
    812345"), or None; every trainer rank gets the same answer."""
    listing = None
    if is_root:
        try:
            listing = json.loads((path / MANIFEST).read_text())["files"]
        except FileNotFoundError:
            listing = _legacy_problem(path)  # written before manifests: a str or None
        except (OSError, ValueError, KeyError, TypeError) as e:
            listing = f"{MANIFEST}: unreadable ({type(e).__name__})"
    listing = _bcast(listing, train_group)
    if not isinstance(listing, dict):
        return listing
    names = sorted(listing)
    mine = _share(names, train_group)
    found = next((bad for name in mine if (bad := _file_problem(path, name, *listing[name]))), None)
    got: list = [None] * dist.get_world_size(train_group)
    dist.all_gather_object(got, found, group=train_group)
    return next((g for g in got if g), None)


def _legacy_problem(path: Path) -> str | None:
    """A checkpoint without a manifest: its required files and DCP's listed shards are whole."""
    for name in ("state/.metadata", "state/meta.pt", "hf/model.safetensors", "hf/config.json"):
        if not (path / name).is_file():
            return f"{name}: missing"
    try:
        md = dcp.FileSystemReader(str(path / "state")).read_metadata()
        ends: dict[str, int] = {}
        for info in md.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:  # noqa: BLE001 - a garbage pickle raises anything
        return f"state/.metadata: unreadable ({type(e).__name__})"
    for rel, end in sorted(ends.items()):
        p = path / "state" / rel
        if not p.is_file():
            return f"state/{rel}: missing"
        if p.stat().st_size < end:
            return f"state/{rel}: {p.stat().st_size} bytes, expected at least {end}"
    return None


def _load(path: Path, state: tuple, train_group, is_root: bool,
          ref=None) -> tuple[str | None, dict | None]:
    """Restore policy, optimizer, schedule (and `ref` if saved) in place from `path` on every
    trainer rank; returns (the first rank's error or None, this rank's meta)."""
    policy, opt, sched = state
    problem, meta = None, None
    try:
        model_sd, optim_sd = _trained_state(policy, opt)
        sd = {"model": model_sd, "optim": optim_sd}
        saved = dcp.FileSystemReader(str(path / "state")).read_metadata().state_dict_metadata
        if ref is not None and any(k.startswith("ref.") for k in saved):
            sd["ref"] = get_model_state_dict(ref)
        dcp.load(sd, checkpoint_id=str(path / "state"), process_group=train_group)
        frozen = any(not p.requires_grad for p in policy.parameters())  # LoRA's base: not saved
        set_state_dict(policy, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                       options=StateDictOptions(strict=not frozen))
        if "ref" in sd:
            set_model_state_dict(ref, sd["ref"])
    except (Exception, CheckpointException) as e:
        problem = f"state/: cannot be loaded ({one_line(e)})"
    if problem is None:
        try:
            meta = read_meta(path)
            sched.load_state_dict(meta["sched"])
            for key in ("step", "version", "skipped_in_row", "skipped_total", "rng"):
                meta[key]  # noqa: B018 - a KeyError names what is missing
        except Exception as e:  # noqa: BLE001 - a damaged file raises anything
            problem = f"state/meta.pt: cannot be loaded ({one_line(e)})"
    got: list = [None] * dist.get_world_size(train_group)
    dist.all_gather_object(got, problem, group=train_group)
    return next((g for g in got if g), None), meta


def _move_aside(ckpt_root: Path, paths: list[Path]) -> Path:
    dest = ckpt_root / time.strftime("abandoned-%Y%m%d-%H%M%S")
    n = 1
    while dest.exists():
        n += 1
        dest = ckpt_root / time.strftime(f"abandoned-%Y%m%d-%H%M%S-{n}")
    dest.mkdir()
    for p in paths:
        p.rename(dest / p.name)
    return dest


# ----------------------------------------------------------------------------- helpers
def _share(items: list, group) -> list:
    """This rank's share of `items` (round robin over the group)."""
    return items[dist.get_rank(group):: dist.get_world_size(group)]


def _bcast(obj: Any, group) -> Any:
    """`obj` of the group's first rank (global rank 0 for every group here), on every member."""
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]
