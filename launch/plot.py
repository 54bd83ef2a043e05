"""Draw a run's curves (or several runs overlaid) from metrics.jsonl and eval.jsonl into a PNG.

    python launch/plot.py runs/tiny                      # writes runs/tiny/curves.png
    python launch/plot.py runs/a runs/b -o ab.png        # two runs overlaid, one colour each
    python launch/plot.py runs/tiny --smooth 0.8         # EMA smoothing (raw curve kept faint)

Panels (each drawn when its keys are present): every reward part the run logged (`reward/*`);
evaluation (every `eval/*` part, including the evaluation before the first step, from
eval.jsonl); response length and the truncated share; entropy; KL to the reference and the
approximate KL between updates; gradient norm; clip fractions; engine/trainer logprob gap
(log scale); learning rate. Within a panel the colour is the run, the line style the key.

matplotlib is optional for the project (pip install matplotlib); nothing else needs it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

SKIP_REWARD = ("reward/errors",)
PANELS = [  # (title, key filter, log scale)
    ("reward (mean and parts)", lambda k: k.startswith("reward/") and k not in SKIP_REWARD, False),
    ("evaluation", lambda k: k.startswith("eval/") and k not in ("eval/n", "eval/samples",
                                                                 "eval/response_len"), False),
    ("response length (tokens)", lambda k: k == "response_len/mean", False),
    ("truncated share", lambda k: k == "response/truncated_frac", False),
    ("entropy", lambda k: k == "entropy", False),
    ("KL", lambda k: k in ("kl", "train/approx_kl"), False),
    ("gradient norm", lambda k: k == "grad_norm", False),
    ("clip fractions", lambda k: k in ("train/clip_frac_low", "train/clip_frac_high"), False),
    ("logprob_diff/max (engine vs trainer)", lambda k: k == "logprob_diff/max", True),
    ("learning rate", lambda k: k == "train/lr", False),
]
STYLES = ["-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1))]


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(rows: list[dict], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    pts = [(r[x], r[key]) for r in rows if key in r and isinstance(r[key], (int, float))
           and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def ema(ys: list[float], weight: float) -> list[float]:
    """TensorBoard-style exponential moving average, debiased at the start."""
    out, acc, norm = [], 0.0, 0.0
    for y in ys:
        acc = weight * acc + (1 - weight) * y
        norm = weight * norm + (1 - weight)
        out.append(acc / norm)
    return out


def load_run(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(step rows, evaluation rows with x = optimizer steps done)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = [r for r in read_jsonl(run_dir / "eval.jsonl") if "checkpoint" not in r]
    if not evals:  # older runs: evaluations only inside the step rows (after step + 1 updates)
        evals = [{**r, "after": r["step"] + 1} for r in rows if any(k.startswith("eval/") for k in r)]
    return rows, evals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", help="one or more run folders (run.out_dir)")
    ap.add_argument("-o", "--out", help="PNG to write (default: <first run>/curves.png)")
    ap.add_argument("--smooth", type=float, default=0.0,
                    help="EMA weight in [0, 1) for step curves (0: none; e.g. 0.8)")
    a = ap.parse_args(argv)
    if not 0.0 <= a.smooth < 1.0:
        print(f"error: --smooth must be in [0, 1), got {a.smooth}", file=sys.stderr)
        return 2
    runs = []
    for d in map(Path, a.run_dirs):
        if not (d / "metrics.jsonl").exists():
            print(f"error: no {d / 'metrics.jsonl'}", file=sys.stderr)
            return 2
        runs.append((d, *load_run(d)))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("error: plotting needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    panels = []
    for title, want, log in PANELS:
        keys = sorted({k for _, rows, ev in runs for r in rows + ev for k in r if want(k)},
                      key=lambda k: (k != "reward/mean", k))
        if keys:
            panels.append((title, keys, log))
    cols = 3
    fig, axes = plt.subplots(-(-len(panels) // cols), cols, figsize=(5.2 * cols, 3.4 * -(-len(panels) // cols)),
                             squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, keys, log) in zip(axes.flat, panels):
        for i, (d, rows, evals) in enumerate(runs):
            c = colours[i % len(colours)]
            for j, k in enumerate(keys):
                is_eval = k.startswith("eval/")
                x, y = series(evals, k, "after") if is_eval else series(rows, k)
                if not x:
                    continue
                label = f"{d.name}: {k}" if len(runs) > 1 else k
                style = STYLES[j % len(STYLES)]
                if a.smooth and not is_eval and len(y) > 1:
                    ax.plot(x, y, color=c, linestyle=style, alpha=0.25, lw=0.8)
                    y = ema(y, a.smooth)
                ax.plot(x, y, color=c, linestyle=style, marker="o" if is_eval else None, ms=3,
                        lw=1.4, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer steps done" if title == "evaluation" else "step")
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(" vs ".join(str(d) for d, _, _ in runs)
                 + (f" (EMA {a.smooth})" if a.smooth else ""), fontsize=11)
    fig.tight_layout()
    out = Path(a.out) if a.out else runs[0][0] / "curves.png"
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
