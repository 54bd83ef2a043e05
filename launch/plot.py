"""Draw a run's curves (or several runs overlaid) from metrics.jsonl and eval.jsonl into a PNG.

    python launch/plot.py runs/tiny                      # writes runs/tiny/curves.png
    python launch/plot.py runs/a runs/b -o ab.png        # two runs overlaid, one colour each
    python launch/plot.py runs/tiny --smooth 0.8         # EMA smoothing (raw curve kept faint)
    python launch/plot.py runs/tiny --keys reward/mean,kl,time/   # only these panels

The x axis of every panel is rollout steps done: step row k (0-based) is drawn at k + 1, an
evaluation after N rollout steps at N (the one before the first step at 0), so a step and the
evaluation that followed it line up.

Panels (each drawn when its keys are present and not constant: a panel whose every curve is
flat, all-zero included, is left out; a flat key beside one that varies stays):
the total reward, its parts (`reward/*`), evaluation (every `eval/*` part, from eval.jsonl),
response length, truncated share, entropy, KL (to the reference, between updates, the adaptive
coefficient), gradient norm, clip fractions, ratio and TIS weight, engine/trainer logprob gap
(log scale), learning rate, the time of each phase and the token throughput. `--keys` replaces
them with one panel per named key or prefix ending in "/" (drawn even when flat). Within a
panel the colour is the run and the line style and marker the key (unique for up to 48 keys;
with one run the colour is the key too).

matplotlib is optional for the project (pip install matplotlib); nothing else needs it.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

EVAL_SKIP = ("eval/n", "eval/samples", "eval/response_len")
PANELS = [  # (short title, key filter, log scale)
    ("reward", lambda k: k == "reward/mean", False),
    ("reward parts", lambda k: k.startswith("reward/")
     and k not in ("reward/mean", "reward/errors"), False),
    ("eval", lambda k: k.startswith("eval/") and k not in EVAL_SKIP, False),
    ("length", lambda k: k in ("response_len/mean", "eval/response_len"), False),
    ("truncated", lambda k: k == "response/truncated_frac", False),
    ("entropy", lambda k: k == "entropy", False),
    ("KL", lambda k: k in ("kl", "train/approx_kl", "train/kl_seq_mean"), False),
    ("KL coef", lambda k: k == "train/kl_coef", False),
    ("grad norm", lambda k: k == "grad_norm", False),
    ("clip", lambda k: k.startswith("train/clip_frac_"), False),
    ("ratio", lambda k: k in ("train/ratio_mean", "train/tis_weight_mean"), False),
    ("lp gap", lambda k: k == "logprob_diff/max", True),
    ("lr", lambda k: k == "train/lr", False),
    ("time (s)", lambda k: k in ("time/step_s", "time/generate_s", "time/train_s", "time/sync_s"),
     False),
    ("tok/s", lambda k: k.startswith("time/") and k.endswith("tokens_per_s"), False),
]
LINESTYLES = ["-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1))]
MARKERS = [None, "o", "s", "^", "v", "D", "x", "+"]
STYLES = list(itertools.product(MARKERS, LINESTYLES))  # (marker, line style): 48 distinct


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(rows: list[dict], key: str, x: str = "step", shift: int = 0) -> tuple[list, list]:
    pts = [(r[x] + shift, r[key]) for r in rows if key in r and isinstance(r[key], (int, float))
           and not isinstance(r[key], bool) and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def points(run: tuple, key: str) -> tuple[list, list]:
    """A key's curve in rollout steps done: evaluations at `after`, step rows at step + 1."""
    _, rows, evals = run
    return series(evals, key, "after") if key.startswith("eval/") else series(rows, key, shift=1)


def ema(ys: list[float], weight: float) -> list[float]:
    """TensorBoard-style exponential moving average, debiased at the start."""
    out, acc, norm = [], 0.0, 0.0
    for y in ys:
        acc = weight * acc + (1 - weight) * y
        norm = weight * norm + (1 - weight)
        out.append(acc / norm)
    return out


