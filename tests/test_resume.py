"""checkpoint.py in one process (a gloo world of one, a small stand-in policy): damaged
checkpoints named and skipped, a resumed run owning its branch, rotation keeping the resume
point, a failed save naming a full disk, and the run folder's lock and write check."""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import checkpoint as ckpt
import failures
import resume_rules


class _Saves:
    """config / tokenizer / image processor stand-ins: each writes one small file."""

    def __init__(self, name: str):
        self.name = name

    def save_pretrained(self, out) -> None:
        (Path(out) / f"{self.name}.json").write_text("{}")


@pytest.fixture
def world(gloo_world):
    yield SimpleNamespace(is_root=True, ctrl=gloo_world)
    while ckpt._HELD:
        ckpt._HELD.pop().close()


def _trainer(width: int = 16):
    torch.manual_seed(0)
    policy = torch.nn.Linear(width, width)
    policy.config = _Saves("config")
    opt = torch.optim.AdamW(policy.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return policy, opt, sched


def _step(policy, opt, sched) -> None:
    policy(torch.ones(1, policy.in_features)).sum().backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def _save(out_dir: Path, step: int, tr, keep_last: int = 10, protect=None) -> Path:
    path = ckpt.root(out_dir) / f"step_{step:06d}"
    procs = SimpleNamespace(tokenizer=_Saves("tokenizer"), image_processor=_Saves("preprocessor"),
                            chat=SimpleNamespace(template="{{ messages }}"))
    ckpt.save(path, tr, rng={"cpu": torch.get_rng_state()},
              meta={"step": step, "version": step, "skipped_in_row": 0, "skipped_total": 0.0},
              export=ckpt.Export(procs, str(path.parent), torch.float32),
              train_group=dist.group.WORLD, is_root=True, keep_last=keep_last, protect=protect)
    return path


def _run(out_dir: Path, steps: int, width: int = 16) -> dict[int, torch.Tensor]:
    """`steps` optimizer steps, a checkpoint after each; the weights at each step."""
    tr = _trainer(width)
    weights = {}
    for s in range(1, steps + 1):
        _step(*tr)
        _save(out_dir, s, tr)
        weights[s] = tr[0].weight.detach().clone()
    return weights


def _resume(out_dir: Path, named=None, width: int = 16):
    tr = _trainer(width)
    got = ckpt.resume(out_dir, named, ctrl=dist.group.WORLD, train_group=dist.group.WORLD,
                      is_root=True, rank_in_group=0, state=tr)
    return got, tr


def _shard(path: Path) -> Path:
    return next((path / "state").glob("*.distcp"))


def _garbage_same_size(p: Path) -> None:
    n = p.stat().st_size
    p.write_bytes(bytes((i * 7 + 3) % 256 for i in range(n)))


DAMAGE = {  # how the newest checkpoint is damaged -> the file the message must name
    "deleted shard": (lambda c: _shard(c).unlink(), "__0_0.distcp: missing"),
    "truncated shard": (lambda c: os.truncate(_shard(c), 100), "__0_0.distcp: 100 bytes, expected"),
    "garbage shard, same size": (lambda c: _garbage_same_size(_shard(c)), "__0_0.distcp: contents changed"),
    "garbage shard": (lambda c: _shard(c).write_bytes(b"garbage"), "__0_0.distcp: 7 bytes, expected"),
    "missing .metadata": (lambda c: (c / "state" / ".metadata").unlink(), "state/.metadata: missing"),
    "garbage .metadata": (lambda c: (c / "state" / ".metadata").write_bytes(b"\x80garbage"),
                          "state/.metadata: 8 bytes, expected"),
    "missing meta.pt": (lambda c: (c / "state" / "meta.pt").unlink(), "state/meta.pt: missing"),
    "garbage meta.pt": (lambda c: _garbage_same_size(c / "state" / "meta.pt"),
                        "state/meta.pt: contents changed"),
    "garbage manifest": (lambda c: (c / "manifest.json").write_text("{"), "manifest.json: unreadable"),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_checkpoint_is_named_and_the_newest_intact_one_is_used(tmp_path, world, kind, capsys):
    weights = _run(tmp_path, 2)
    newest = ckpt.root(tmp_path) / "step_000002"
    damage, named_file = DAMAGE[kind]
    damage(newest)
    got, (policy, _, _) = _resume(tmp_path)
    err = capsys.readouterr().err
    assert f"warning: checkpoint {newest} is damaged (" in err and named_file in err, err
    assert got.path.name == "step_000001" and got.meta["step"] == 1
    assert torch.equal(policy.weight, weights[1])
    # the damaged one is moved aside with the abandoned branch, not deleted
    [aside] = ckpt.root(tmp_path).glob("abandoned-*")
    assert (aside / "step_000002").is_dir() and not newest.exists()


@pytest.mark.parametrize("kind", ["truncated shard", "garbage meta.pt", "missing .metadata"])
def test_damaged_checkpoint_named_by_resume_stops_with_one_line(tmp_path, world, kind):
    _run(tmp_path, 2)
    newest = ckpt.root(tmp_path) / "step_000002"
    damage, named_file = DAMAGE[kind]
    damage(newest)
    with pytest.raises(failures.StartError) as e:
        _resume(tmp_path, named=str(newest))
    msg = str(e.value)
    assert msg.startswith(f"checkpoint {newest} is damaged: ") and named_file in msg
    assert "\n" not in msg and newest.is_dir()   # nothing moved: the run stops


@pytest.mark.parametrize("kind, named_file", [
    ("truncated shard", "__0_0.distcp: 100 bytes, expected at least"),
    ("garbage meta.pt", "state/meta.pt: cannot be loaded ("),
    ("garbage .metadata", "state/.metadata: unreadable"),
])
def test_checkpoint_without_manifest_is_still_checked(tmp_path, world, kind, named_file, capsys):
    """Checkpoints written before manifests: the files DCP's .metadata lists, and the load."""
    _run(tmp_path, 2)
    newest = ckpt.root(tmp_path) / "step_000002"
    (newest / "manifest.json").unlink()
    damage = {"truncated shard": lambda c: os.truncate(_shard(c), 100),
              "garbage meta.pt": lambda c: (c / "state" / "meta.pt").write_bytes(b"\x80garbage"),
              "garbage .metadata": lambda c: (c / "state" / ".metadata").write_bytes(b"\x80garbage")}
    damage[kind](newest)
    got, _ = _resume(tmp_path)
    assert named_file in capsys.readouterr().err and got.path.name == "step_000001"


def test_no_intact_checkpoint_stops_instead_of_starting_over(tmp_path, world):
    _run(tmp_path, 2)
    for c in ckpt.complete(tmp_path):
        os.truncate(_shard(c), 10)
    with pytest.raises(failures.StartError, match=r"no intact checkpoint in .*step_000002: .*"
                                                  r"step_000001: .*move them away"):
        _resume(tmp_path)


def test_intact_resume_restores_the_exact_state(tmp_path, world):
    weights = _run(tmp_path, 3)
    got, (policy, opt, sched) = _resume(tmp_path)
    assert got.path.name == "step_000003" and torch.equal(policy.weight, weights[3])
    assert got.rng is not None and sched.last_epoch == 3 and len(opt.state) == 2
    assert not list(ckpt.root(tmp_path).glob("abandoned-*"))   # nothing newer: nothing moved


def test_resumed_run_owns_its_branch_and_rotation_keeps_the_resume_point(tmp_path, world, capsys):
    """Resume from step 2 of 4, save_every = 1, keep_last = 1: steps 3 and 4 of the abandoned
    branch are moved aside (not deleted), the first new save works, and rotation never deletes
    the checkpoint the run resumed from."""
    _run(tmp_path, 4)
    named = ckpt.root(tmp_path) / "step_000002"
    got, tr = _resume(tmp_path, named=str(named))
    assert got.meta["step"] == 2
    out = capsys.readouterr().out
    assert "moved 2 checkpoint(s) newer than step 2 aside" in out and "step_000003, step_000004" in out
    [aside] = ckpt.root(tmp_path).glob("abandoned-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step_000003", "step_000004"]
    for s in (3, 4):
        _step(*tr)
        _save(tmp_path, s, tr, keep_last=1, protect=str(named))
    assert [p.name for p in ckpt.complete(tmp_path)] == ["step_000002", "step_000004"]
    assert (aside / "step_000004" / "manifest.json").is_file()   # the old branch is whole


def test_failed_save_names_a_full_disk_and_keeps_the_previous_checkpoint(tmp_path, world, monkeypatch):
    """Fault injection (any file system): the save fails with ENOSPC inside DCP's writes."""
    tr = _trainer()
    _save(tmp_path, 1, tr)
    monkeypatch.setenv("GRPO_FAULT", "checkpoint_enospc@2")
    with pytest.raises(failures.Fatal) as e:
        _save(tmp_path, 2, tr)
    assert str(e.value).startswith("checkpoint step_000002 not saved: No space left on device (")
    assert str(e.value).endswith("the previous checkpoint step_000001 is intact")
    assert sorted(p.name for p in ckpt.root(tmp_path).iterdir()) == ["step_000001"]  # no .tmp left
    monkeypatch.delenv("GRPO_FAULT")
    assert _resume(tmp_path)[0].path.name == "step_000001"


def test_a_full_disk_in_the_hf_export_leaves_no_tmp_folder(tmp_path, world, monkeypatch):
    """One trainer rank: the export's write fails with ENOSPC after writing some of its files."""
    tr, real = _trainer(), ckpt.export_hf
    _save(tmp_path, 1, tr)

    def full_disk(out, *args):
        real(out, *args)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out / "model.safetensors"))
    monkeypatch.setattr(ckpt, "export_hf", full_disk)
    with pytest.raises(failures.Fatal, match="checkpoint step_000002 not saved: No space left on "):
        _save(tmp_path, 2, tr)
    assert sorted(p.name for p in ckpt.root(tmp_path).iterdir()) == ["step_000001"]  # no .tmp left


