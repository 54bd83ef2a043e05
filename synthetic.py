"""The offline synthetic sets (docs/data.md): geometry diagrams with exact gold answers in
Geometry3K's spelling (`4 \\sqrt { 3 }`, `\\frac { 40 } { 3 }`), and text-only arithmetic.
Deterministic in the seed; a problem's split is a hash of its parameters (disjoint splits).

CLI, the set in Geometry3K's layout: python synthetic.py --write DIR [--n-train N ...]
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import random
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Callable

from PIL import Image, ImageDraw, ImageFont

SPLITS = ("train", "validation", "test")


IMAGE_MARKER = "<image>"  # in a problem or template: where an image goes (else images come first)
SYNTHETIC = ("synthetic", "synthetic-text")  # the offline sets of this module


@dataclass
class Problem:
    """One row of any split (data.py loads every source into these; here, the lower module)."""
    index: int  # position in its split; kept when other rows are skipped
    images: list  # RGB PIL images, in prompt order (none for a text-only set)
    problem: str  # question text without "<image>" markers (what rewards and records see)
    answer: str  # gold answer in the dataset's spelling
    raw: str = ""  # the question text with its "<image>" markers, where one follows some text
    columns: dict = field(default_factory=dict)  # every other column of the row (rewards)
    source: str = ""  # its data.sources name ("" for the one data.source): the rewards that grade it

    @property
    def marked(self) -> str:
        """The question with an "<image>" marker where each image goes (first, unless `raw`
        says otherwise): what records show, so several images can be told apart."""
        return self.raw or (IMAGE_MARKER * len(self.images) + self.problem)

    @property
    def image(self) -> Image.Image | None:
        """The first image (single-image sets; None for a text-only problem)."""
        return self.images[0] if self.images else None


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ImportError("parquet files need pyarrow: `pip install pyarrow`, or use jsonl") from None
    return pyarrow, pyarrow.parquet


# ---------------------------------------------------------------- answers, Geometry3K spelling
def square_free(n: int) -> tuple[int, int]:
    """(k, m) with n == k * k * m and m square-free."""
    k, m, f = 1, n, 2
    while f * f <= m:
        while m % (f * f) == 0:
            m, k = m // (f * f), k * f
        f += 1
    return k, m


def fmt_sqrt(n: int) -> str:
    """sqrt(n) as `5`, `\\sqrt { 41 }` or `4 \\sqrt { 3 }`."""
    k, m = square_free(n)
    if m == 1:
        return str(k)
    return f"\\sqrt {{ {m} }}" if k == 1 else f"{k} \\sqrt {{ {m} }}"


def fmt_frac(x: Fraction) -> str:
    """A positive rational as `7` or `\\frac { 40 } { 3 }` (Fraction keeps it reduced)."""
    if x.denominator == 1:
        return str(x.numerator)
    return f"\\frac {{ {x.numerator} }} {{ {x.denominator} }}"


def fmt_pi(k: int) -> str:
    return "\\pi" if k == 1 else f"{k} \\pi"


# ---------------------------------------------------------------- synthetic kinds
# Each kind is three pure functions: sample(rng) -> params, pose(params) -> (question, answer),
# figure(params) -> Figure. Tests call pose and figure directly with hand-picked params.
@dataclass
class Figure:
    """A diagram in model coordinates (y up); `render` fits it to the image."""

    lines: list = field(default_factory=list)  # ((x0, y0), (x1, y1))
    circles: list = field(default_factory=list)  # ((cx, cy), r)
    labels: list = field(default_factory=list)  # ((x, y), text, PIL anchor such as "mm")


def _anchor(dx: float, dy: float) -> str:
    """PIL text anchor so a label placed in direction (dx, dy) from its line grows away from it."""
    if abs(dx) >= 0.5 * math.hypot(dx, dy):
        return "lm" if dx > 0 else "rm"
    return "mb" if dy > 0 else "mt"  # model y is up, image y is down


def _edge_label(p, q, away, text: str, off: float):
    """A label beside the midpoint of segment pq, on the side away from point `away`."""
    mx, my = (p[0] + q[0]) / 2, (p[1] + q[1]) / 2
    nx, ny = p[1] - q[1], q[0] - p[0]
    norm = math.hypot(nx, ny)
    if nx * (mx - away[0]) + ny * (my - away[1]) < 0:
        nx, ny = -nx, -ny
    return ((mx + nx / norm * off, my + ny / norm * off), text, _anchor(nx, ny))


def _ray_label(deg: float, r: float, text: str):
    """A label at distance r from the origin along direction deg (an angle's bisector)."""
    return (_polar(r, deg), text, _anchor(*_polar(1.0, deg)))


def _polygon(fig: Figure, pts) -> None:
    fig.lines += [(pts[i], pts[(i + 1) % len(pts)]) for i in range(len(pts))]


def _polar(r: float, deg: float) -> tuple[float, float]:
    return (r * math.cos(math.radians(deg)), r * math.sin(math.radians(deg)))


def sample_right_triangle(rng: random.Random) -> dict:
    """Legs a (horizontal), b (vertical), hypotenuse c; the unknown one is None."""
    while True:
        unknown = rng.choice("abc")
        if unknown == "c":
            p = {"a": rng.randint(2, 15), "b": rng.randint(2, 15), "c": None}
        else:
            leg = rng.randint(2, 15)
            p = {"a": leg, "b": leg, "c": rng.randint(leg + 1, 20)}
            p[unknown] = None
        a, b = _right_triangle_legs(p)
        if max(a, b) <= 3 * min(a, b):  # keep the drawing readable
            return p


def _right_triangle_legs(p: dict) -> tuple[float, float]:
    c2 = p["c"] ** 2 if p["c"] else p["a"] ** 2 + p["b"] ** 2
    a = p["a"] if p["a"] else math.sqrt(c2 - p["b"] ** 2)
    b = p["b"] if p["b"] else math.sqrt(c2 - p["a"] ** 2)
    return a, b


def pose_right_triangle(p: dict) -> tuple[str, str]:
    if p["c"] is None:
        return "Find x.", fmt_sqrt(p["a"] ** 2 + p["b"] ** 2)
    leg = p["a"] if p["a"] is not None else p["b"]
    return "Find x.", fmt_sqrt(p["c"] ** 2 - leg**2)


def figure_right_triangle(p: dict) -> Figure:
    a, b = _right_triangle_legs(p)
    r, pa, pb = (0.0, 0.0), (a, 0.0), (0.0, b)
    fig, off, mark = Figure(), 0.05 * max(a, b), 0.1 * min(a, b)
    _polygon(fig, [r, pa, pb])
    fig.lines += [((mark, 0.0), (mark, mark)), ((0.0, mark), (mark, mark))]  # right-angle mark
    centroid = (a / 3, b / 3)
    for (s, t), name in (((r, pa), "a"), ((r, pb), "b"), ((pa, pb), "c")):
        fig.labels.append(_edge_label(s, t, centroid, str(p[name] or "x"), off))
    return fig


def sample_rectangle(rng: random.Random) -> dict:
    while True:
        w, h = rng.randint(2, 20), rng.randint(2, 20)
        if max(w, h) <= 3 * min(w, h):
            return {"w": w, "h": h, "ask": rng.choice(["area", "perimeter", "diagonal"])}


def pose_rectangle(p: dict) -> tuple[str, str]:
    w, h = p["w"], p["h"]
    if p["ask"] == "area":
        return "Find the area of the rectangle.", str(w * h)
    if p["ask"] == "perimeter":
        return "Find the perimeter of the rectangle.", str(2 * (w + h))
    return "Find x.", fmt_sqrt(w * w + h * h)


def figure_rectangle(p: dict) -> Figure:
    w, h = p["w"], p["h"]
    fig, off, centre = Figure(), 0.05 * max(w, h), (w / 2, h / 2)
    _polygon(fig, [(0, 0), (w, 0), (w, h), (0, h)])
    fig.labels += [_edge_label((0, 0), (w, 0), centre, str(w), off),
                   _edge_label((w, 0), (w, h), centre, str(h), off)]
    if p["ask"] == "diagonal":
        fig.lines.append(((0, 0), (w, h)))
        fig.labels.append(_edge_label((0, 0), (w, h), (w, 0), "x", off))
    return fig


def sample_circle(rng: random.Random) -> dict:
    return {"r": rng.randint(1, 30), "shown": rng.choice(["radius", "diameter"]),
            "ask": rng.choice(["circumference", "area"]), "exact": rng.random() < 0.5}


def pose_circle(p: dict) -> tuple[str, str]:
    coef = 2 * p["r"] if p["ask"] == "circumference" else p["r"] ** 2  # value = coef * pi
    if p["exact"]:
        return f"Find the exact {p['ask']} of the circle.", fmt_pi(coef)
    # Only irrational values (multiples of pi) are rounded, so there are no ties to break.
    return f"Find the {p['ask']} of the circle. Round to the nearest tenth.", f"{coef * math.pi:.1f}"


def figure_circle(p: dict) -> Figure:
    fig = Figure(circles=[((0.0, 0.0), 1.0), ((0.0, 0.0), 0.03)])
    start, text = (0.0, 0.0), str(p["r"])
    if p["shown"] == "diameter":
        start, text = (-1.0, 0.0), str(2 * p["r"])
    fig.lines.append((start, (1.0, 0.0)))
    fig.labels.append(((0.5, 0.05), text, "mb"))  # right of centre, clear of the centre dot
    return fig


_ANGLE_TOTAL = {"linear": 180, "complementary": 90, "triangle": 180}


def sample_angles(rng: random.Random) -> dict:
    """Given angles (degrees) and the unknown angle written as (p x + q) degrees."""
    variant = rng.choice(list(_ANGLE_TOTAL))
    if variant == "linear":
        given = (rng.randint(20, 160),)
    elif variant == "complementary":
        given = (rng.randint(10, 80),)
    else:
        g1 = rng.randint(20, 120)
        given = (g1, rng.randint(20, 160 - g1))
    rest = _ANGLE_TOTAL[variant] - sum(given)
    p = rng.choice([1, 1, 2, 3, 4, 5])
    q = 0 if rng.random() < 0.5 else rng.randint(1, rest - 1)
    return {"variant": variant, "given": given, "p": p, "q": q}


def pose_angles(p: dict) -> tuple[str, str]:
    x = Fraction(_ANGLE_TOTAL[p["variant"]] - sum(p["given"]) - p["q"], p["p"])
    return "Find x.", fmt_frac(x)


def _angle_expr(p: int, q: int) -> str:
    expr = ("x" if p == 1 else f"{p}x") + (f" + {q}" if q else "")
    return f"({expr})°" if q else f"{expr}°"


def figure_angles(p: dict) -> Figure:
    fig, given, o = Figure(), p["given"], (0.0, 0.0)
    unknown = _ANGLE_TOTAL[p["variant"]] - sum(given)
    expr, shown = _angle_expr(p["p"], p["q"]), [f"{g}°" for g in given]
    if p["variant"] == "linear":  # unknown angle between +x and the ray, given one beyond it
        fig.lines += [((-1.0, 0.0), (1.0, 0.0)), (o, _polar(1.0, unknown))]
        fig.labels += [_ray_label(unknown / 2, 0.3, expr), _ray_label(unknown + given[0] / 2, 0.3, shown[0])]
    elif p["variant"] == "complementary":  # a right angle split by one ray
        fig.lines += [(o, (1.0, 0.0)), (o, (0.0, 1.0)), (o, _polar(1.0, given[0]))]
        fig.lines += [((0.1, 0.0), (0.1, 0.1)), ((0.0, 0.1), (0.1, 0.1))]
        fig.labels += [_ray_label(given[0] / 2, 0.35, shown[0]), _ray_label(given[0] + unknown / 2, 0.35, expr)]
    else:  # base angles given, apex unknown; law of sines places the apex
        apex = _polar(math.sin(math.radians(given[1])) / math.sin(math.radians(unknown)), given[0])
        pts = [o, (1.0, 0.0), apex]
        _polygon(fig, pts)
        centroid = ((1.0 + apex[0]) / 3, apex[1] / 3)
        for vertex, angle, text in zip(pts, [*given, unknown], [*shown, expr]):
            # inside the corner, further in for narrow corners, never past the centroid
            dx, dy = centroid[0] - vertex[0], centroid[1] - vertex[1]
            k = min(0.09 / math.sin(math.radians(angle / 2)) / math.hypot(dx, dy), 0.8)
            fig.labels.append(((vertex[0] + k * dx, vertex[1] + k * dy), text, "mm"))
    return fig


def sample_similar(rng: random.Random) -> dict:
    """Small triangle: base s1, left side s2; the big one's base is t1 and its left side is x."""
    s1 = rng.randint(3, 12)
    return {"s1": s1, "s2": rng.randint(3, 12), "t1": rng.randint(s1 + 1, 5 * s1 // 2),
            "angle": rng.choice(range(45, 90, 5))}


def pose_similar(p: dict) -> tuple[str, str]:
    return "The two triangles are similar. Find x.", fmt_frac(Fraction(p["s2"] * p["t1"], p["s1"]))


def figure_similar(p: dict) -> Figure:
    fig, k = Figure(), p["t1"] / p["s1"]
    apex = _polar(p["s2"], p["angle"])
    shift = max(p["s1"], apex[0]) + 0.4 * p["s1"]
    for scale, dx, texts in ((1.0, 0.0, (p["s1"], p["s2"])), (k, shift, (p["t1"], "x"))):
        pts = [(dx, 0.0), (dx + scale * p["s1"], 0.0), (dx + scale * apex[0], scale * apex[1])]
        _polygon(fig, pts)
        centroid = (sum(x for x, _ in pts) / 3, sum(y for _, y in pts) / 3)
        off = 0.05 * scale * p["s1"]
        fig.labels += [_edge_label(pts[0], pts[1], centroid, str(texts[0]), off),
                       _edge_label(pts[0], pts[2], centroid, str(texts[1]), off)]
    return fig


KINDS: dict[str, tuple[Callable, Callable, Callable]] = {
    "right_triangle": (sample_right_triangle, pose_right_triangle, figure_right_triangle),
    "rectangle": (sample_rectangle, pose_rectangle, figure_rectangle),
    "circle": (sample_circle, pose_circle, figure_circle),
    "angles": (sample_angles, pose_angles, figure_angles),
    "similar": (sample_similar, pose_similar, figure_similar),
}


@dataclass(frozen=True)
class Spec:
    """One synthetic problem before drawing."""

    kind: str
    params: tuple  # sorted (name, value) pairs: hashable, and what decides the split
    question: str
    answer: str


def split_of(kind: str, params: tuple) -> str:
    """80/10/10 by a hash of what the problem shows, so splits are disjoint by construction."""
    h = int(hashlib.sha256(repr((kind, params)).encode()).hexdigest(), 16) % 10
    return "train" if h < 8 else ("validation" if h == 8 else "test")


def synthetic_specs(n: int, seed: int, split: str | None = None) -> list[Spec]:
    """n specs drawn from one seeded stream (a prefix of a longer list for the same seed)."""
    rng, specs = random.Random(seed), []
    while len(specs) < n:
        kind = rng.choice(list(KINDS))
        sample, pose, _ = KINDS[kind]
        params = sample(rng)
        key = tuple(sorted(params.items()))
        if split is None or split_of(kind, key) == split:
            specs.append(Spec(kind, key, *pose(params)))
    return specs


def render(fig: Figure, size: int) -> Image.Image:
    """Fit the figure (lines, circles, label anchors) into a size x size white RGB image."""
    pts = [pt for seg in fig.lines for pt in seg] + [pt for pt, _, _ in fig.labels]
    pts += [(cx + s * r, cy + s * r) for (cx, cy), r in fig.circles for s in (-1, 1)]
    xs, ys = [x for x, _ in pts], [y for _, y in pts]
    scale = size * 0.8 / max(max(xs) - min(xs), max(ys) - min(ys))
    mx, my = (max(xs) + min(xs)) / 2, (max(ys) + min(ys)) / 2

    def px(pt):
        return (size / 2 + (pt[0] - mx) * scale, size / 2 - (pt[1] - my) * scale)

    img = Image.new("RGB", (size, size), "white")
    draw, width = ImageDraw.Draw(img), max(1, round(size / 112))
    for a, b in fig.lines:
        draw.line([px(a), px(b)], fill="black", width=width)
    for c, r in fig.circles:
        (x, y), rr = px(c), r * scale
        draw.ellipse([x - rr, y - rr, x + rr, y + rr], outline="black", width=width)
    font = ImageFont.load_default(size=max(10, size // 11))
    for pt, text, anchor in fig.labels:
        x, y = px(pt)
        left, top, right, bottom = draw.textbbox((x, y), text, font=font, anchor=anchor)
        x += max(0, -left) - max(0, right - size)  # keep labels inside the image
        y += max(0, -top) - max(0, bottom - size)
        draw.text((x, y), text, fill="black", font=font, anchor=anchor)
    return img


def make_synthetic(
    n: int, seed: int, image_size: int = 112, *, split: str | None = None
) -> list[Problem]:
    """n synthetic problems, deterministic in seed; `split` keeps only that split's problems."""
    return [Problem(i, [render(KINDS[s.kind][2](dict(s.params)), image_size)], s.question, s.answer)
            for i, s in enumerate(synthetic_specs(n, seed, split))]


# ---------------------------------------------------------------- the text-only set
# `data.source = "synthetic-text"`: arithmetic word problems with integer answers, for the
# text-only demo (configs/tiny_text.toml); graded by the same verifier. The split is a hash of
# the numbers, as for the diagrams.
_TEXT_KINDS: dict[str, tuple[str, Callable[[int, int], int]]] = {
    "sum": ("What is {a} + {b}?", lambda a, b: a + b),
    "difference": ("What is {a} - {b}?", lambda a, b: a - b),
    "product": ("What is {a} times {b}?", lambda a, b: a * b),
    "apples": ("A basket holds {a} apples. Someone adds {b} more. How many apples are in the "
               "basket now?", lambda a, b: a + b),
    "rows": ("A hall has {a} rows of {b} chairs. How many chairs are there?", lambda a, b: a * b),
}


def make_synthetic_text(n: int, seed: int, *, split: str | None = None) -> list[Problem]:
    """n text problems (no images), deterministic in seed; `split` keeps only that split's."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        kind = rng.choice(list(_TEXT_KINDS))
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        if kind == "difference" and b > a:
            a, b = b, a
        if split is None or split_of(kind, (("a", a), ("b", b))) == split:
            text, answer = _TEXT_KINDS[kind]
            out.append(Problem(len(out), [], text.format(a=a, b=b), str(answer(a, b))))
    return out


def synthetic_split(split: str, *, seed: int = 0, n: int = 256, image_size: int = 112,
                    text: bool = False) -> list[Problem]:
    """The `split` of a synthetic set (`data.source = "synthetic"`, or `"synthetic-text"` with
    `text`): n problems drawn with a seed of the split's own (seed x 3 + the split's number)."""
    if split not in SPLITS:
        raise ValueError(f"synthetic split must be one of {SPLITS}, got {split!r}")
    split_seed = seed * len(SPLITS) + SPLITS.index(split)
    if text:
        return make_synthetic_text(n, split_seed, split=split)
    return make_synthetic(n, split_seed, image_size, split=split)


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def write_synthetic(
    out_dir: str | Path, n_train: int, n_val: int, n_test: int, seed: int = 0,
    image_size: int = 112, fmt: str = "jsonl",
) -> None:
    """Write the synthetic splits in hiyouga/geometry3k's layout (problem text starts "<image>")."""
    if fmt not in ("jsonl", "parquet"):
        raise ValueError(f"format must be jsonl or parquet, got {fmt!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for split, n in zip(SPLITS, (n_train, n_val, n_test)):
        rows = synthetic_split(split, seed=seed, n=n, image_size=image_size)
        if fmt == "jsonl":
            (out / "images" / split).mkdir(parents=True, exist_ok=True)
            lines = []
            for p in rows:
                rel = f"images/{split}/{p.index}.png"
                (out / rel).write_bytes(_png(p.image))
                row = {"images": [rel], "problem": IMAGE_MARKER + p.problem, "answer": p.answer}
                lines.append(json.dumps(row))
            (out / f"{split}.jsonl").write_text("".join(line + "\n" for line in lines))
        else:
            pa, pq = _pyarrow()
            image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
            schema = pa.schema([("images", pa.list_(image_type)), ("problem", pa.string()),
                                ("answer", pa.string())])
            records = [{"images": [{"bytes": _png(p.image), "path": f"{p.index}.png"}],
                        "problem": IMAGE_MARKER + p.problem, "answer": p.answer} for p in rows]
            (out / "data").mkdir(exist_ok=True)
            table = pa.Table.from_pylist(records, schema=schema)
            pq.write_table(table, out / "data" / f"{split}-00000-of-00001.parquet")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write the synthetic geometry set in Geometry3K's layout.")
    ap.add_argument("--write", metavar="DIR", required=True)
    ap.add_argument("--n-train", type=int, default=1024)
    ap.add_argument("--n-val", type=int, default=128)
    ap.add_argument("--n-test", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--image-size", type=int, default=112)
    ap.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    args = ap.parse_args(argv)
    counts = (args.n_train, args.n_val, args.n_test)
    write_synthetic(args.write, *counts, args.seed, args.image_size, args.format)
    print(f"wrote {'/'.join(map(str, counts))} problems to {args.write} ({args.format})")


if __name__ == "__main__":
    main()
