"""data.py: synthetic set (determinism, answer spelling and correctness, disjoint splits), the
local-folder loader (round trip, schema errors) and bad-row skipping (fixed cases and a property)."""

import io
import json
import logging
import math
import re
import sys
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

import data
import synthetic

# Geometry3K's spelling of the forms the synthetic set produces.
STYLE = re.compile(r"\d+|\d+\.\d|(\d+ )?\\sqrt \{ \d+ \}|\\frac \{ \d+ \} \{ \d+ \}|(\d+ )?\\pi")
REAL_TRAIN = Path("/work/shared/data/geometry3k-text/train.jsonl")


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


GOOD_PNG = png_bytes(Image.new("RGB", (8, 6), (10, 200, 30)))


def value(answer: str) -> float:
    """Numeric value of an answer in one of the STYLE forms (independent of data.py)."""
    if m := re.fullmatch(r"(\d+ )?\\sqrt \{ (\d+) \}", answer):
        return int(m[1] or 1) * math.sqrt(int(m[2]))
    if m := re.fullmatch(r"\\frac \{ (\d+) \} \{ (\d+) \}", answer):
        return int(m[1]) / int(m[2])
    if m := re.fullmatch(r"(\d+ )?\\pi", answer):
        return int(m[1] or 1) * math.pi
    return float(answer)


def expected(kind: str, p: dict) -> float:
    """The answer recomputed from the diagram's parameters with plain float geometry."""
    if kind == "right_triangle":
        if p["c"] is None:
            return math.hypot(p["a"], p["b"])
        return math.sqrt(p["c"] ** 2 - (p["a"] or p["b"]) ** 2)
    if kind == "rectangle":
        return {"area": p["w"] * p["h"], "perimeter": 2 * p["w"] + 2 * p["h"], "diagonal": math.hypot(p["w"], p["h"])}[p["ask"]]
    if kind == "circle":
        return 2 * math.pi * p["r"] if p["ask"] == "circumference" else math.pi * p["r"] ** 2
    if kind == "angles":
        total = 90 if p["variant"] == "complementary" else 180
        return (total - sum(p["given"]) - p["q"]) / p["p"]
    assert kind == "similar"
    return p["s2"] * p["t1"] / p["s1"]


# ---------------------------------------------------------------- synthetic set
def test_same_seed_same_bytes_different_seed_different():
    a, b, c = synthetic.make_synthetic(20, seed=3), synthetic.make_synthetic(20, seed=3), synthetic.make_synthetic(20, seed=4)
    assert [(p.problem, p.answer) for p in a] == [(p.problem, p.answer) for p in b]
    assert [png_bytes(p.image) for p in a] == [png_bytes(p.image) for p in b]
    assert [png_bytes(p.image) for p in a] != [png_bytes(p.image) for p in c]
    assert [p.index for p in a] == list(range(20))


def test_images_are_rgb_diagrams_of_the_requested_size():
    for p in synthetic.make_synthetic(10, seed=0, image_size=64) + synthetic.make_synthetic(5, seed=0, image_size=224):
        assert p.image.mode == "RGB" and p.image.size[0] == p.image.size[1] in (64, 224)
        colors = p.image.getcolors(maxcolors=1 << 16)
        assert max(colors)[1] == (255, 255, 255)  # white background
        assert min(sum(c) for _, c in colors) < 100  # black strokes


def test_every_answer_is_in_geometry3k_style():
    specs = synthetic.synthetic_specs(400, seed=1)
    assert {s.kind for s in specs} == set(synthetic.KINDS)
    for s in specs:
        assert STYLE.fullmatch(s.answer), s
        assert not re.search(r"(^|\D)0\d", s.answer), s  # no leading zeros
        for k, n in re.findall(r"(\d+ )?\\sqrt \{ (\d+) \}", s.answer):
            assert int(k or 2) > 1 and synthetic.square_free(int(n)) == (1, int(n)) and int(n) > 1, s
        for a, b in re.findall(r"\\frac \{ (\d+) \} \{ (\d+) \}", s.answer):
            assert math.gcd(int(a), int(b)) == 1 and int(b) > 1, s
        if s.answer.endswith("\\pi"):
            assert not s.answer.startswith("1 "), s


@pytest.mark.skipif(not REAL_TRAIN.exists(), reason="real Geometry3K text rows not present")
def test_style_regex_describes_real_geometry3k_answers():
    answers = [json.loads(line)["solution"] for line in REAL_TRAIN.read_text().splitlines()]
    share = sum(bool(STYLE.fullmatch(a)) for a in answers) / len(answers)
    assert share > 0.9, share  # the forms we emit are the forms the real set uses


