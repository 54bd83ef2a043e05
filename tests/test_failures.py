"""Fail fast, name the culprit: dead and hung ranks, NaNs, bad config, failing rewards."""
from __future__ import annotations

import fcntl
import re
import signal
import subprocess
import sys
import time

import pytest

import failures
import rewards
from tests.util import ROOT, TINY, env, free_port, metrics, torchrun_cmd, train_py

TIMEOUT = 20  # cluster.timeout_s in these tests


def launch(tmp_path, fault: str | None, *extra: str, timeout: float = 240, warm: bool = True):
    """3 ranks under torchrun; each rank is train.py forked from the warm server (tests/warm.py)
    unless not `warm`."""
    e = env(warm)
    if fault:
        e["GRPO_FAULT"] = fault
    cmd = torchrun_cmd(3, [*TINY, f"--run.out_dir={tmp_path}", "--run.keep_last=0",
                           f"--cluster.timeout_s={TIMEOUT}", *extra], warm=warm)
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


def _last_step_time(out_dir) -> float:
    return (out_dir / "metrics.jsonl").stat().st_mtime


@pytest.mark.slow
@pytest.mark.parametrize("victim, role", [(2, "generation"), (1, "trainer")])
def test_killed_rank_stops_the_job_and_is_named(tmp_path, victim, role):
    p, _ = launch(tmp_path, f"die@2:{victim}", "--run.steps=6")
    end = time.time()
    assert p.returncode != 0
    assert f"rank {victim} ({role}) died" in p.stderr, p.stderr[-3000:]
    assert "stopped by SIGTERM" not in p.stderr   # torchrun's SIGTERM to the survivors: not a user's stop
    assert [r["step"] for r in metrics(tmp_path)] == [0, 1]
    # every rank was gone within the collective timeout plus a margin of the last logged step
    assert end - _last_step_time(tmp_path) < TIMEOUT + 30


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_trainer_killed_mid_save_is_named_as_the_dead_rank(tmp_path, victim):
    """A trainer killed while the checkpoint's training state is written: every survivor's line
    names it as the dead rank (the other trainer's failed save included), none blames itself."""
    p, _ = launch(tmp_path, f"checkpoint_mid_write@2:{victim}", "--run.steps=4", "--run.save_every=2",
                  "--run.keep_last=2")
    assert p.returncode != 0
    ours = [ln for ln in _ours(p.stderr) if ln.startswith("error:")]
    assert len(ours) == 2, p.stderr[-3000:]
    assert all(f"rank {victim} (trainer) died" in ln for ln in ours), ours
    assert not (tmp_path / "checkpoints" / "step_000002").exists()


@pytest.mark.slow
def test_hung_rank_times_out_and_is_named(tmp_path):
    p, _ = launch(tmp_path, "hang@1:2", "--run.steps=4", "--cluster.timeout_s=8")
    end = time.time()
    assert p.returncode != 0
    assert "rank 2 (generation) is stuck in 'step 1: hung'" in p.stderr, p.stderr[-3000:]
    assert "Timed out waiting 8000ms" in p.stderr
    # the hung rank itself is stopped (abort notice or the launcher), not left behind
    assert "rank 2 (generation) stopp" in p.stderr, p.stderr[-3000:]
    assert end - _last_step_time(tmp_path) < 8 + 30


@pytest.mark.slow
def test_nan_steps_are_skipped_counted_and_consecutive_ones_stop_the_run(tmp_path):
    """A non-finite loss at steps 1, 3 and 4 (every trainer rank), train.max_skipped_steps = 2:
    step 1 is skipped and counted, its NaN logged as it was, and the run goes on (step 2
    trains); steps 3 and 4 are 2 in a row: the run stops after logging step 4, saying why."""
    p, _ = launch(tmp_path, "nan_loss@1,nan_loss@3,nan_loss@4", "--run.steps=6",
                  "--train.max_skipped_steps=2")
    assert p.returncode != 0
    assert "2 consecutive steps had a non-finite loss" in p.stderr, p.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["train/skipped"] for r in rows] == [0.0, 1.0, 0.0, 1.0, 1.0]
    assert rows[2]["train/skipped_steps"] == 1.0 and rows[-1]["train/skipped_steps"] == 3.0
    assert rows[1]["grad_norm"] != rows[1]["grad_norm"]  # nan logged as it was


