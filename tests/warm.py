"""A warm interpreter for the tests' `train.py` processes: the imports are paid once a session.

A `python train.py` process spends ~4 s of CPU here importing torch, transformers and the
project before its first line of work, and a 3-rank torchrun launch pays that three times over
on 2 cores. The warm server (one per pytest session) imports them once; each process the tests
start is then a fork of it that behaves as a fresh `python train.py ARGS` would from its first
line after the imports:

- its own session (process group), working folder, environment (exactly the one given),
  sys.argv, and stdin / stdout / stderr (the caller's own file descriptors, passed over a Unix
  socket: its output goes where the real process's would, a torchrun pipe included);
- `sys.exit(train.main())` and the interpreter's exit up to the modules' teardown: non-daemon
  threads joined, atexit handlers run, stdio flushed, the exit code of an uncaught exception or
  of SystemExit; os._exit(n) in a failure path and death by a signal are the process's own.

`train_py(args)` is `subprocess.run([python, "train.py", *args], capture_output=True)` for a
world of one. A torchrun launch (tests/util.torchrun) is `tests/warm_rank.py -m
torch.distributed.run ...`: torchrun's agent, the real one, forked as `python -m
torch.distributed.run` (its imports are ~1.3 s of CPU a launch), whose workers are
`tests/warm_rank.py` again: each hands its argv, environment and file descriptors to the server,
forwards every signal it gets (to the forked rank's process group; to the agent alone), and
ends as the forked process ended (its exit code, or killed by the same signal); if the client
is killed itself, the server kills what it forked.

What a fork cannot show: output printed while the modules import (it goes to the server's log),
the start-up signal handlers of train.py's `__main__` block, and a spawned child's re-import of
the main script (multiprocessing's spawn runs it as `__mp_main__`; vLLM's engine core does:
tests/test_vllm_pure.py::test_train_py_as_a_spawned_childs_main_only_imports). Launches that
check the first two start train.py itself: tests/util.torchrun(..., warm=False);
bench/device_check.sh and tests/test_failures.py::test_ctrl_c_while_torch_imports_is_one_line_exit_130
run it too.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOCKET_ENV = "GRPO_TEST_WARM_SOCKET"  # the server's socket, for tests/warm_rank.py
SWITCH_ENV = "GRPO_TEST_WARM"          # "0": no server; every launch is a real train.py


def enabled() -> bool:
    """Whether the tests fork their train.py processes from the warm server (GRPO_TEST_WARM=0
    turns it off: each launch then starts train.py and torchrun themselves, imports and all)."""
    return os.environ.get(SWITCH_ENV, "1") != "0"


# ----------------------------------------------------------------------------- the server
def serve(sock_path: str) -> None:
    """Import, then fork one process per request until stdin closes (the pytest session ends).
    Requests: one SOCK_SEQPACKET message `{"argv", "env", "cwd"}` with 3 file descriptors (the
    new process's stdin, stdout, stderr); replies `{"pid"}` at the fork and `{"rc"}` at the end.
    A client that goes away before its process ends gets that process group killed."""
    import selectors
    import signal
    import threading

    import train  # noqa: F401  torch, torch.distributed, the project's modules
    # what a tiny run imports lazily (the model classes, the processor): most of the rest
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl  # noqa: F401
    import transformers.models.qwen2_5_vl.processing_qwen2_5_vl  # noqa: F401
    import transformers.models.qwen2_vl.image_processing_pil_qwen2_vl  # noqa: F401
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401
    from transformers import AutoConfig, AutoModel, AutoProcessor, AutoTokenizer  # noqa: F401
    assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1, \
        "the warm server must stay single-threaded: it forks"

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(sock_path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    print("ready", flush=True)
    pid_of: dict[socket.socket, int] = {}          # connection -> its process
    conn_of: dict[int, socket.socket | None] = {}  # process -> its connection

    def close(conn):
        sel.unregister(conn)
        conn.close()

    while True:
        for key, _ in sel.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                sel.register(conn, selectors.EVENT_READ, "conn")
            elif key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 1 << 16):  # the session ended
                    for pid in conn_of:
                        _kill(pid)
                    os._exit(0)
            elif key.data == "child":
                os.read(wake_r, 1 << 16)
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn = conn_of.pop(pid, None)
                    if conn is not None:  # None: its client went away
                        pid_of.pop(conn, None)
                        rc = os.waitstatus_to_exitcode(status)
                        try:
                            conn.send(json.dumps({"rc": rc}).encode())
                        except OSError:
                            pass
                        close(conn)
            else:
                conn = key.fileobj
                if conn in pid_of:  # a client never sends twice: data or EOF means it is gone
                    pid = pid_of.pop(conn)
                    _kill(pid)                # reaped as it dies; its rc goes to nobody
                    conn_of[pid] = None
                    close(conn)
                    continue
                try:
                    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                except OSError:
                    msg, fds = b"", []
                if not msg or len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
                    close(conn)
                    continue
                pid = os.fork()
                if pid == 0:
                    try:
                        signal.set_wakeup_fd(-1)
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        for k in list(sel.get_map().values()):  # the server's sockets
                            if isinstance(k.fileobj, socket.socket):
                                k.fileobj.close()
                        sel.close()
                        os.close(wake_r)
                        os.close(wake_w)
                        _become(json.loads(msg), fds)  # never returns
                    finally:
                        os._exit(70)  # never serve in a forked process
                for fd in fds:
                    os.close(fd)
                pid_of[conn], conn_of[pid] = pid, conn
                conn.send(json.dumps({"pid": pid}).encode())


def _kill(pid: int) -> None:
    import signal
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _become(req: dict, fds: list[int]) -> None:
    """In the forked process: become `python train.py ARGV` (or `python -m MODULE ARGV` where
    the request names a module: torchrun) and exit as it would."""
    import atexit
    import runpy
    import signal
    import threading
    import traceback

    import train
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    module = req.get("module")
    sys.argv = [module or train.__file__, *req["argv"]]  # run_module puts the module's file first
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        else:
            code = train.main()
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:  # as the interpreter does: it ends by SIGINT itself
        traceback.print_exc()
        code = "SIGINT"
    except BaseException:  # noqa: BLE001 - what the interpreter prints, exit code 1
        sys.excepthook(*sys.exc_info())
        code = 1
    # the interpreter's exit up to the modules' teardown (which only frees memory, ~1 s here)
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if code == "SIGINT":
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr, flush=True)
        code = 1
    os._exit((code or 0) & 0xFF)


# ----------------------------------------------------------------------------- the client side
_server: subprocess.Popen | None = None
_ready = False
_dir: str | None = None


SHARED_ENV = "GRPO_TEST_WARM_SHARED"  # the folder of a server another process started


def start_server(share: bool = False) -> None:
    """Start the server if it is not running, without waiting for its imports (conftest.py
    starts it as the session starts: it imports on the other core meanwhile). `share`: the
    processes this one starts afterwards (pytest-xdist's workers) use it too (SHARED_ENV)."""
    global _server, _dir, _ready
    if not enabled() or (_server is not None and _server.poll() is None):
        return
    import atexit
    _dir, _ready = tempfile.mkdtemp(prefix="warm-train-"), False
    log = open(os.path.join(_dir, "server.log"), "w")
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tests import warm; "
            f"warm.serve({os.path.join(_dir, 'sock')!r})")
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", GRPO_DEVICE="cpu", PYTHONUNBUFFERED="1",
             PYTHONFAULTHANDLER="1", TOKENIZERS_PARALLELISM="false")
    _server = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=e,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
    atexit.register(_server.stdin.close)  # the server ends at EOF
    if share:
        os.environ[SHARED_ENV] = _dir


