"""Draw a run's curves (or several runs overlaid) from metrics.jsonl and eval.jsonl into a figure.

    python launch/plot.py runs/tiny                      # writes runs/tiny/curves.png
    python launch/plot.py runs/a runs/b -o ab.png        # two runs overlaid, one colour each
    python launch/plot.py runs/tiny --smooth 0.8         # EMA smoothing (raw curve kept faint)
    python launch/plot.py runs/tiny --keys reward/mean,kl,time/   # only these panels
    python launch/plot.py runs/grpo_s0 runs/grpo_s1 runs/dapo_s0 runs/dapo_s1 \
        --labels grpo,grpo,dapo,dapo --x tokens -o grpo_vs_dapo.pdf  # seed bands, by trained tokens

`--labels` names the runs in the legends and the title (default: each folder's name); runs that
share a label are drawn as their mean with a band from their minimum to their maximum (seeds):
each run's curve (smoothed first with `--smooth`) is interpolated linearly onto one common grid,
every x any of them has within the range they all cover, so that runs whose points fall at
different times or token counts are compared at the same x. A metric absent from some rows
(a step that did not measure it) is bridged the same way.
`--x` chooses the x axis: `step` (rollout steps done, the default: step row k at k + 1, an
evaluation after N rollout steps at N, the one before the first step at 0), `optimizer_steps`
(`train/optimizer_steps`), `tokens` (trained tokens so far, summed `train/tokens`) or `time`
(wall seconds since the run's records opened, `time/elapsed_s`: start-up, evaluations and
checkpoints included, a resumed run's segments laid end to end; for runs that lack it, summed
`time/step_s`, said in the axis label); an evaluation sits where the step it followed ends (the
one before the first step where the first step starts).
The output's extension chooses the format: `.png`, or `.pdf` / `.svg` for vector figures.

Panels (each drawn when its keys are present and not constant: a panel whose every curve is
flat, all-zero included, is left out; a key that is zero throughout is left out of its panel;
legends sit beside the axes, outside the data; the y axis is labelled with the panel's key, or
its title when it holds several):
the total reward, its parts (`reward/*`), evaluation (every `eval/*` part, from eval.jsonl),
response length, truncated share, entropy, KL (to the reference, between updates, the adaptive
coefficient), gradient norm, clip fractions, ratio and TIS weight, engine/trainer logprob gap
(log scale), learning rate, the time of each phase and the token throughput. `--keys` replaces
them with one panel per named key or prefix ending in "/" (drawn even when flat). Within a
panel the colour is the run and the line style and marker the key (unique for up to 48 keys;
with one run the colour is the key too); the legend names each label once (its colour) and,
in a panel of several keys, each key once (its line style).

matplotlib is optional for the project (pip install matplotlib); nothing else needs it.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

EVAL_SKIP = ("eval/n", "eval/samples", "eval/response_len", "eval/skipped_rows")
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


XS = {"step": "rollout steps done", "optimizer_steps": "optimizer steps",
      "tokens": "trained tokens", "time": "wall time (s, start-up included)",
      # `time` where a run's records lack time/elapsed_s (older ones): summed time/step_s
      "step_time": "wall time (s, steps only: start-up, evaluations, checkpoints left out)"}


def x_axis(runs: list[tuple], x: str) -> str:
    """The x axis that draws `--x x` for `runs`: `time` becomes `step_time` unless every run's
    every row has `time/elapsed_s` (one axis for all of them)."""
    every = all(rows and all("time/elapsed_s" in r for r in rows) for _, rows, _ in runs)
    return "step_time" if x == "time" and not every else x


def step_x(rows: list[dict], x: str) -> dict[int, float]:
    """Where each step row ends on the `x` axis (XS), by its step number; -1: where the first
    step starts (the end of start-up on the time axis, else 0)."""
    out, total, base, last = {-1: 0.0}, 0.0, 0.0, 0.0
    for r in rows:
        if x == "step":
            out[r["step"]] = r["step"] + 1
        elif x == "optimizer_steps":
            out[r["step"]] = r.get("train/optimizer_steps", float("nan"))
        elif x == "time":
            if r["time/elapsed_s"] < last:  # a resumed run's own clock: after the kept rows
                base += last
            last = r["time/elapsed_s"]
            out[r["step"]] = base + last
        else:
            total += r.get("train/tokens" if x == "tokens" else "time/step_s", 0.0)
            out[r["step"]] = total
    if x == "time" and rows:
        out[-1] = rows[0]["time/elapsed_s"] - rows[0].get("time/step_s", 0.0)
    return out


def points(run: tuple, key: str, x: str = "step") -> tuple[list, list]:
    """A key's curve on the `x` axis: step rows where their step ends, evaluations (after N
    rollout steps) where step N - 1 ends (before the first: where it starts)."""
    _, rows, evals = run
    where = step_x(rows, x)
    if key.startswith("eval/"):
        xs, ys = series(evals, key, "after")
        xs = [where[-1] if n == 0 else where.get(n - 1, float("nan")) for n in xs]
    else:
        steps, ys = series(rows, key)
        xs = [where[n] for n in steps]
    keep = [i for i, v in enumerate(xs) if math.isfinite(v)]
    return [xs[i] for i in keep], [ys[i] for i in keep]


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


def all_zero(runs: list[tuple], key: str) -> bool:
    ys = [y for run in runs for y in points(run, key)[1]]
    return bool(ys) and not any(ys)


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
            out.append((title, sorted((k for k in got if not all_zero(runs, k)), key=order), log))
    # train/ keys no panel names (a plugin objective's or filter's metrics): one more panel
    other = [k for k in present if k.startswith("train/") and k not in claimed
             and points_any(runs, k) and varies(runs, k)]
    if other:
        out.append(("other train/", other, False))
    return out


def points_any(runs: list[tuple], key: str) -> bool:
    return any(points(run, key)[0] for run in runs)


def groups(runs: list[tuple], labels: list[str] | None) -> list[tuple[str, list[tuple]]]:
    """(label, its runs) in first-seen order; default labels: the folders' names."""
    out: dict[str, list[tuple]] = {}
    for run, label in zip(runs, labels or [run[0].name for run in runs]):
        out.setdefault(label, []).append(run)
    return list(out.items())