@pytest.mark.parametrize("kind, params, answer", [
    ("right_triangle", {"a": 3, "b": 4, "c": None}, "5"),
    ("right_triangle", {"a": 4, "b": 5, "c": None}, "\\sqrt { 41 }"),
    ("right_triangle", {"a": 4, "b": None, "c": 8}, "4 \\sqrt { 3 }"),  # 64 - 16 = 48 = 16 * 3
    ("right_triangle", {"a": None, "b": 6, "c": 10}, "8"),
    ("rectangle", {"w": 5, "h": 12, "ask": "diagonal"}, "13"),
    ("rectangle", {"w": 6, "h": 6, "ask": "diagonal"}, "6 \\sqrt { 2 }"),
    ("rectangle", {"w": 5, "h": 12, "ask": "area"}, "60"),
    ("rectangle", {"w": 5, "h": 12, "ask": "perimeter"}, "34"),
    ("circle", {"r": 5, "shown": "radius", "ask": "circumference", "exact": True}, "10 \\pi"),
    ("circle", {"r": 5, "shown": "diameter", "ask": "area", "exact": True}, "25 \\pi"),
    ("circle", {"r": 1, "shown": "radius", "ask": "area", "exact": True}, "\\pi"),
    ("circle", {"r": 3, "shown": "radius", "ask": "circumference", "exact": False}, "18.8"),  # 18.849...
    ("circle", {"r": 4, "shown": "radius", "ask": "area", "exact": False}, "50.3"),  # 50.265...
    ("angles", {"variant": "linear", "given": (110,), "p": 1, "q": 0}, "70"),
    ("angles", {"variant": "linear", "given": (40,), "p": 3, "q": 0}, "\\frac { 140 } { 3 }"),
    ("angles", {"variant": "complementary", "given": (30,), "p": 4, "q": 20}, "10"),
    ("angles", {"variant": "triangle", "given": (50, 60), "p": 3, "q": 10}, "20"),
    ("angles", {"variant": "triangle", "given": (50, 60), "p": 4, "q": 0}, "\\frac { 35 } { 2 }"),
    ("similar", {"s1": 3, "s2": 5, "t1": 8, "angle": 60}, "\\frac { 40 } { 3 }"),
    ("similar", {"s1": 4, "s2": 6, "t1": 10, "angle": 60}, "15"),
])
def test_hand_checked_answers(kind, params, answer):
    assert synthetic.KINDS[kind][1](params)[1] == answer


def test_answers_match_the_diagram_parameters():
    for s in synthetic.synthetic_specs(400, seed=2):
        p = dict(s.params)
        rounded = s.kind == "circle" and not p["exact"]
        assert ("Round to the nearest tenth" in s.question) == rounded
        assert math.isclose(value(s.answer), expected(s.kind, p), rel_tol=1e-12, abs_tol=0.05 if rounded else 0), s
        # The diagram shows the numbers the answer is computed from, and x when x is asked for.
        texts = {text for _, text, _ in synthetic.KINDS[s.kind][2](p).labels}
        if s.kind == "right_triangle":
            assert texts == {str(p[k]) if p[k] else "x" for k in "abc"}
        elif s.kind == "rectangle":
            assert texts == {str(p["w"]), str(p["h"])} | ({"x"} if p["ask"] == "diagonal" else set())
        elif s.kind == "circle":
            assert texts == {str(p["r"] if p["shown"] == "radius" else 2 * p["r"])}
        elif s.kind == "angles":
            assert {f"{g}°" for g in p["given"]} < texts and any("x" in t for t in texts)
        else:
            assert texts == {str(p["s1"]), str(p["s2"]), str(p["t1"]), "x"}


def test_angle_expression_labels():
    assert synthetic._angle_expr(1, 0) == "x°"
    assert synthetic._angle_expr(3, 10) == "(3x + 10)°"


def test_square_free_and_spellings():
    assert [synthetic.square_free(n) for n in (1, 12, 72, 49, 30)] == [(1, 1), (2, 3), (6, 2), (7, 1), (1, 30)]
    assert synthetic.fmt_sqrt(72) == "6 \\sqrt { 2 }" and synthetic.fmt_sqrt(1) == "1"
    assert synthetic.fmt_frac(Fraction(80, 6)) == "\\frac { 40 } { 3 }" and synthetic.fmt_frac(Fraction(8, 2)) == "4"