def _mount_tmpfs(where: Path, options: str) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    where.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                       capture_output=True, text=True)
    if p.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")


def test_full_disk_during_a_save_is_named(tmp_path, world):
    """A real full file system: a 3 MiB tmpfs holds one checkpoint of this policy, not two."""
    ck = ckpt.root(tmp_path)
    _mount_tmpfs(ck, "size=3m")
    try:
        tr = _trainer(width=256)           # ~0.25 MiB of weights: hf + model + 2 Adam moments
        _save(tmp_path, 1, tr)
        assert ckpt.complete(tmp_path)
        with pytest.raises(failures.Fatal) as e:
            for s in range(2, 6):
                _step(*tr)
                _save(tmp_path, s, tr, keep_last=10)
        msg = str(e.value)
        assert "not saved: No space left on device (" in msg and "is intact" in msg, msg
        assert not list(ck.glob("*.tmp"))  # the partial folder is removed: its space is free
        last = ckpt.latest(tmp_path)
        assert f"the previous checkpoint {last.name} is intact" in msg
        assert _resume(tmp_path, width=256)[0].path == last
    finally:
        subprocess.run(["umount", str(ck)], check=False)


def test_second_job_on_a_run_folder_is_refused_with_the_holder(tmp_path, world):
    run = SimpleNamespace(out_dir=str(tmp_path), keep_last=2)
    lock = open(tmp_path / "run.lock", "a+")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)   # another open file: another job
    lock.write("nodeA 4242\n")
    lock.flush()
    with pytest.raises(failures.StartError) as e:
        ckpt.claim_run_dir(run, SimpleNamespace(is_root=True, ctrl=dist.group.WORLD))
    assert str(e.value) == (f"run folder {tmp_path} is in use by another job (host nodeA, pid "
                            "4242); stop that job or pass another --run.out_dir")
    lock.close()                                        # that job ended (or crashed): free
    ckpt.claim_run_dir(run, SimpleNamespace(is_root=True, ctrl=dist.group.WORLD))
    assert (tmp_path / "run.lock").read_text().split()[1] == str(os.getpid())