def test_several_faults_in_one_spec(monkeypatch):
    """GRPO_FAULT holds several comma-separated specs (one run, several faults)."""
    import failures
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("GRPO_FAULT", "nan_loss@1,nan_loss@3:0,die@5:7")
    assert [s for s in range(6) if failures.fault_active("nan_loss", s)] == [1, 3]
    assert not failures.fault_active("die", 5)       # for rank 7 only
    monkeypatch.setenv("GRPO_FAULT", "nan_loss")
    assert failures.fault_active("nan_loss", 0) and not failures.fault_active("die", 0)


@pytest.mark.slow
def test_engine_start_up_has_its_own_deadline_apart_from_the_collective_timeout(tmp_path):
    """An engine that takes 1.5 x cluster.timeout_s to start (vLLM profiling and compiling on a
    loaded machine): the job waits for it under rollout.start_timeout_s and trains; with a
    start-up deadline shorter than that, one line names it and the rank still starting. The two
    launches run at the same time (their engine ranks only sleep)."""
    def two_ranks(out, *extra):
        e = dict(env(warm=True), GRPO_FAULT="slow_engine_start:1")
        args = [*TINY, f"--run.out_dir={out}", "--run.keep_last=0", "--run.steps=2",
                "--cluster.timeout_s=6", *extra]  # the engine: 9 s to start
        return subprocess.Popen(torchrun_cmd(2, args), cwd=ROOT, env=e, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    launches = [two_ranks(tmp_path / "a", "--rollout.start_timeout_s=120"),
                two_ranks(tmp_path / "b", "--rollout.start_timeout_s=3")]
    try:
        waits, p = (subprocess.CompletedProcess(q.args, 0, *q.communicate(timeout=240))
                    for q in launches)
    finally:
        for q in launches:
            if q.poll() is None:
                q.kill()
    waits.returncode, p.returncode = (q.returncode for q in launches)
    assert waits.returncode == 0, waits.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path / "a")] == [0, 1]
    assert p.returncode != 0
    line = _ours(p.stderr)[0]
    assert line.startswith("error: rank 0 (trainer) failed during start: waiting for every engine to "
                           "start: RuntimeError: start-up timed out: 1 of 2 ranks were ready within "
                           "rollout.start_timeout_s = 3 s; no rank died; rank 1 (generation) is "
                           "stuck in 'start: starting the hf engine'"), p.stderr[-3000:]
    assert "?" not in line


def _ours(stderr: str) -> list[str]:
    """The lines our ranks print (torchrun's own log lines and summary left out)."""
    return [ln for ln in stderr.splitlines() if ln.startswith(("error:", "config error:", "warning:"))]


def _exit_codes(stderr: str) -> list[int]:
    """Every rank's exit code, from torchrun's failure summary."""
    return sorted(int(c) for c in re.findall(r"exitcode\s+:\s*(-?\d+)", stderr))