def test_synthetic_splits_are_disjoint_and_seeded():
    seen = {}
    for split in data.SPLITS:
        rows, skipped = data.load_split("synthetic", split, seed=0, n_synthetic=120)
        assert len(rows) == 120 and skipped == []
        seen[split] = {(p.problem, p.image.tobytes()) for p in rows}
    assert not seen["train"] & seen["validation"]
    assert not seen["train"] & seen["test"]
    assert not seen["validation"] & seen["test"]
    other, _ = data.load_split("synthetic", "train", seed=1, n_synthetic=120)
    assert {(p.problem, p.image.tobytes()) for p in other} != seen["train"]
    with pytest.raises(ValueError, match="validation"):
        data.load_split("synthetic", "val")


def test_user_text():
    p = data.Problem(0, None, "Find x.", "5")
    assert data.user_text(p) == data.DEFAULT_TEMPLATE.replace("{problem}", "Find x.")
    assert data.user_text(p).startswith("Find x.\n\nFirst output the thinking process in <think> </think>")
    assert data.user_text(p, "{problem} Put the answer in \\boxed{}.") == "Find x. Put the answer in \\boxed{}."
    with pytest.raises(ValueError, match="Answer briefly"):
        data.user_text(p, "Answer briefly.")


# ---------------------------------------------------------------- loader
def assert_same(loaded, original):
    assert [(p.index, p.problem, p.answer) for p in loaded] == [(p.index, p.problem, p.answer) for p in original]
    assert [p.image.tobytes() for p in loaded] == [p.image.tobytes() for p in original]
    assert all(p.image.mode == "RGB" for p in loaded)


def test_jsonl_round_trip(tmp_path):
    synthetic.write_synthetic(tmp_path, 6, 3, 2, seed=5, image_size=80)
    first = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])
    assert first["problem"].startswith("<image>") and (tmp_path / first["images"][0]).is_file()
    for split, n in zip(data.SPLITS, (6, 3, 2)):
        loaded, skipped = data.load_split(str(tmp_path), split)
        original, _ = data.load_split("synthetic", split, seed=5, n_synthetic=n, image_size=80)
        assert skipped == [] and len(loaded) == n
        assert_same(loaded, original)


def test_parquet_round_trip(tmp_path):
    pytest.importorskip("pyarrow", reason="pyarrow not installed; parquet layout untested here")
    synthetic.write_synthetic(tmp_path, 4, 2, 2, seed=7, fmt="parquet")
    assert (tmp_path / "data" / "test-00000-of-00001.parquet").is_file()
    for split, n in zip(data.SPLITS, (4, 2, 2)):
        loaded, skipped = data.load_split(str(tmp_path), split)
        original, _ = data.load_split("synthetic", split, seed=7, n_synthetic=n)
        assert skipped == []
        assert_same(loaded, original)


def test_cli_writes_loadable_folder(tmp_path):
    synthetic.main(["--write", str(tmp_path / "out"), "--n-train", "3", "--n-val", "2", "--n-test", "1"])
    assert [len(data.load_split(str(tmp_path / "out"), s)[0]) for s in data.SPLITS] == [3, 2, 1]


def test_schema_errors_name_file_and_column(tmp_path):
    with pytest.raises(ValueError, match=r"validation\.jsonl"):
        data.load_split(str(tmp_path), "validation")  # no split file
    (tmp_path / "train.jsonl").write_text(json.dumps({"images": [], "problem": "Find x."}) + "\n")
    with pytest.raises(ValueError, match=r"train\.jsonl:1: missing column 'answer'"):
        data.load_split(str(tmp_path), "train")
    (tmp_path / "train.jsonl").write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"train\.jsonl:1: expected a JSON object, got list"):
        data.load_split(str(tmp_path), "train")
    with pytest.raises(ValueError, match="not a dataset folder"):
        data.load_split(str(tmp_path / "missing"), "train")


def test_empty_split_file_is_named_as_empty(tmp_path):
    """Not "no usable rows ... see data.max_prompt_len": there is nothing to read at all."""
    (tmp_path / "train.jsonl").write_text("\n")
    with pytest.raises(ValueError) as e:
        data.load_split(str(tmp_path), "train")
    assert str(e.value) == f"data.source: {tmp_path / 'train.jsonl'} is empty (no rows in split 'train')"
    with pytest.raises(ValueError, match="train.jsonl is empty"):
        data.load_problems(str(tmp_path), "train", seed=0, n_synthetic=1, image_size=28,
                           prompt_len=len, max_prompt_len=10)


