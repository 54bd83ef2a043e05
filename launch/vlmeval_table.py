"""The seed's table from VLMEvalKit's result files (launch/vlmeval.sh runs it after VLMEvalKit).

    python launch/vlmeval_table.py --work-dir runs/vlmeval --base base --trained step_004596 [...]

VLMEvalKit (run.py --work-dir W) writes each model's scores under W/<model>/<run id>/ as
``<model>_<dataset>_<judge>_score.csv``: a table whose "Overall" row holds ``acc`` (percent).
This reads the newest of each (model, dataset), and prints base, each trained model and its
delta, beside the seed's rows: AReaL PR #746 (inclusionAI/AReaL 524d1d90f,
examples/vlm_npu/README.md, "Results"). While a base score is more than 1 point from the seed's,
a warning says so: the seed's evaluation settings are then not the ones used here, and a delta
is not comparable to the seed's.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

DATASETS = ("LogicVista", "MathVision_MINI", "MathVista_MINI")
# AReaL 524d1d90f examples/vlm_npu/README.md: Base Model, GRPO-GPU, GRPO-NPU (averages 33.8 / 37.4 / 36.8)
SEED = {"base": (31.0, 18.3, 52.3), "GPU": (35.4, 20.9, 55.9), "NPU": (35.3, 20.5, 54.7)}
SEED_AVG = {"base": 33.8, "GPU": 37.4, "NPU": 36.8}  # as the README prints them (33.87 -> 33.8 there)
TOLERANCE = 1.0  # points a base score may sit from the seed's before the table warns
MAX_PIXELS = 16384 * 28 * 28  # max_pixels of VLMEvalKit's registered 3B entry (vlmeval/config.py)


def score_file(work_dir: Path, model: str, dataset: str) -> Path:
    """The newest ``<model>_<dataset>_<judge>_score.csv`` under work_dir/<model>; SystemExit
    naming what was looked for when there is none."""
    found = sorted((work_dir / model).rglob(f"{model}_{dataset}_*score.csv"),
                   key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"vlmeval_table: no {model}_{dataset}_<judge>_score.csv under "
                         f"{work_dir / model} (did VLMEvalKit's evaluation of {dataset} finish? "
                         "LogicVista writes none without a judge)")
    return found[-1]


def overall(path: Path) -> float:
    """The ``acc`` of the "Overall" row of one score file."""
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if "Overall" in row.values():
                try:
                    return float(row["acc"])
                except (KeyError, TypeError, ValueError):
                    break
    raise SystemExit(f"vlmeval_table: {path} has no 'Overall' row with an 'acc' column")


def scores(work_dir: Path, model: str) -> list[float]:
    return [overall(score_file(work_dir, model, d)) for d in DATASETS]


def table(base: list[float], trained: dict[str, list[float]]) -> list[str]:
    """The table's lines: one per dataset and the average; base, each trained model and its
    delta, then the seed's base, GPU and NPU rows."""
    def avg(xs):
        return sum(xs) / len(xs)
    head = ["", "base"] + [x for name in trained for x in (name, "delta")] + [
        "seed base", "seed GPU", "seed NPU"]
    rows = []
    for i, name in enumerate([*DATASETS, "average"]):
        pick = (lambda xs: xs[i]) if i < len(DATASETS) else avg
        cells = [name, f"{pick(base):.1f}"]
        for t in trained.values():
            cells += [f"{pick(t):.1f}", f"{pick(t) - pick(base):+.1f}"]
        cells += [f"{SEED[k][i] if i < len(DATASETS) else SEED_AVG[k]:.1f}"
                  for k in ("base", "GPU", "NPU")]
        rows.append(cells)
    width = [max(len(r[j]) for r in [head, *rows]) for j in range(len(head))]
    return ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, width)))
            for r in [head, *rows]]


def warnings(base: list[float]) -> list[str]:
    return [f"WARNING: base {d} is {b:.1f}, {b - s:+.1f} from the seed's {s:.1f} (more than "
            f"{TOLERANCE:g} point): the evaluation differs from the seed's, so the deltas are not "
            "comparable to its deltas yet"
            for d, b, s in zip(DATASETS, base, SEED["base"]) if abs(b - s) > TOLERANCE]


def check_export(folder: Path) -> str:
    """A warning when the model folder's image processor caps images below VLMEvalKit's
    max_pixels ("" when it does not): exports written before checkpoint.py kept the source
    model's processor carry the run's model.max_pixels (4.19 MP in vl3b.toml), so VLMEvalKit
    would shrink a checkpoint's large images further than the base model's."""
    import json
    conf = json.loads((folder / "preprocessor_config.json").read_text())
    cap = conf.get("max_pixels") or (conf.get("size") or {}).get("longest_edge")
    if cap is None or cap >= MAX_PIXELS:
        return ""
    return (f"WARNING: {folder}/preprocessor_config.json caps images at {cap / 1e6:.2f} MP, under "
            f"VLMEvalKit's max_pixels {MAX_PIXELS / 1e6:.2f} MP: copy the base model's "
            "preprocessor_config.json there, or export it again (checkpoint.py keeps the base's "
            "processor now)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check-export", type=Path, help="only check one model folder's pixel bound")
    ap.add_argument("--work-dir", type=Path, help="VLMEvalKit's --work-dir")
    ap.add_argument("--base", help="the base model's name in VLMEvalKit's config")
    ap.add_argument("--trained", nargs="*", default=[], help="each checkpoint's name")
    args = ap.parse_args(argv)
    if args.check_export:
        warning = check_export(args.check_export)
        if warning:
            print(warning, file=sys.stderr)
        return 1 if warning else 0
    if args.work_dir is None or args.base is None:
        ap.error("--work-dir and --base are needed for the table")
    base = scores(args.work_dir, args.base)
    trained = {name: scores(args.work_dir, name) for name in args.trained}
    print("\n".join(table(base, trained)))
    for line in warnings(base):
        print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