def curve(run: tuple, key: str, x: str, smooth: float = 0.0) -> tuple[list, list]:
    """:func:`points`, EMA-smoothed with `smooth` > 0 (evaluations never: a few points each)."""
    xs, ys = points(run, key, x)
    if smooth and not key.startswith("eval/") and len(ys) > 1:
        ys = ema(ys, smooth)
    return xs, ys


def band(runs: list[tuple], key: str, x: str, smooth: float = 0.0) -> tuple[list, list, list, list]:
    """Several runs of one label on one common grid: every x any run has within the range every
    run covers; each run's (smoothed) curve interpolated linearly there. (grid, mean, min,
    max); empty when the runs share no range. Runs without the key are left out."""
    import numpy as np
    curves = [c for c in (curve(run, key, x, smooth) for run in runs) if c[0]]
    if not curves:
        return [], [], [], []
    lo, hi = max(c[0][0] for c in curves), min(c[0][-1] for c in curves)
    grid = sorted({v for c in curves for v in c[0] if lo <= v <= hi})
    if not grid:
        return [], [], [], []
    ys = np.stack([np.interp(grid, c[0], c[1]) for c in curves])          # [runs, grid]
    return grid, ys.mean(0).tolist(), ys.min(0).tolist(), ys.max(0).tolist()