def load_run(run_dir: Path) -> tuple[Path, list[dict], list[dict]]:
    """(folder, step rows, evaluation rows with `after` = rollout steps done)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = [r for r in read_jsonl(run_dir / "eval.jsonl") if "checkpoint" not in r]
    if not evals:  # older runs: evaluations only inside the step rows (after step + 1 steps)
        evals = [{**r, "after": r["step"] + 1} for r in rows if any(k.startswith("eval/") for k in r)]
    return run_dir, rows, evals


def varies(runs: list[tuple], key: str) -> bool:
    ys = [y for run in runs for y in points(run, key)[1]]
    return len(ys) > 0 and max(ys) != min(ys)


def panels(runs: list[tuple], keys: list[str] | None = None) -> list[tuple[str, list[str], bool]]:
    """(title, keys, log scale) of each panel to draw. Without `keys`: the PANELS whose keys are
    present, except those where no key varies; with `keys`: one panel per key or "prefix/", as
    asked."""
    present = sorted({k for _, rows, evals in runs for r in rows + evals for k in r
                      if k not in ("step", "after")})
    order = lambda k: (k != "reward/mean", k)  # noqa: E731
    out = []
    if keys:
        for want in keys:
            got = [k for k in present if (k.startswith(want) if want.endswith("/") else k == want)]
            if got:
                out.append((want.rstrip("/"), sorted(got, key=order), want == "logprob_diff/max"))
        return out
    claimed = set()
    for title, match, log in PANELS:
        got = [k for k in present if match(k) and points_any(runs, k)]
        claimed |= set(got)
        if any(varies(runs, k) for k in got):
            out.append((title, sorted(got, key=order), log))
    # train/ keys no panel names (a plugin objective's or filter's metrics): one more panel
    other = [k for k in present if k.startswith("train/") and k not in claimed
             and points_any(runs, k) and varies(runs, k)]
    if other:
        out.append(("other train/", other, False))
    return out


def points_any(runs: list[tuple], key: str) -> bool:
    return any(points(run, key)[0] for run in runs)


def plot(runs: list[tuple], keys: list[str] | None = None, smooth: float = 0.0):
    """The figure (matplotlib, Agg): one axis per panel, titled, each line labelled by its key
    (and run when several)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    chosen = panels(runs, keys)
    if not chosen:
        raise ValueError("nothing to plot: no panel's keys are present and varying"
                         + (f" (--keys {','.join(keys)})" if keys else ""))
    cols = min(3, len(chosen))
    n_rows = -(-len(chosen) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(5.2 * cols, 3.4 * n_rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, ks, log) in zip(axes.flat, chosen):
        for i, run in enumerate(runs):
            for j, k in enumerate(ks):
                x, y = points(run, k)
                if not x:
                    continue
                marker, style = STYLES[j % len(STYLES)]
                c = colours[(j if len(runs) == 1 else i) % len(colours)]
                is_eval = k.startswith("eval/")
                label = f"{run[0].name}: {k}" if len(runs) > 1 else k
                if smooth and not is_eval and len(y) > 1:
                    ax.plot(x, y, color=c, linestyle=style, alpha=0.25, lw=0.8)
                    y = ema(y, smooth)
                ax.plot(x, y, color=c, linestyle=style, marker=marker or ("o" if is_eval else None),
                        ms=3, markevery=max(1, len(x) // 12), lw=1.4, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("rollout steps done", fontsize=8)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(chosen):]:
        ax.axis("off")
    fig.suptitle(" vs ".join(str(d) for d, _, _ in runs) + (f" (EMA {smooth})" if smooth else ""),
                 fontsize=11)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", help="one or more run folders (run.out_dir)")
    ap.add_argument("-o", "--out", help="PNG to write (default: <first run>/curves.png)")
    ap.add_argument("--smooth", type=float, default=0.0,
                    help="EMA weight in [0, 1) for step curves (0: none; e.g. 0.8)")
    ap.add_argument("--keys", help="comma-separated metric keys or prefixes ending in '/', one "
                                   "panel each (e.g. reward/mean,kl,time/)")
    a = ap.parse_args(argv)
    if not 0.0 <= a.smooth < 1.0:
        print(f"error: --smooth must be in [0, 1), got {a.smooth}", file=sys.stderr)
        return 2
    runs = []
    for d in map(Path, a.run_dirs):
        if not (d / "metrics.jsonl").exists():
            print(f"error: no {d / 'metrics.jsonl'}", file=sys.stderr)
            return 2
        runs.append(load_run(d))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: plotting needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    keys = [k for k in (a.keys or "").split(",") if k] or None
    try:
        fig = plot(runs, keys, a.smooth)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out) if a.out else runs[0][0] / "curves.png"
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
