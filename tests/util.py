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
TINY_TEXT = ["--config", str(ROOT / "configs" / "tiny_text.toml")]

# Several `python train.py ARGS` runs in a world of one, one after another in ONE interpreter: the
# imports (torch, transformers; several seconds) are paid once. Each run gets its own store port;
# a failing run exits the interpreter with its code (train.main's or the failure guard's).
_INLINE = """
import json, os, socket, sys
sys.path.insert(0, sys.argv[1])
import train
for argv in json.loads(sys.argv[2]):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    print("== run:", " ".join(argv), flush=True)
    code = train.main(argv)
    if code:
        sys.exit(code)
"""


def run_inline(runs: list[list[str]], timeout: float = 900) -> subprocess.CompletedProcess:
    """Each of `runs` (train.py arguments) as a world of one, in order, in one process."""
    p = subprocess.run([sys.executable, "-c", _INLINE, str(ROOT), json.dumps(runs)], cwd=ROOT,
                       env=env(), capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"exited {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}")
    return p


# ----------------------------------------------------------------------------- warm `python train.py`
# A world-of-one `python train.py ARGS` costs ~5 s here, ~4 of them imports (torch, transformers,
# the project). The warm server pays them once per pytest session; each run is then a fork of
# it that behaves as a fresh `python train.py ARGS` would from its first line after the imports:
# its own session (process group), working folder, environment (exactly the one given),
# sys.argv, stdin from /dev/null, stdout and stderr to files, `sys.exit(train.main())` and the
# interpreter's exit (non-daemon threads joined, atexit handlers, the exit code of an uncaught
# exception or SystemExit; the modules' teardown is skipped). Exit codes are the
# process's own: os._exit(n) in a failure path, 1 for an uncaught exception, -9 for a
# SIGKILL-ed run. What it cannot show: output printed while the modules import (it goes to the
# server) and the start-up signal handlers of train.py's `__main__` block
# (tests/test_failures.py::test_ctrl_c_while_torch_imports_is_one_line_exit_130 and the
# torchrun launches start train.py itself; bench/device_check.sh runs `python train.py`).
_WARM = r"""
import json, os, sys, threading
sys.path.insert(0, sys.argv[1])
import train  # noqa: E402  torch, torch.distributed, the project's modules
# what a tiny run imports lazily (the model class, its processor): most of the rest of the cost
import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl  # noqa: E402,F401
import transformers.models.qwen2_5_vl.processing_qwen2_5_vl  # noqa: E402,F401
import transformers.models.qwen2_vl.image_processing_qwen2_vl  # noqa: E402,F401
import transformers.models.qwen3.modeling_qwen3  # noqa: E402,F401
from transformers import AutoConfig, AutoModel, AutoProcessor, AutoTokenizer  # noqa: E402,F401
assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1, \
    "the warm server must stay single-threaded: it forks"


def serve():
    # one request a line; replies {"pid": ...} at the fork and {"rc": ...} at the run's end
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return req
        os.write(1, (json.dumps({"pid": pid}) + "\n").encode())
        _, status = os.waitpid(pid, 0)
        os.write(1, (json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n").encode())
    os._exit(0)


req = serve()  # from here on: the forked run
os.setsid()
os.chdir(req["cwd"])
os.environ.clear()
os.environ.update(req["env"])
for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["out"], os.O_WRONLY | os.O_CREAT),
                        (2, req["err"], os.O_WRONLY | os.O_CREAT)):
    os.dup2(os.open(path, flags), fd)
sys.stdin = open(0, closefd=False)
sys.argv = [train.__file__, *req["argv"]]
try:
    code = train.main()
except SystemExit as e:
    code = e.code
except KeyboardInterrupt:  # as the interpreter does: ends by SIGINT itself
    import signal, traceback
    traceback.print_exc()
    code = "SIGINT"
except BaseException:
    sys.excepthook(*sys.exc_info())
    code = 1
# the interpreter's exit up to the modules' teardown (which only frees memory, ~1 s here):
# wait for non-daemon threads, run the atexit handlers, flush
threading._shutdown()
import atexit
atexit._run_exitfuncs()
if code == "SIGINT":
    import signal
    sys.stdout.flush(); sys.stderr.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
if code is not None and not isinstance(code, int):
    print(code, file=sys.stderr)
    code = 1
sys.stdout.flush()
sys.stderr.flush()
os._exit((code or 0) & 0xFF)
"""
_server: subprocess.Popen | None = None


def _warm_server() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        import atexit
        log = open(os.path.join(_tmpdir(), "warm-server.log"), "w")
        _server = subprocess.Popen([sys.executable, "-c", _WARM, str(ROOT)], cwd=ROOT, env=env(),
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        atexit.register(_server.stdin.close)  # the server ends at EOF
    return _server


def _tmpdir() -> str:
    import tempfile
    global _TMP
    try:
        return _TMP
    except NameError:
        _TMP = tempfile.mkdtemp(prefix="warm-train-")
        return _TMP


def _reply(srv: subprocess.Popen, timeout: float) -> dict | None:
    """The server's next reply line, or None if none came within `timeout` seconds."""
    import select
    if not select.select([srv.stdout], [], [], timeout)[0]:
        return None
    line = srv.stdout.readline()
    if not line:
        log = open(os.path.join(_tmpdir(), "warm-server.log")).read()
        raise AssertionError(f"the warm train.py server ended\n{log[-4000:]}")
    return json.loads(line)


def train_py(args: list[str], env: dict | None = None, timeout: float = 300,
             cwd: Path | str = ROOT) -> subprocess.CompletedProcess:
    """`python train.py ARGS` (a world of one, unless `env` says otherwise) as a fork of the warm
    server: the same finished process as subprocess.run(..., capture_output=True, text=True)
    returns, and subprocess.TimeoutExpired past `timeout` (the run's process group killed)."""
    import signal
    global _RUNS
    _RUNS = globals().get("_RUNS", 0) + 1
    srv = _warm_server()
    out, err = (os.path.join(_tmpdir(), f"run{_RUNS}.{s}") for s in ("out", "err"))
    e = env if env is not None else globals()["env"]()
    srv.stdin.write((json.dumps({"argv": [str(a) for a in args], "env": e, "cwd": str(cwd),
                                 "out": out, "err": err}) + "\n").encode())
    srv.stdin.flush()
    started = _reply(srv, 120)
    assert started is not None, "the warm train.py server did not fork within 120 s"
    done = _reply(srv, timeout)
    cmd = [sys.executable, str(ROOT / "train.py"), *map(str, args)]

    def text(path):
        with open(path, errors="replace") as f:
            return f.read()
    if done is None:
        try:
            os.killpg(started["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
        _reply(srv, 60)
        raise subprocess.TimeoutExpired(cmd, timeout, output=text(out), stderr=text(err))
    p = subprocess.CompletedProcess(cmd, done["rc"], text(out), text(err))
    for path in (out, err):
        os.unlink(path)
    return p