def test_no_usable_rows_says_how_many_were_bad_and_how_many_too_long(tmp_path):
    (tmp_path / "good.png").write_bytes(GOOD_PNG)
    rows = [{"images": ["good.png"], "problem": "Find x.", "answer": "5"},
            {"images": ["nowhere.png"], "problem": "Find x.", "answer": "5"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"no usable rows in split 'train' of .* \(2 skipped: 1 bad "
                                         r"rows, 1 prompts longer than data.max_prompt_len\)"):
        data.load_problems(str(tmp_path), "train", seed=0, n_synthetic=1, image_size=28,
                           prompt_len=lambda p: 99, max_prompt_len=10)


def test_parquet_schema_error(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow not installed; parquet layout untested here")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"images": [[]], "problem": ["Find x."]}), tmp_path / "test.parquet")
    with pytest.raises(ValueError, match=r"test\.parquet: missing column 'answer'"):
        data.load_split(str(tmp_path), "test")
    # a column of single images is fine; a path that does not exist is a bad row, not a crash
    pq.write_table(pa.table({"images": ["a.png"], "problem": ["p"], "answer": ["1"]}), tmp_path / "test.parquet")
    rows, skipped = data.load_split(str(tmp_path), "test")
    assert rows == [] and skipped == [(0, "missing image file a.png")]


def _own_schema_rows(tmp_path, n=3):
    """Rows in another dataset's schema: question / solution / a single `image` path."""
    (tmp_path / "img").mkdir(exist_ok=True)
    rows = []
    for i, p in enumerate(synthetic.make_synthetic(n, seed=1)):
        p.image.save(tmp_path / "img" / f"{i}.png")
        rows.append({"question": f"<image>{p.problem}", "solution": p.answer, "image": f"img/{i}.png",
                     "extra": i})
    return rows


COLS = {"problem": "question", "answer": "solution", "images": "image"}


def test_column_mapping_jsonl(tmp_path):
    rows = _own_schema_rows(tmp_path)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got, skipped = data.load_split(str(tmp_path), "train", columns=COLS)
    assert skipped == [] and [p.problem for p in got] == [r["question"][7:] for r in rows]
    assert [p.answer for p in got] == [r["solution"] for r in rows] and got[0].image.mode == "RGB"
    # without the mapping: the file and the missing column are named
    with pytest.raises(ValueError, match=r"train\.jsonl:1: missing column 'problem'"):
        data.load_split(str(tmp_path), "train")
    # a mapped column that is missing names the config key too
    with pytest.raises(ValueError, match=r"train\.jsonl:1: missing column 'prompt' \(data\.problem_column\)"):
        data.load_split(str(tmp_path), "train", columns={**COLS, "problem": "prompt"})


def test_column_mapping_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    rows = _own_schema_rows(tmp_path)
    for r in rows:
        r["image"] = {"bytes": (tmp_path / r["image"]).read_bytes(), "path": r["image"]}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "validation.parquet")
    got, skipped = data.load_split(str(tmp_path), "validation", columns=COLS)
    assert skipped == [] and len(got) == 3 and got[2].answer == rows[2]["solution"]
    with pytest.raises(ValueError, match=r"validation\.parquet: missing column 'img' \(data\.images_column\)"):
        data.load_split(str(tmp_path), "validation", columns={**COLS, "images": "img"})


def test_hub_id_without_datasets_says_what_to_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match="pip install datasets"):
        data.load_split("hiyouga/geometry3k", "train")


