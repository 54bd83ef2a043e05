"""AReaL's Geometry3K reward, as its VLM example computes it: ``areal_geometry3k``.

The rule is ``geometry3k_reward_fn`` of ``examples/vlm_npu/geometry3k_grpo.py`` (and
``examples/vlm/``) at inclusionAI/AReaL 524d1d90f (PR #746, the seed's run)::

    reward   = 0.9 * accuracy + 0.1 * format
    accuracy = mathruler.grader.grade_answer(mathruler.grader.extract_boxed_content(completion), answer)
    format   = re.fullmatch(r"<think>.*</think>.*\\\\boxed\\{.*\\}.*", completion, re.DOTALL)

so the answer is the LAST ``\\boxed{`` anywhere in the response (inside ``<think>`` too), read to
its matching brace (an unclosed last box reads as the string "None"), and graded by mathruler's
normalisation plus sympy. It is not the project's ``geometry`` verifier: on that verifier's own
cases the two accuracy rules disagree on about a tenth (issue 47). AReaL scores the completion
decoded with its special tokens; here the decoded text has none, which neither rule can tell
apart (the format pattern ends in ``.*``).

Never hangs: mathruler's ``extract_boxed_content`` is one linear scan and the format test is
the regex's linear equivalent (``_format_ok``; a test holds it equal to ``re.fullmatch``, which
can backtrack cubically on adversarial text), both in the calling thread. ``grade_answer`` can run sympy for as long as it likes
(``sympy.simplify``, ``9**9**9``), so it runs in a child process of its own per worker thread,
killed and replaced when one grading runs past ``grade_timeout_s``: that call then raises, so it
scores 0 (as AReaL's reward timeout does) and counts in ``reward/errors``, and the thread is free.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading

from rewards import register

# mathruler 0.1.0's grader in a loop: one JSON [given, gold] per line in, "1"/"0" (or "E <why>")
# per line out. Started with -c, not multiprocessing: a spawned child would re-import the
# trainer's __main__ (torch and all) before it could grade anything.
_WORKER = """\
import json, sys
from mathruler.grader import grade_answer
sys.stdout.write("ready\\n"); sys.stdout.flush()
for line in sys.stdin:
    given, gold = json.loads(line)
    try:
        out = "1" if grade_answer(given, gold) else "0"
    except Exception as e:
        out = "E " + " ".join(f"{type(e).__name__}: {e}".split())[:200]
    sys.stdout.write(out + "\\n"); sys.stdout.flush()
"""
START_TIMEOUT_S = 30.0   # the child's start (python + sympy + pylatexenc imports: ~0.5 s idle)


class _Grader:
    """One child process running mathruler's ``grade_answer``; owned by one thread."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.buf = b""

    def _start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.buf = b""
        if self._line(START_TIMEOUT_S) != "ready":
            self.close()
            raise RuntimeError("areal_geometry3k: the mathruler grader did not start (is "
                               "mathruler==0.1.0 installed? requirements.txt)")

    def _line(self, timeout_s: float) -> str | None:
        """The child's next line, or None when none comes within timeout_s or it died."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            ready, _, _ = select.select([fd], [], [], timeout_s)
            chunk = os.read(fd, 65536) if ready else b""
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode("utf-8", "replace")

    def grade(self, given: str, gold: str, timeout_s: float) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps([given, gold]) + "\n").encode())
        self.proc.stdin.flush()
        out = self._line(timeout_s)
        if out is None:
            died = self.proc.poll() is not None
            self.close()  # a hung (or dead) grader: the next call starts a fresh child
            if died:
                raise RuntimeError(f"mathruler's grader process died grading {given[:60]!r}")
            raise TimeoutError(f"mathruler's grade_answer ran past grade_timeout_s={timeout_s:g} "
                               f"(answer {given[:60]!r})")
        if out.startswith("E "):
            raise RuntimeError(f"mathruler's grade_answer raised {out[2:]}")
        return out == "1"

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


_local = threading.local()


def _grader() -> _Grader:
    g = getattr(_local, "grader", None)
    if g is None:
        g = _local.grader = _Grader()
    return g


def _format_ok(text: str) -> bool:
    """``re.fullmatch(r"<think>.*</think>.*\\\\boxed\\{.*\\}.*", text, re.DOTALL)`` in linear
    time: the text starts with ``<think>``, and after it come a ``</think>``, then a ``\\boxed{``,
    then a ``}``, each after the end of the one before (taking the earliest of each is never
    worse, so ``find`` decides it)."""
    if not text.startswith("<think>"):
        return False
    close = text.find("</think>", len("<think>"))
    box = -1 if close < 0 else text.find("\\boxed{", close + len("</think>"))
    return box >= 0 and text.find("}", box + len("\\boxed{")) >= 0


@register("areal_geometry3k", requires=("mathruler", "pylatexenc"))
def areal_geometry3k(response: str, sample: dict, grade_timeout_s: float = 3.0) -> dict[str, float]:
    """``{"reward": 0.9 * accuracy + 0.1 * format, "accuracy": 0/1, "format": 0/1}`` as AReaL's
    example (module docstring). ``grade_timeout_s``: the longest one mathruler grading may run
    (keep it under reward.timeout_s, so a slow sympy costs this call, not the runner's count of
    timeouts)."""
    from mathruler.grader import extract_boxed_content  # sympy and pylatexenc: loaded on first use
    acc = 1.0 if _grader().grade(extract_boxed_content(response), sample["answer"],
                                 grade_timeout_s) else 0.0
    fmt = 1.0 if _format_ok(response) else 0.0
    return {"reward": 0.9 * acc + 0.1 * fmt, "accuracy": acc, "format": fmt}