def test_unwritable_checkpoints_folder_is_found_at_start(tmp_path, world):
    ck = ckpt.root(tmp_path)
    if os.geteuid() != 0:
        ck.mkdir(parents=True)
        ck.chmod(0o555)
    else:
        _mount_tmpfs(ck, "ro,size=1m")
    try:
        with pytest.raises(failures.StartError, match=rf"cannot write to {ck} \(OSError: "
                                                      r"Read-only file system|PermissionError"):
            ckpt.claim_run_dir(SimpleNamespace(out_dir=str(tmp_path), keep_last=2),
                               SimpleNamespace(is_root=True, ctrl=dist.group.WORLD))
        # keep_last = 0 never writes checkpoints: then the folder does not matter
        while ckpt._HELD:
            ckpt._HELD.pop().close()
        ckpt.claim_run_dir(SimpleNamespace(out_dir=str(tmp_path), keep_last=0),
                           SimpleNamespace(is_root=True, ctrl=dist.group.WORLD))
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(ck)], check=False)


def test_missing_resume_and_eval_checkpoint_folders_are_named(tmp_path, world):
    w = SimpleNamespace(is_root=True, ctrl=dist.group.WORLD)
    run = SimpleNamespace(out_dir=str(tmp_path / "run"), keep_last=2)
    with pytest.raises(failures.StartError, match="--resume: no such checkpoint folder .*nope") as e:
        ckpt.claim_run_dir(run, w, resume=str(tmp_path / "nope"))
    assert e.value.prefix == "config error"
    with pytest.raises(failures.StartError, match="--resume: .* is not a checkpoint"):
        ckpt.claim_run_dir(run, w, resume=str(tmp_path))
    with pytest.raises(failures.StartError, match="--checkpoint: no such folder .*nope"):
        ckpt.claim_run_dir(run, w, eval_checkpoint=str(tmp_path / "nope"))
    with pytest.raises(failures.StartError, match="--checkpoint: .* holds no model"):
        ckpt.claim_run_dir(run, w, eval_checkpoint=str(tmp_path))
    assert not (tmp_path / "run").exists()   # checked before the run folder is touched


