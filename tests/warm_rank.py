"""A torchrun worker that is `train.py ARGS` forked from the tests' warm server (tests/warm.py).

torchrun starts this instead of train.py (tests/util.torchrun). It hands its argv, environment
(RANK, WORLD_SIZE, MASTER_ADDR, TORCHELASTIC_*, ...), working folder and stdin / stdout /
stderr to the server, which forks the rank in a session of its own; every signal torchrun sends
is forwarded to that session, as torchrun signals its worker's own; this process then ends as the
rank did: its exit code, or killed by the same signal. If this process is killed (SIGKILL), the
server kills the rank. Without the server (no GRPO_TEST_WARM_SOCKET), it runs train.py itself.
Only the standard library: it starts in milliseconds.
"""
import json
import os
import signal
import socket
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    path = os.environ.get("GRPO_TEST_WARM_SOCKET")
    if not path:
        train = os.path.join(ROOT, "train.py")
        os.execv(sys.executable, [sys.executable, train, *sys.argv[1:]])
    pid, pending = None, []

    def forward(signum, _frame):
        if pid is None:  # before the fork's pid came back: sent as soon as it does
            pending.append(signum)
            return
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
              signal.SIGUSR2):
        signal.signal(s, forward)
    env = {k: v for k, v in os.environ.items() if k != "GRPO_TEST_WARM_SOCKET"}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(path)
    socket.send_fds(conn, [json.dumps({"argv": sys.argv[1:], "env": env,
                                       "cwd": os.getcwd()}).encode()], [0, 1, 2])
    pid = json.loads(conn.recv(1 << 16))["pid"]
    for signum in pending:
        forward(signum, None)
    msg = conn.recv(1 << 16)
    if not msg:
        sys.stderr.write("warm_rank: the warm train.py server went away\n")
        os._exit(70)
    rc = json.loads(msg)["rc"]
    if rc < 0:  # killed by a signal: so is this process
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    os._exit(rc & 0xFF)


if __name__ == "__main__":
    main()