# ---------------------------------------------------------------- bad rows
def test_bad_rows_are_skipped_and_reported(tmp_path, caplog):
    (tmp_path / "good.png").write_bytes(GOOD_PNG)
    (tmp_path / "corrupt.png").write_bytes(b"this is not a png")
    (tmp_path / "truncated.png").write_bytes(GOOD_PNG[: len(GOOD_PNG) // 2])
    rows = [
        {"images": ["good.png"], "problem": "<image>Find x.", "answer": "5"},
        {"images": ["corrupt.png"], "problem": "Find x.", "answer": "5"},
        {"images": ["nowhere.png"], "problem": "Find x.", "answer": "5"},
        {"images": ["good.png"], "problem": "<image> ", "answer": "5"},
        {"images": ["good.png"], "problem": "Find y.", "answer": 5},
        {"images": ["good.png"], "problem": "Find z.", "answer": "\\frac { 40 } { 3 }"},
        {"images": ["good.png", "good.png"], "problem": "<image>Find x.", "answer": "5"},  # 2 for 1
        {"images": ["truncated.png"], "problem": "Find x.", "answer": "5"},
    ]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING, logger="data"):
        kept, skipped = data.load_split(str(tmp_path), "test")
    assert [(p.index, p.problem, p.answer) for p in kept] == [(0, "Find x.", "5"), (5, "Find z.", "\\frac { 40 } { 3 }")]
    assert kept[0].image.tobytes() == Image.open(io.BytesIO(GOOD_PNG)).tobytes()
    reasons = dict(skipped)
    assert sorted(reasons) == [1, 2, 3, 4, 6, 7]
    assert "unreadable image" in reasons[1] and "unreadable image" in reasons[7]
    assert "missing image file" in reasons[2] and "nowhere.png" in reasons[2]
    assert "problem" in reasons[3] and "answer" in reasons[4]
    assert reasons[6] == "2 image(s) for 1 <image> placeholder(s)"
    for index, reason in skipped:  # each skipped row logged exactly once, with its index and reason
        assert sum(f"row {index}: {reason}" in r.getMessage() for r in caplog.records) == 1

    # The trainer's length filter runs on loaded Problems; indices stay the original ones.
    short, too_long = data.skip_bad_rows(kept, is_too_long=lambda p: "z" in p.problem)
    assert [p.index for p in short] == [0] and too_long == [(5, "too long")]


def test_raw_records_with_image_bytes():
    rows = [
        {"images": [{"bytes": GOOD_PNG, "path": None}], "problem": "Find x.", "answer": "1"},
        {"images": [{"bytes": b"\x89PNG\r\n\x1a\n garbage", "path": None}], "problem": "Find x.", "answer": "1"},
        {"images": [Image.new("L", (4, 4))], "problem": "Find x.", "answer": "2"},
        {"images": [{"bytes": None, "path": None}], "problem": "Find x.", "answer": "1"},
        {"images": [], "problem": "Find x.", "answer": "1"},
    ]
    kept, skipped = data.skip_bad_rows(rows)
    assert [p.index for p in kept] == [0, 2, 4] and kept[2].images == []   # no image: text only
    assert all(p.image.mode == "RGB" for p in kept[:2])
    assert [i for i, _ in skipped] == [1, 3]


image_entry = st.one_of(
    st.just({"bytes": GOOD_PNG, "path": None}),
    st.binary(max_size=64).map(lambda b: {"bytes": b, "path": None}),
    st.binary(max_size=64).map(lambda b: {"bytes": GOOD_PNG[:16] + b, "path": None}),
    st.integers(), st.none(), st.floats(), st.text(max_size=12), st.binary(max_size=8),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
text_value = st.one_of(st.text(max_size=20), st.none(), st.integers(), st.binary(max_size=4), st.lists(st.text(max_size=3), max_size=2))
record = st.fixed_dictionaries({"images": st.one_of(st.lists(image_entry, max_size=2), image_entry),
                                "problem": text_value, "answer": text_value})
row_strategy = st.one_of(record, record, st.none(), st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=2))


def is_valid(row) -> bool:
    """Oracle for rows the loader must keep: well-typed text and exactly the one good image."""
    return (isinstance(row, dict) and isinstance(row["images"], list) and len(row["images"]) == 1
            and row["images"][0] == {"bytes": GOOD_PNG, "path": None}
            and isinstance(row["problem"], str) and bool(row["problem"].replace("<image>", "").strip())
            and isinstance(row["answer"], str) and bool(row["answer"].strip()))


def is_well_typed(row) -> bool:
    """Rows that could be kept at all (no image, one, alone or in a list, or several): anything
    else must be skipped."""
    if not isinstance(row, dict):
        return False
    images = row["images"]
    images = [] if images is None else images if isinstance(images, list) else [images]
    return (all(isinstance(im, dict) and isinstance(im.get("bytes"), bytes) for im in images)
            and isinstance(row["problem"], str) and isinstance(row["answer"], str))


@settings(max_examples=150, deadline=None)
@given(st.lists(row_strategy, max_size=6))
def test_property_bad_rows_never_raise(rows):
    kept, skipped = data.skip_bad_rows(rows)
    assert sorted([p.index for p in kept] + [i for i, _ in skipped]) == list(range(len(rows)))
    for p in kept:
        assert all(isinstance(im, Image.Image) and im.mode == "RGB" for im in p.images)
        assert p.problem and "<image>" not in p.problem and isinstance(p.answer, str) and p.answer
        assert is_well_typed(rows[p.index])
    for i, row in enumerate(rows):
        if is_valid(row):
            assert i in {p.index for p in kept}
