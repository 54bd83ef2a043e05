"""A process of a tests' torchrun launch forked from the warm server (tests/warm.py): a worker
(`train.py ARGS`) or, with `-m torch.distributed.run`, torchrun's agent itself.

tests/util.torchrun_cmd starts `warm_rank.py -m torch.distributed.run ... warm_rank.py ARGS`:
the agent is the real torchrun (its rendezvous, its worker processes, their sessions, its
signal handling and exit code), only forked instead of importing torch afresh (~1.3 s of CPU a
launch), and each worker it starts is this script again, a rank forked as `train.py ARGS`.
This process hands its argv, environment (RANK, WORLD_SIZE, MASTER_ADDR, TORCHELASTIC_*, ...),
working folder and stdin / stdout / stderr to the server, which forks the process in a session
of its own; every signal this process gets is forwarded: to a rank's session, as torchrun
signals its worker's own; to the agent alone, as a signal to torchrun reaches only it (its
workers have sessions of their own). This process then ends as the forked one did: its exit
code, or killed by the same signal. If this process is killed (SIGKILL), the server kills the
forked one's session. Without the server (no GRPO_TEST_WARM_SOCKET), it runs train.py (or
`python -m MODULE`) itself. Only the standard library: it starts in milliseconds.
"""
import json
import os
import signal
import socket
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    path = os.environ.get("GRPO_TEST_WARM_SOCKET")
    args, module = sys.argv[1:], None
    if args[:1] == ["-m"]:
        module, args = args[1], args[2:]
    if not path:
        first = ["-m", module] if module else [os.path.join(ROOT, "train.py")]
        os.execv(sys.executable, [sys.executable, *first, *args])
    pid, pending = None, []
    # a rank's whole session (torchrun signals its worker's); the agent alone
    send = os.kill if module else os.killpg

    def forward(signum, _frame):
        if pid is None:  # before the fork's pid came back: sent as soon as it does
            pending.append(signum)
            return
        try:
            send(pid, signum)
        except ProcessLookupError:
            pass
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
              signal.SIGUSR2):
        signal.signal(s, forward)
    # the agent's workers (this script again) need the server too; a rank sees what it would
    env = {k: v for k, v in os.environ.items() if module or k != "GRPO_TEST_WARM_SOCKET"}
    req = {"argv": args, "env": env, "cwd": os.getcwd(), **({"module": module} if module else {})}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(path)
    socket.send_fds(conn, [json.dumps(req).encode()], [0, 1, 2])
    pid = json.loads(conn.recv(1 << 16))["pid"]
    for signum in pending:
        forward(signum, None)
    msg = conn.recv(1 << 16)
    if not msg:
        sys.stderr.write("warm_rank: the warm server went away\n")
        os._exit(70)
    rc = json.loads(msg)["rc"]
    if rc < 0:  # killed by a signal: so is this process
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    os._exit(rc & 0xFF)


if __name__ == "__main__":
    main()