@pytest.mark.slow
def test_bad_world_split_fails_before_any_group_work(tmp_path):
    """Printed once (not once per rank), exit code 2 on every rank."""
    p, dt = launch(tmp_path, None, "--cluster.gen_ranks=3", timeout=120)
    assert p.returncode != 0
    assert _ours(p.stderr) == ["config error: cluster.gen_ranks=3 leaves no trainer rank in a world of 3"]
    assert _exit_codes(p.stderr) == [2, 2, 2], p.stderr[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_unreachable_master_is_one_line_naming_address_port_and_timeout(tmp_path):
    """Launched without torchrun (env://, rank 1 of 2) while nothing listens at MASTER_PORT: the
    world's set-up fails within cluster.timeout_s with one line, exit 4 (it used to run outside
    the failure handling: a traceback, no error line)."""
    port = free_port()
    e = env()
    e.update(RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    p = train_py([*TINY, f"--run.out_dir={tmp_path}", "--cluster.timeout_s=3"], env=e, timeout=120)
    assert p.returncode == 4, p.stderr[-3000:]
    [line] = _ours(p.stderr)
    assert line.startswith(f"error: rank 1 could not set up the world (MASTER_ADDR=127.0.0.1, "
                           f"MASTER_PORT={port}, cluster.timeout_s = 3 s): DistNetworkError: "), line
    assert line.endswith("is rank 0's node up, and MASTER_PORT open to this one?")
    assert "Traceback" not in p.stderr and p.stderr.rstrip().splitlines()[-1] == line


@pytest.mark.slow
def test_second_job_on_the_run_folder_stops_naming_the_holder(tmp_path):
    """Another job holds the run folder (its lock, as rank 0 of a running job holds it): the
    second job stops with one line naming the folder and the holder, exit 2 on every rank, and
    writes nothing there."""
    lock = open(tmp_path / "run.lock", "a+")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    lock.write("node7 31337\n")
    lock.flush()
    p, _ = launch(tmp_path, None, "--run.steps=2", timeout=120)
    assert p.returncode != 0
    assert _ours(p.stderr) == [f"error: run folder {tmp_path} is in use by another job (host node7, "
                               "pid 31337); stop that job or pass another --run.out_dir"], p.stderr[-3000:]
    assert _exit_codes(p.stderr) == [2, 2, 2]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["run.lock"]
    lock.close()


@pytest.mark.slow
def test_own_error_in_a_world_of_one_prints_its_traceback_and_blames_no_one(tmp_path):
    e = env()
    e["GRPO_FAULT"] = "raise@1"   # this rank's own error, in the loop
    p = train_py([*TINY, f"--run.out_dir={tmp_path / 'run'}", "--run.steps=2"], env=e, timeout=120)
    assert p.returncode == 4, p.stderr[-3000:]
    assert "Traceback (most recent call last)" in p.stderr
    assert _ours(p.stderr) == ["error: rank 0 (trainer+generation) failed at step 1 (rollout): "
                               "ValueError: injected fault at step 1"]
    assert p.stderr.rstrip().splitlines()[-1] == _ours(p.stderr)[0]   # the culprit line is last
    # a model folder that cannot be read is bad input instead: one line, exit 2, no traceback
    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "config.json").write_text("{")
    p = train_py([*TINY, f"--model.path={bad}", f"--run.out_dir={tmp_path / 'run2'}"], timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1].startswith(
        f"config error: model.path={bad}: cannot read its config (")
    assert "stuck" not in p.stderr and "died" not in p.stderr


@pytest.mark.slow
def test_own_error_on_one_rank_blames_no_other_rank(tmp_path):
    p, _ = launch(tmp_path, "raise@1:1", "--run.steps=4")
    assert p.returncode != 0
    ours = _ours(p.stderr)
    assert ours[0] == ("error: rank 1 (trainer) failed at step 1 (rollout): ValueError: "
                       "injected fault at step 1"), ours
    assert "Traceback (most recent call last)" in p.stderr and "injected fault" in p.stderr
    assert all(re.fullmatch(r"error: rank [02] \((trainer|generation)\) (stopping|stopped by the launcher "
                            r"after): rank 1 \(trainer\) failed at step 1 .*\(ValueError\)", ln)
               for ln in ours[1:]), ours
    assert len(ours) == 3 and "stuck" not in p.stderr and "died" not in p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_user_stop_prints_one_line_per_rank_and_nothing_else(tmp_path, sig):
    """SIGTERM or Ctrl-C to torchrun (it forwards the signal to every rank): one line per rank
    naming the signal, step and phase; no "died", no "stuck", no KeyboardInterrupt traceback;
    every rank gone within seconds. Ctrl-C with the ranks train.py itself (torchrun signals
    each worker's process group), SIGTERM with warm ranks (tests/warm_rank.py forwards it).
    The Ctrl-C launch's console (what the imports print included, a step done) also shows the
    library warnings cut: no FSDP view-tensor warning (trainer.quiet_view_warning), no per-rank
    weight-loading bars, the rank plan once."""
    warm = sig == signal.SIGTERM
    e = env(warm)
    cmd = torchrun_cmd(3, [*TINY, f"--run.out_dir={tmp_path}", "--run.keep_last=0",
                           f"--cluster.timeout_s={TIMEOUT}", "--run.steps=500"], warm=warm)
    p = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    m = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (m.exists() and m.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.2)
    t0 = time.monotonic()
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    assert time.monotonic() - t0 < 15
    if not warm:
        both = out + err
        assert both.count("returned a view tensor") == 0, both[-3000:]
        assert "Loading weights" not in both
        assert both.count("== 3 rank(s) on cpu: ranks 0-1 trainer; rank 2 generation") == 1, both[-3000:]
    ours = _ours(err)
    name = signal.Signals(sig).name
    assert len(ours) == 3, err[-3000:]
    for ln in ours:
        assert re.fullmatch(rf"error: rank [012] \((trainer|generation)\) stopped by {name} at step "
                            r"\d+ \([^)]+\)", ln), ours
    assert sorted(int(ln.split()[2]) for ln in ours) == [0, 1, 2]
    for word in ("died", "stuck", "KeyboardInterrupt", "Connection closed"):
        assert word not in err, word


def _proc_has(pid: int, sig: int | None = None, lib: str | None = None) -> bool:
    """Whether process `pid` catches `sig` (/proc SigCgt), or has mapped a library named `lib`."""
    try:
        if sig is not None:
            cgt = next(ln for ln in open(f"/proc/{pid}/status") if ln.startswith("SigCgt:"))
            return bool(int(cgt.split()[1], 16) >> (sig - 1) & 1)
        return lib in open(f"/proc/{pid}/maps").read()
    except (OSError, StopIteration):
        return False


def test_ctrl_c_while_torch_imports_is_one_line_exit_130(tmp_path):
    """SIGINT in the first moments (`import torch` takes seconds): the one documented line and
    exit 130, not a KeyboardInterrupt traceback and exit -2. The signal is sent as soon as the
    process catches SIGTERM (train.py's first handler) or has begun loading libtorch."""
    p = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *TINY, f"--run.out_dir={tmp_path}"],
                         cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (_proc_has(p.pid, sig=signal.SIGTERM) or _proc_has(p.pid, lib="libtorch")):
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.001)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert (p.returncode, err) == (130, "error: rank 0 stopped by SIGINT during start-up\n")