def _plan(old_overrides: list[str], new_overrides: list[str]) -> dict:
    import config as C
    old = C.load(str(Path(__file__).parents[1] / "configs" / "tiny.toml"), old_overrides)
    meta = {"step": 2, "version": 2, "skipped_in_row": 0, "skipped_total": 0.0,
            "config": C.to_dict(old), "world_size": 3, "trainers": 2}
    new = C.load(str(Path(__file__).parents[1] / "configs" / "tiny.toml"), new_overrides)
    return resume_rules.resume_plan(new, (Path("runs/x/checkpoints/step_000002"), meta), 3, 2)


@pytest.mark.parametrize("override, shown", [
    ("--train.mini_batches=2", "train.mini_batches 1 -> 2"),
    ("--train.ppo_epochs=2", "train.ppo_epochs 1 -> 2"),
    ("--loss.kl_coef=0.01", "loss.kl_coef 0.0 -> 0.01"),
    ('--reward.functions=[{name="geometry", weight=2.0}]', "reward.functions [{"),
])
def test_resume_refuses_a_change_of_the_update_or_the_reward(override, shown):
    """They change what a step's update, the loss or reward/mean mean: refused, named."""
    plan = _plan([], [override])
    assert plan["error"] and shown in plan["error"] and "run.allow_config_change" in plan["error"]
    allowed = _plan([], [override, "--run.allow_config_change=true"])
    assert allowed["error"] is None and allowed["meaning_changes"][0][0] == override[2:].split("=")[0]


