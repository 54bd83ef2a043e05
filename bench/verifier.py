"""Score answer verifiers on the Geometry3K case set: this project's, mathruler's, math-verify's.

    OMP_NUM_THREADS=1 python bench/verifier.py [--cases tests/data/verifier_cases.jsonl]
        [--only project,mathruler,math_verify,mathruler_boxed_only] [--guard-s 2] [--by-rule]

Prints one JSON object per verifier: ``accuracy``, ``false_positives`` (judged correct, is
wrong), ``false_negatives``, ``over_50ms`` (cases that took longer than the bound, counted as
wrong too), ``cases_per_s`` (cases over the summed per-case time, one core) and ``killed`` (cases
still running after ``--guard-s``; the worker is killed and restarted, so the bench never hangs).

Each verifier runs in its own worker process, one case at a time, timed inside the worker:
- project: ``rewards.geometry.is_correct(response, gold)``;
- mathruler (verl / AReaL / EasyR1): ``grade_answer(pred, gold)`` where pred is the first
  ``<answer>...</answer>`` (EasyR1's r1v reward, ``re.search``; its ``\\boxed{}`` if it holds one),
  else ``extract_boxed_content(response)`` (verl / AReaL geo3k). Reading the tag is what the
  prompt asks for and what the issue saw ("takes an <answer> written inside <think>");
  ``--only mathruler_boxed_only`` scores the bare last-``\\boxed{}`` pipeline;
- math_verify (TRL): ``verify(parse(gold), parse(response))``.
The baselines need ``pip install -r requirements-bench.txt``.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CASES = ROOT / "tests/data/verifier_cases.jsonl"
BOUND_S = 0.05
VERIFIERS = ("project", "mathruler", "math_verify")  # and "mathruler_boxed_only" on request


def load_cases(path: Path) -> list[dict]:
    cases = []
    for line in path.read_text().splitlines():
        c = json.loads(line)
        if "response_parts" in c:
            c["response"] = "".join(text * n for text, n in c.pop("response_parts"))
        cases.append(c)
    return cases


def make_judge(name: str):
    if name == "project":
        sys.path.insert(0, str(ROOT))
        from rewards.geometry import is_correct
        return is_correct
    if name in ("mathruler", "mathruler_boxed_only"):
        import re

        from mathruler.grader import extract_boxed_content, grade_answer

        def pred(response: str) -> str:
            m = None if name.endswith("only") else re.search(r"<answer>(.*?)</answer>",
                                                             response, re.DOTALL)
            if m is None:
                return extract_boxed_content(response)
            inner = m.group(1).strip()
            return extract_boxed_content(inner) if "\\boxed{" in inner else inner
        return lambda response, gold: grade_answer(pred(response), gold)
    if name == "math_verify":
        import logging

        from math_verify import parse, verify
        logging.disable(logging.WARNING)  # it logs every parse failure
        return lambda response, gold: verify(parse(gold), parse(response))
    raise ValueError(f"unknown verifier {name!r}")


def worker(name: str, path: str, conn) -> None:
    cases = load_cases(Path(path))
    judge = make_judge(name)
    conn.send("ready")
    while True:
        i = conn.recv()
        if i is None:
            return
        c = cases[i]
        t = time.perf_counter()
        try:
            verdict = bool(judge(c["response"], c["gold"]))
        except Exception:  # noqa: BLE001 - a baseline that raises has judged the case wrong
            verdict = None
        conn.send((i, verdict, time.perf_counter() - t))


class Runner:
    """A worker process for one verifier, restarted after a case that runs past the guard."""

    def __init__(self, name: str, path: Path, guard_s: float):
        self.name, self.path, self.guard_s = name, path, guard_s
        self.ctx = mp.get_context("spawn")
        self.proc = None
        self.start()

    def start(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=worker, args=(self.name, str(self.path), child),
                                     daemon=True)
        self.proc.start()
        if not self.conn.poll(300) or self.conn.recv() != "ready":
            raise RuntimeError(f"{self.name} worker did not start")

    def judge(self, i: int) -> tuple[bool | None, float, bool]:
        """(verdict, seconds, killed)."""
        self.conn.send(i)
        if self.conn.poll(self.guard_s):
            _, verdict, dt = self.conn.recv()
            return verdict, dt, False
        self.proc.kill()
        self.proc.join()
        self.start()
        return None, self.guard_s, True

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(5)


def score(name: str, cases: list[dict], path: Path, guard_s: float, by_rule: bool) -> dict:
    runner = Runner(name, path, guard_s)
    fp = fn = over = killed = right = 0
    total_s = 0.0
    rules: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for i, c in enumerate(cases):
        verdict, dt, was_killed = runner.judge(i)
        total_s += dt
        killed += was_killed
        slow = dt > BOUND_S
        over += slow
        ok = verdict is not None and verdict == c["expected"] and not slow
        right += ok
        fp += verdict is True and not c["expected"]
        fn += c["expected"] and verdict is not True
        rules[c["rule"]][0] += ok
        rules[c["rule"]][1] += 1
    runner.close()
    out = {"verifier": name, "cases": len(cases), "accuracy": round(right / len(cases), 4),
           "false_positives": fp, "false_negatives": fn, "over_50ms": over, "killed": killed,
           "cases_per_s": round(len(cases) / total_s, 1)}
    if by_rule:
        out["by_rule"] = {k: f"{a}/{n}" for k, (a, n) in sorted(rules.items())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=Path, default=DEFAULT_CASES)
    ap.add_argument("--only", default=",".join(VERIFIERS),
                    help="comma-separated subset of " + ", ".join(VERIFIERS)
                    + ", mathruler_boxed_only")
    ap.add_argument("--guard-s", type=float, default=2.0,
                    help="kill a case after this many seconds (it counts as over and wrong)")
    ap.add_argument("--by-rule", action="store_true", help="add per-rule right/total counts")
    args = ap.parse_args()
    cases = load_cases(args.cases)
    for name in args.only.split(","):
        print(json.dumps(score(name, cases, args.cases, args.guard_s, args.by_rule)), flush=True)


if __name__ == "__main__":
    main()