def test_a_rank_without_a_phase_yet_is_shown_in_start_up_never_as_a_question_mark():
    """The diagnosis of a rank that has posted no phase (it is still importing, or its engine
    is starting before its first phase) says 'start-up'; it used to print '?'."""
    import torch.distributed as dist
    import failures
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        live = failures.Liveness(0, ["trainer", "generation"])   # rank 1 never arrives
        live.INTERVAL = 0.05
        d = live.diagnose()
        live.close()
    finally:
        dist.destroy_process_group()
    assert d.dead == [1] and "?" not in d.line
    assert d.line.endswith("last phases: 0:start-up | 1:start-up"), d.line


@rewards.register("_test_raises")
def _raises(response, sample):
    raise ValueError("boom")


@rewards.register("_test_slow")
def _slow(response, sample):
    time.sleep(2)
    return {"reward": 1.0}


@rewards.register("_test_no_reward_key")
def _bad_shape(response, sample):
    return {"score": 1.0}


def test_failing_reward_functions_score_zero_and_are_counted():
    fns = [{"name": "target_fraction", "weight": 1.0, "target": "a"},
           {"name": "_test_raises", "weight": 1.0}, {"name": "_test_slow", "weight": 1.0},
           {"name": "_test_no_reward_key", "weight": 1.0}]
    t0 = time.monotonic()
    out = rewards.score("aab", {"response_len": 3}, fns, timeout_s=0.2)
    assert time.monotonic() - t0 < 1.5
    assert out["errors"] == 3.0
    assert out["reward"] == pytest.approx(2 / 3)   # only the working function counts


