"""Draw reward, response length and eval accuracy from a run's metrics.jsonl into a PNG.

    python launch/plot.py runs/tiny            # writes runs/tiny/curves.png
    python launch/plot.py runs/tiny -o out.png

matplotlib is optional for the project (pip install matplotlib); nothing else needs it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("-o", "--out")
    a = ap.parse_args(argv)
    path = Path(a.run_dir) / "metrics.jsonl"
    if not path.exists():
        print(f"error: no {path}", file=sys.stderr)
        return 2
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("error: plotting needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    panels = [("reward", ["reward/mean", "reward/accuracy", "reward/format"]),
              ("response length (tokens)", ["response_len/mean"]),
              ("eval accuracy", ["eval/accuracy", "eval/format"])]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (title, keys) in zip(axes, panels):
        for k in keys:
            x, y = series(rows, k)
            if x:
                ax.plot(x, y, marker="o" if k.startswith("eval/") else None, ms=3, label=k)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(str(a.run_dir))
    fig.tight_layout()
    out = Path(a.out) if a.out else Path(a.run_dir) / "curves.png"
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