_lock = threading.Lock()  # tests start processes from several threads (tests/test_family_runs.py)


def socket_path() -> str:
    """The running server's socket (started on first use, waited for until it is ready)."""
    global _ready
    shared = os.environ.get(SHARED_ENV)
    if shared and _server is None:  # a server of the pytest-xdist controller's
        return _shared_socket(shared)
    with _lock:  # one thread reads the server's "ready" line; the others wait for it
        if _server is None or _server.poll() is not None:
            start_server()
        if not _ready:
            if _server.stdout.readline().strip() != b"ready":
                _server.wait(30)
                raise AssertionError("the warm train.py server did not start:\n"
                                     + open(os.path.join(_dir, "server.log")).read()[-4000:])
            _ready = True
        return os.path.join(_dir, "sock")


def _shared_socket(folder: str, timeout: float = 300) -> str:
    """The socket of the server in `folder`, once it accepts connections (it listens once its
    imports are done); an error with its log if it is gone or not ready within `timeout`."""
    import time
    path, deadline = os.path.join(folder, "sock"), time.monotonic() + timeout
    while True:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
            try:
                probe.connect(path)  # the server sees a connection closed at once: ignored
                return path
            except (FileNotFoundError, ConnectionRefusedError):
                pass
        log = open(os.path.join(folder, "server.log")).read()
        if "Traceback" in log or time.monotonic() > deadline:
            raise AssertionError(f"the shared warm train.py server did not start:\n{log[-4000:]}")
        time.sleep(0.05)


def _recv(conn: socket.socket, timeout: float | None) -> dict | None:
    conn.settimeout(timeout)
    try:
        msg = conn.recv(1 << 16)
    except TimeoutError:
        return None
    if not msg:
        raise AssertionError("the warm train.py server closed the connection")
    return json.loads(msg)


def start(argv: list[str], env: dict, cwd: str, fds: list[int]) -> tuple[socket.socket, int]:
    """Fork `python train.py ARGV` with these stdin/stdout/stderr; its connection and pid."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(socket_path())
    socket.send_fds(conn, [json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()], fds)
    started = _recv(conn, 120)
    assert started is not None, "the warm train.py server did not fork within 120 s"
    return conn, started["pid"]


def train_py(args: list[str], env: dict, timeout: float, cwd: Path | str = ROOT
             ) -> subprocess.CompletedProcess:
    """`python train.py ARGS` as a fork of the warm server; the same finished process as
    subprocess.run(..., capture_output=True, text=True) returns, and subprocess.TimeoutExpired
    past `timeout` (the run's process group killed)."""
    cmd = [sys.executable, str(ROOT / "train.py"), *map(str, args)]
    if not enabled():
        return _cold_train_py(cmd, env, timeout, cwd)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            open(os.devnull, "rb") as null:
        conn, pid = start([str(a) for a in args], env, str(cwd),
                          [null.fileno(), out.fileno(), err.fileno()])

        def text(f):
            f.seek(0)
            return f.read().decode(errors="replace")
        with conn:
            done = _recv(conn, timeout)
            if done is None:
                _kill(pid)
                _recv(conn, 60)
                raise subprocess.TimeoutExpired(cmd, timeout, output=text(out), stderr=text(err))
        return subprocess.CompletedProcess(cmd, done["rc"], text(out), text(err))


def _cold_train_py(cmd: list[str], env: dict, timeout: float, cwd: Path | str
                   ) -> subprocess.CompletedProcess:
    """What train_py does with the server switched off: the real process, in a session of its
    own as a fork would be (its process group killed past `timeout`)."""
    p = subprocess.Popen(cmd, cwd=str(cwd), env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(p.pid)
        out, err = p.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)