def test_every_other_changed_key_is_listed_in_one_line_at_resume():
    import tracking
    plan = _plan(["--run.steps=2"], ["--run.steps=4", "--rollout.temperature=0.7",
                                     "--train.lr=1e-3", "--reward.timeout_s=9"])
    assert plan["error"] is None
    assert plan["other_changes"] == [("run.steps", 2, 4), ("rollout.temperature", 1.0, 0.7),
                                     ("reward.timeout_s", 5.0, 9.0)]
    assert plan["optimizer_changes"] == [("train.lr", 0.002, 0.001)]   # said by the restore
    import config as C
    cfg = C.load(str(Path(__file__).parents[1] / "configs" / "tiny.toml"), ["--run.steps=4"])
    plan["progress"] = SimpleNamespace(step=2, version=2)
    text = tracking.startup_summary(cfg, ["trainer", "trainer", "generation"], "cpu", 10, 8, 0, 0,
                                    plan, "configs/tiny.toml")
    [line] = [ln for ln in text.splitlines() if "changed since the checkpoint" in ln]
    assert line == ("   changed since the checkpoint: run.steps 2 -> 4; rollout.temperature 1.0 -> "
                    "0.7; reward.timeout_s 5.0 -> 9.0")


def _two_trainers(rank: int, port: int, out_dir: str) -> None:
    """One of two trainer ranks (tests below): step 1 saved, step 2's HF export fails with ENOSPC
    on rank 0, step 3's training-state write on rank 1 alone (GRPO_FAULT ...:1); each rank
    writes the line it failed with to rank<r>.txt."""
    import datetime
    os.environ.update(RANK=str(rank), OMP_NUM_THREADS="1", GRPO_FAULT="checkpoint_enospc@3:1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    real, lines = ckpt.export_hf, []

    def full_disk(out, *args):
        real(out, *args)  # its files written, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out))
    try:
        tr, procs = _trainer(), SimpleNamespace(tokenizer=_Saves("tokenizer"), image_processor=None,
                                                chat=SimpleNamespace(template="{{ messages }}"))
        for step in (1, 2, 3):
            ckpt.export_hf = full_disk if step == 2 and rank == 0 else real
            path = ckpt.root(Path(out_dir)) / f"step_{step:06d}"
            try:
                ckpt.save(path, tr, rng={"cpu": torch.get_rng_state()}, meta={"step": step, "version": step},
                          export=ckpt.Export(procs, str(path.parent), torch.float32),
                          train_group=dist.group.WORLD, is_root=rank == 0, keep_last=10)
            except failures.Fatal as e:
                lines.append(str(e))
        (Path(out_dir) / f"rank{rank}.txt").write_text("\n".join(lines))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes
def test_a_save_failing_on_one_trainer_rank_leaves_no_tmp_folder(tmp_path):
    """Two trainer ranks: a full disk in rank 0's HF export (rank 1 would go on into DCP's save,
    which makes step_N.tmp/state again after rank 0 removed it) or in rank 1's state write alone
    (rank 0 would wait in the next collective until torn down, never removing it): every rank
    stops together, both name the save, no step_N.tmp stays, the previous checkpoint does."""
    import torch.multiprocessing as mp

    from world import free_port
    mp.spawn(_two_trainers, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    assert sorted(p.name for p in ckpt.root(tmp_path).iterdir()) == ["step_000001"]  # no .tmp left
    r0, r1 = ((tmp_path / f"rank{r}.txt").read_text().splitlines() for r in (0, 1))
    assert r0[0].startswith("checkpoint step_000002 not saved: No space left on device (")
    assert r1[0].startswith("checkpoint step_000002 not saved: ")
    assert "the HF export failed on another rank" in r1[0] or "No space left" in r1[0]
    assert r1[1].startswith("checkpoint step_000003 not saved: No space left on device (")
    assert "the training state failed on another rank" in r0[1] or "No space left" in r0[1]
    assert all(line.endswith("the previous checkpoint step_000001 is intact") for line in r0 + r1)
