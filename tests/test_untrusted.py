"""What a file or a network peer of a run can make it do: a checkpoint's meta.pt is read as
plain data only (a planted object is refused in one line, nothing runs), `--eval-only` of an HF
export needs no training state; on one node no listener of the project is reachable from
another machine."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import checkpoint_read
from tests.util import ROOT, TINY, end_group, env, train_py


class Planted:
    """What an attacker writes into meta.pt: unpickling it runs `touch <flag>`."""

    def __init__(self, flag: Path):
        self.flag = str(flag)

    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


def _meta(folder: Path, flag: Path | None) -> None:
    (folder / "state").mkdir(parents=True, exist_ok=True)
    meta = {"step": 3, "version": 3, "skipped_in_row": 0, "skipped_total": 0.0, "sched": {},
            "rng": [{"cpu": torch.get_rng_state()}], "config": {"run": {"seed": 1}}}
    if flag is not None:
        meta["x"] = Planted(flag)
    torch.save(meta, folder / "state" / "meta.pt")


def test_meta_pt_is_read_as_plain_data_and_a_planted_object_is_refused(tmp_path):
    plain, bad, flag = tmp_path / "plain", tmp_path / "bad", tmp_path / "ran"
    _meta(plain, None)
    _meta(bad, flag)
    assert checkpoint_read.read_meta(plain)["step"] == 3 and checkpoint_read.eval_step(plain) == 3
    assert torch.equal(checkpoint_read.read_meta(plain)["rng"][0]["cpu"], torch.get_rng_state())
    with pytest.raises(checkpoint_read.Refused, match=r"^checkpoint .*bad refused: state/meta.pt holds "
                       r"more than plain data \(posix.system\), and loading it would run code"):
        checkpoint_read.read_meta(bad)
    assert "posix.system" in checkpoint_read.eval_problem(bad)
    assert not flag.exists()
    assert checkpoint_read.eval_step(tmp_path) == -1   # an HF export: no training state needed
    # --eval-only checks what it reads against the manifest: hf/ and meta.pt, not the shards
    (plain / "hf").mkdir()
    (plain / "hf" / "config.json").write_text("{}")
    (plain / "state" / "__0_0.distcp").write_bytes(b"x")
    files = {n: [(plain / n).stat().st_size, checkpoint_read.crc(plain / n)]
             for n in ("hf/config.json", "state/meta.pt", "state/__0_0.distcp")}
    (plain / "manifest.json").write_text(json.dumps({"files": files}))
    (plain / "state" / "__0_0.distcp").write_bytes(b"y")
    assert checkpoint_read.eval_problem(plain) is None
    (plain / "hf" / "config.json").write_text("[]")
    assert checkpoint_read.eval_problem(plain) == (f"checkpoint {plain} is damaged: hf/config.json: "
                                                   "contents changed since the save (CRC-32 mismatch)")


def test_no_pickle_the_project_writes_is_loaded_with_code_execution():
    """Every torch.load of the project passes weights_only=True; no pickle.load at all (DCP's
    own `.metadata` read is torch's, and docs/checkpoints.md says it must be trusted)."""
    found = []
    for f in ROOT.glob("**/*.py"):
        if "tests" in f.relative_to(ROOT).parts or ".venv" in f.parts:
            continue
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if re.search(r"torch\.load\((?!.*weights_only=True)|pickle\.loads?\(|weights_only=False",
                         line):
                found.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []


def _ours(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith(("error:", "config error:", "warning:"))]


@pytest.mark.slow
def test_a_planted_meta_pt_stops_resume_and_eval_only_and_an_export_evaluates_alone(tmp_path):
    """A 1-step run's checkpoint with an object planted in meta.pt (and the manifest's CRC
    rewritten to match, as an attacker would): resuming and `--eval-only` each print one line,
    exit 2, and the planted command never runs. The checkpoint's `hf/` alone, copied elsewhere,
    evaluates (no training state)."""
    run = tmp_path / "run"
    p = train_py([*TINY, f"--run.out_dir={run}", "--run.steps=1", "--run.save_every=1"], env=env())
    assert p.returncode == 0, p.stderr[-3000:]
    ck = run / "checkpoints" / "step_000001"
    flag = tmp_path / "ran"
    meta = torch.load(ck / "state" / "meta.pt", weights_only=True)
    torch.save({**meta, "x": Planted(flag)}, ck / "state" / "meta.pt")
    m = json.loads((ck / "manifest.json").read_text())
    f = ck / "state" / "meta.pt"
    m["files"]["state/meta.pt"] = [f.stat().st_size, checkpoint_read.crc(f)]
    (ck / "manifest.json").write_text(json.dumps(m))
    line = (f"error: checkpoint {ck} refused: state/meta.pt holds more than plain data "
            "(posix.system), and loading it would run code (docs/checkpoints.md, \"What a "
            "checkpoint can run\")")
    for args in ([f"--run.out_dir={run}", "--run.steps=2"],                  # the newest: picked
                 [f"--run.out_dir={run}", "--run.steps=2", "--resume", str(ck)],
                 [f"--run.out_dir={tmp_path / 'ev'}", "--eval-only", "--checkpoint", str(ck)]):
        q = train_py([*TINY, *args, "--run.eval_size=2"], env=env())
        assert q.returncode == 2, q.stderr[-3000:]
        assert _ours(q.stderr) == [line] and "Traceback" not in q.stderr
        assert not flag.exists()
    export = tmp_path / "export"
    shutil.copytree(ck / "hf", export)
    q = train_py([*TINY, f"--run.out_dir={tmp_path / 'ev2'}", "--eval-only", "--checkpoint",
                  str(export), "--run.eval_size=2"], env=env())
    assert q.returncode == 0, q.stderr[-3000:]
    assert (tmp_path / "ev2" / "eval.jsonl").is_file() and not flag.exists()


@pytest.mark.slow
def test_a_one_node_run_listens_on_the_loopback_only_but_for_torchruns_own_stores(tmp_path):
    """The 3-rank demo under `torchrun --standalone`: every socket its ranks listen on is on the
    loopback. torchrun's own agent serves its two stores (the rendezvous and the one MASTER_PORT
    names) on every interface: torch's TCPStore binds the wildcard address whatever host it is
    given (torch 2.10-2.13), which docs/gpu-npu.md ("Ports") says."""
    import signal
    import subprocess
    import sys
    import time

    from tests.util import listeners, torchrun_cmd
    seen: dict = {}
    p = subprocess.Popen(torchrun_cmd(3, [*TINY, "--run.steps=3", "--run.keep_last=0",
                                          f"--run.out_dir={tmp_path}"], warm=False),
                         cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while p.poll() is None and time.monotonic() < deadline:
            for addr, pids in listeners(p.pid).items():
                seen.setdefault(addr, set()).update(pids)
            time.sleep(0.2)
    finally:
        end_group(p)
    assert p.returncode == 0
    # a socket the agent holds is the agent's, even while a rank it forks still holds the inherited
    # descriptor (between fork and exec, longer on a busy machine)
    ranks = {a: pids - {p.pid} for a, pids in seen.items() if p.pid not in pids}
    assert len(ranks) >= 3 and all(a[0].startswith(("127.", "::1")) for a in ranks), {a: p for a, p in seen.items() if not a[0].startswith(("127.", "::1"))}
    agent = [a for a, pids in seen.items() if p.pid in pids]
    assert len(agent) <= 2, seen