def draw(ax, label_runs: tuple, k: str, look: tuple, smooth: float, x: str, label: str) -> None:
    """One key of one label on `ax`: a line (a run) or a mean line with its band (several); with
    `smooth`, the raw curve (the raw mean) faint behind."""
    _, runs = label_runs
    marker, style, c = look
    is_eval = k.startswith("eval/")
    if len(runs) > 1:
        xs, ys, lo, hi = band(runs, k, x, smooth)
        if not xs:
            return
        ax.fill_between(xs, lo, hi, color=c, alpha=0.2, lw=0)
        raw = band(runs, k, x)[:2] if smooth and not is_eval else None
    else:
        xs, ys = curve(runs[0], k, x, smooth)
        if not xs:
            return
        raw = points(runs[0], k, x) if smooth and not is_eval and len(ys) > 1 else None
    if raw:
        ax.plot(*raw, color=c, linestyle=style, alpha=0.25, lw=0.8)
    ax.plot(xs, ys, color=c, linestyle=style, marker=marker or ("o" if is_eval else None),
            ms=3, markevery=max(1, len(xs) // 12), lw=1.4, label=label)


def legend(ax, labels: list[str], keys: list[str], colours: list[str]) -> None:
    """Beside the axes: each label once (its colour) with several labels, each key once (its
    line style and marker) where the panel holds several keys; one label: the keys' lines."""
    from matplotlib.lines import Line2D
    if len(labels) == 1:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        return
    handles = [Line2D([], [], color=colours[i % len(colours)], lw=2, label=lab)
               for i, lab in enumerate(labels)]
    if len(keys) > 1:
        handles += [Line2D([], [], color="0.3", linestyle=STYLES[j % len(STYLES)][1],
                           marker=STYLES[j % len(STYLES)][0], ms=3, label=k)
                    for j, k in enumerate(keys)]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              borderaxespad=0)


def plot(runs: list[tuple], keys: list[str] | None = None, smooth: float = 0.0,
         labels: list[str] | None = None, x: str = "step"):
    """The figure (matplotlib, Agg): one axis per panel, titled, the y axis labelled with its key
    (or the title), each line labelled `<label>: <key>` (the key alone with one label), one
    legend entry per label and per key; legends beside the axes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    chosen = panels(runs, keys)
    if not chosen:
        raise ValueError("nothing to plot: no panel's keys are present and varying"
                         + (f" (--keys {','.join(keys)})" if keys else ""))
    by_label, x = groups(runs, labels), x_axis(runs, x)
    cols = min(3, len(chosen))
    n_rows = -(-len(chosen) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(7.0 * cols, 3.4 * n_rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, ks, log) in zip(axes.flat, chosen):
        for i, group in enumerate(by_label):
            for j, k in enumerate(ks):
                marker, style = STYLES[j % len(STYLES)]
                look = (marker, style, colours[(j if len(by_label) == 1 else i) % len(colours)])
                draw(ax, group, k, look, smooth, x, f"{group[0]}: {k}" if len(by_label) > 1 else k)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(XS[x], fontsize=8)
        ax.set_ylabel(ks[0] if len(ks) == 1 else title, fontsize=8)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        legend(ax, [label for label, _ in by_label], ks, colours)
    for ax in list(axes.flat)[len(chosen):]:
        ax.axis("off")
    fig.suptitle(" vs ".join(label for label, _ in by_label) + (f" (EMA {smooth})" if smooth else ""),
                 fontsize=11)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", help="one or more run folders (run.out_dir)")
    ap.add_argument("-o", "--out", help="the figure to write: .png, or .pdf / .svg for vector "
                                        "output (default: <first run>/curves.png)")
    ap.add_argument("--smooth", type=float, default=0.0,
                    help="EMA weight in [0, 1) for step curves (0: none; e.g. 0.8)")
    ap.add_argument("--keys", help="comma-separated metric keys or prefixes ending in '/', one "
                                   "panel each (e.g. reward/mean,kl,time/)")
    ap.add_argument("--labels", help="comma-separated, one per run (runs sharing one: a seed band)")
    ap.add_argument("--x", default="step", choices=[k for k in XS if k != "step_time"],
                    help="the x axis (default: step)")
    a = ap.parse_args(argv)
    labels = a.labels.split(",") if a.labels else None
    if labels is not None and len(labels) != len(a.run_dirs):
        print(f"error: --labels names {len(labels)} run(s), {len(a.run_dirs)} given", file=sys.stderr)
        return 2
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
        fig = plot(runs, keys, a.smooth, labels, a.x)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out) if a.out else runs[0][0] / "curves.png"
    fig.savefig(out, dpi=110, bbox_inches="tight")  # by its extension; the legends included
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
