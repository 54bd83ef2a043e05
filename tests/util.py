"""Helpers for tests that launch the trainer for real (torchrun, gloo, CPU)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def env() -> dict:
    e = dict(os.environ)
    # PYTHONFAULTHANDLER: a native crash (seen twice, rarely, on a non-root trainer rank inside
    # gloo) prints every thread's Python stack instead of dying silently
    e.update(OMP_NUM_THREADS="1", GRPO_DEVICE="cpu", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
             TOKENIZERS_PARALLELISM="false")
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, args: list[str], timeout: float = 300, nnodes: int = 1,
             check: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --standalone` on this machine; returns the finished process."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(ROOT / "train.py"), *args]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"torchrun exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return p


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


TINY = ["--config", str(ROOT / "configs" / "tiny.toml")]