def test_a_signal_after_a_death_is_the_launcher_not_a_cause():
    """torchrun stops the survivors of a dead rank with SIGTERM; a rank that sees both in its
    diagnosis names the death only (a user's stop is named when nobody died)."""
    import torch.distributed as dist
    import failures
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        live = failures.Liveness(0, ["trainer", "trainer", "generation"])
        live.INTERVAL = 0.05
        live.store.set(f"{live.ns}/signal/2", "SIGTERM")           # rank 2: the launcher's SIGTERM
        d = live.diagnose()                                         # rank 1: no heartbeat at all
        assert d.dead == [1] and d.line.startswith("rank 1 (trainer) died (no heartbeat); last"), d.line
        live.store.set(f"{live.ns}/signal/1", "SIGINT")             # now both got signals: a user
        d = live.diagnose()
        assert d.line.startswith("rank 1 (trainer) was stopped by SIGINT; rank 2 (generation) was "
                                 "stopped by SIGTERM"), d.line
        live.close()
    finally:
        dist.destroy_process_group()


class _Store:
    """The launcher's store as start_barrier sees it (add, counted per key)."""
    def __init__(self):
        self.n = {}

    def add(self, key, v):
        self.n[key] = self.n.get(key, 0) + v
        return self.n[key]


def test_start_barrier_is_a_count_in_the_store_with_its_own_deadline():
    """No collective (dist.barrier has no timeout argument in torch 2.10 / 2.11): every rank adds
    itself and waits, under rollout.start_timeout_s, for the world's count."""
    from types import SimpleNamespace
    live = SimpleNamespace(store=_Store(), ns="grpo/0", world=3)
    live.store.n["grpo/0/meet/start"] = 2  # two ranks are there already
    failures.start_barrier(live, 1.0, "rollout.start_timeout_s")  # the third arrives: passes
    late = SimpleNamespace(store=_Store(), ns="grpo/0", world=3)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=r"start-up timed out: 1 of 3 ranks were ready within "
                                           r"rollout.start_timeout_s = 0.3 s") as e:
        failures.start_barrier(late, 0.3, "rollout.start_timeout_s")
    assert 0.3 <= time.monotonic() - t < 2.0
    assert failures.is_communication_error(e.value)  # so the diagnosis names the late rank


ENGINE_DIES = r"""
import sys
print("(EngineCore pid=9) INFO 12-05 01:18:03 [core.py:99] ready", flush=True)
print("(Worker pid=7) WARNING 12-05 01:18:03 [x.py:1] ValueError: a warning it survived", flush=True)
print("(Worker pid=7) ERROR 12-05 01:18:04 [multiproc_executor.py:987] Traceback (most recent call last):", flush=True)
print("(Worker pid=7) ERROR 12-05 01:18:04 [multiproc_executor.py:987] RuntimeError: CPU Generator does not use offset", flush=True)
for i in range(100):
    print(f"(EngineCore pid=9) ERROR 12-05 01:18:04 [core.py:1197]   frame {i}", flush=True)
sys.stderr.write("Traceback (most recent call last):\n  File x\nvllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n")
sys.exit(1)
"""


def test_the_engines_own_error_goes_into_the_ranks_one_line(capfd):
    """The engine's processes (started inside EngineLog.attached) write their output through
    this rank, which passes it on and keeps the last lines: the engine's own error, ~100 lines
    above (vLLM's EngineDeadError and survived warnings skipped), is named in the line of the
    watch that sees the process die."""
    import multiprocessing

    import children
    log = failures.EngineLog()
    with log.attached():
        p = subprocess.Popen([sys.executable, "-c", ENGINE_DIES])
        kid = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0.3,),
                                                          name="EngineCore_DP0")
        kid.start()
    p.wait(timeout=30)
    got = []
    children.Watch([kid], "the vLLM engine's", got.append, interval=0.05).thread.join(timeout=10)
    assert got == [f"the vLLM engine's process EngineCore_DP0 (pid {kid.pid}) died (exit code 0); "
                   "the engine's own error: RuntimeError: CPU Generator does not use offset"]
    out, err = capfd.readouterr()
    assert "frame 99" in out and "EngineDeadError" in err   # passed on, to the same streams
    failures.EngineLog.current = None
    assert failures.engine_error() is None
