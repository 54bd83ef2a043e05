"""Datasets and prompts: Geometry3K (local folder or hub id), the synthetic sets, the step stream.

Every split is a list of `Problem`. A bad row (missing or unreadable image, empty problem or
answer, a JSONL line that is not UTF-8, images and `<image>` markers that disagree) is dropped
and reported as (index, reason); a schema problem (missing split file or column, a JSONL line
that is not an object) is a ValueError naming the file. The accepted layouts: docs/data.md.

CLI (kept for compatibility; see synthetic.py): python data.py --write-synthetic DIR [...]
"""

from __future__ import annotations

import io
import json
import logging
import random
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from PIL import Image

# the record and the split names live in synthetic.py, the lower module (data -> synthetic)
from config import DEFAULT_TEMPLATE
from errors import ConfigError, ModelError
from synthetic import IMAGE_MARKER, SPLITS, SYNTHETIC, Problem, _pyarrow, synthetic_split

log = logging.getLogger("data")

COLUMNS = ("images", "problem", "answer")  # the canonical names; `columns=` maps a dataset's own
#                                           ("images": "" = a text-only set)


def user_text(problem: Problem, template: str = DEFAULT_TEMPLATE) -> str:
    """The user turn: `template` with {problem} filled in (with the problem's `<image>` markers,
    where it has any: inputs.prompt_ids puts each image there)."""
    if "{problem}" not in template:
        raise ValueError(f"prompt template has no {{problem}} placeholder: {template!r}")
    # replace, not str.format: templates such as "... in \boxed{}" carry literal braces.
    return template.replace("{problem}", problem.raw or problem.problem)


# ---------------------------------------------------------------- loading and bad rows
class _BadRow(Exception):
    pass


def _open_image(obj: Any) -> Image.Image:
    """An RGB copy of one `images` entry: PIL image, {"bytes", "path"} dict, or path string."""
    raw = path = None
    if isinstance(obj, Image.Image):
        src = obj
    elif isinstance(obj, Mapping) and isinstance(obj.get("bytes"), (bytes, bytearray)):
        raw = bytes(obj["bytes"])
    elif isinstance(obj, Mapping) and isinstance(obj.get("path"), str):
        path = obj["path"]
    elif isinstance(obj, str):
        path = obj
    else:
        raise _BadRow(f"image is {type(obj).__name__}, not an image")
    if path is not None and not Path(path).is_file():
        raise _BadRow(f"missing image file {path}")
    try:  # decoders raise many types (OSError, SyntaxError, ValueError, ...) on corrupt input
        if raw is not None or path is not None:
            with Image.open(io.BytesIO(raw) if raw is not None else path) as src:
                src.load()
                return src.convert("RGB")
        return src.convert("RGB")
    except Exception as e:
        raise _BadRow(f"unreadable image ({type(e).__name__}: {e})") from None


def _to_problem(index: int, row: Any) -> Problem:
    if isinstance(row, _BadRow):  # found by the reader (a line that is not UTF-8)
        raise row
    if isinstance(row, Problem):
        problem, answer, images, columns = row.raw or row.problem, row.answer, row.images, row.columns
    elif isinstance(row, Mapping):
        problem, answer, images = row.get("problem"), row.get("answer"), row.get("images", [])
        columns = {k: v for k, v in row.items() if k not in COLUMNS}
    else:
        raise _BadRow(f"row is {type(row).__name__}, not a mapping")
    if not isinstance(problem, str) or not problem.replace(IMAGE_MARKER, "").strip():
        raise _BadRow("problem is empty or not a string")
    if not isinstance(answer, str) or not answer.strip():
        raise _BadRow("answer is empty or not a string")
    if isinstance(images, (str, Mapping, Image.Image)):  # a column of single images
        images = [images]
    if images is None:
        images = []
    if not isinstance(images, (list, tuple)):
        raise _BadRow(f"images is {type(images).__name__}, not an image or a list of images")
    images = [im if isinstance(row, Problem) and isinstance(im, Image.Image) else _open_image(im)
              for im in images]
    markers = problem.count(IMAGE_MARKER)
    if markers and markers != len(images):
        raise _BadRow(f"{len(images)} image(s) for {markers} {IMAGE_MARKER} placeholder(s)")
    # kept only where a marker sits after some text: leading markers (Geometry3K) = images first
    lead = problem.strip()
    while lead.startswith(IMAGE_MARKER):
        lead = lead[len(IMAGE_MARKER):].lstrip()
    raw = problem.strip() if IMAGE_MARKER in lead else ""
    return Problem(index, images, problem.replace(IMAGE_MARKER, "").strip(), answer.strip(), raw,
                   columns)


def skip_bad_rows(
    rows: Iterable[Problem | Mapping], is_too_long: Callable[[Problem], bool] | None = None
) -> tuple[list[Problem], list[tuple[int, str]]]:
    """Kept rows (as Problems, original index) and (index, reason) for each dropped row. Rows are
    Problems (index kept) or records {"images", "problem", "answer"} (index = position);
    `is_too_long` is the trainer's prompt-length check."""
    kept, skipped = [], []
    for pos, row in enumerate(rows):
        index = row.index if isinstance(row, Problem) else pos
        try:
            problem = _to_problem(index, row)
            if is_too_long is not None and is_too_long(problem):
                raise _BadRow("too long")
            kept.append(problem)
        except _BadRow as e:
            log.warning("skipping row %d: %s", index, e)
            skipped.append((index, str(e)))
    return kept, skipped


def _split_files(root: Path, split: str) -> list[Path]:
    for files in ([root / f"{split}.jsonl"], [root / f"{split}.parquet"],
                  sorted((root / "data").glob(f"{split}-*.parquet"))):
        if files and files[0].is_file():
            return files
    raise ValueError(f"{root}: no split file {split}.jsonl, {split}.parquet or data/{split}-*.parquet")


def _mapping(columns: Mapping[str, str] | None) -> dict[str, str]:
    """canonical name -> the dataset's own column name (identity where not mapped; an images
    column mapped to "" is left out: a text-only set)."""
    cols = {c: (columns or {}).get(c, c) for c in COLUMNS}
    return {c: name for c, name in cols.items() if name}


def _missing(where: str, have: Iterable[str], cols: dict[str, str]) -> None:
    have = list(have)
    for canon in ("problem", "answer", "images"):
        name = cols.get(canon)
        if name is not None and name not in have:
            key = f" (data.{canon}_column)" if name != canon or canon == "images" else ""
            raise ValueError(f"{where}: missing column {name!r}{key}; has {sorted(have)}")


def _canonical(row: Mapping, cols: dict[str, str]) -> dict:
    """The row under the canonical names, plus every other column as it is."""
    mapped = set(cols.values())
    return {**{k: v for k, v in row.items() if k not in mapped and k not in COLUMNS},
            **{canon: row[name] for canon, name in cols.items()}}


def _read_jsonl(path: Path, columns: Mapping[str, str] | None = None) -> Iterator[dict | _BadRow]:
    # split as bytes, decoded per line: a line that is not UTF-8 is one bad row, and a U+2028
    # inside a JSON string (where str.splitlines() would cut) stays in its row
    cols = _mapping(columns)
    for n, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield _BadRow(f"{path.name}:{n}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})")
            continue
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
        _missing(f"{path}:{n}", row, cols)
        row = _canonical(row, cols)
        images = row.get("images", [])
        if isinstance(images, str):
            images = [images]
        if isinstance(images, list):  # image paths are relative to the jsonl's folder
            row["images"] = [str(path.parent / i) if isinstance(i, str) else i for i in images]
        yield row


def _read_parquet(paths: list[Path], columns: Mapping[str, str] | None = None) -> Iterator[dict]:
    pa, pq = _pyarrow()
    cols = _mapping(columns)
    for path in paths:
        try:
            table = pq.read_table(path)
        except Exception as e:
            raise ValueError(f"{path}: not a readable parquet file ({type(e).__name__})") from None
        _missing(str(path), table.column_names, cols)
        for row in table.to_pylist():
            yield _canonical(row, cols)


def _read_hub(name: str, split: str, columns: Mapping[str, str] | None = None) -> Iterator[dict]:
    try:
        import datasets
    except ImportError:
        raise ImportError(f"loading {name!r} needs `pip install datasets`; or pass a local folder") from None
    ds = datasets.load_dataset(name, split=split)
    cols = _mapping(columns)
    _missing(f"{name} [{split}]", ds.column_names, cols)
    return (_canonical(row, cols) for row in ds)


def load_split(
    source: str, split: str, *, seed: int = 0, n_synthetic: int = 256, image_size: int = 112,
    columns: Mapping[str, str] | None = None,
) -> tuple[list[Problem], list[tuple[int, str]]]:
    """(problems, skipped) for one split of "synthetic", a local folder, or a hub id. `columns`
    maps the canonical names ("problem", "answer", "images") to the dataset's own ("images": ""
    for a text-only set); a missing mapped column is a ValueError naming the file and column."""
    if source in SYNTHETIC:
        return synthetic_split(split, seed=seed, n=n_synthetic, image_size=image_size,
                               text=source == "synthetic-text"), []
    root = Path(source).expanduser()
    if root.is_dir():
        files = _split_files(root, split)
        rows = (_read_jsonl(files[0], columns) if files[0].suffix == ".jsonl"
                else _read_parquet(files, columns))
        kept, skipped = skip_bad_rows(rows)
        if not kept and not skipped:  # not a max_prompt_len matter: there is nothing to read
            raise ValueError(f"data.source: {' + '.join(map(str, files))} is empty (no rows in "
                             f"split {split!r})")
        return kept, skipped
    problem = source_problem(source)
    if problem:
        raise ValueError(f"data.source: {problem}")
    return skip_bad_rows(_read_hub(source, split, columns))


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# First components that name a local folder, not a hub owner: `data/g3k` typed in another
# working directory is a folder that is missing there, not a dataset to download.
_LOCAL_FIRST = {"data", "dataset", "datasets", "runs", "out", "output", "outputs", "tmp", "home",
                "mnt", "scratch", "work", "local", "shared"}


def check_source(source: str) -> None:
    """`data.source` can be read (:func:`source_problem`), else a ConfigError naming the key."""
    problem = source_problem(source)
    if problem:
        raise ConfigError(f"data.source: {problem}")


def source_problem(source: str) -> str | None:
    """Why `source` can be neither "synthetic", a local folder nor a hub dataset id (`owner/name`),
    or None. A missing path is named as one, also a relative one or an `owner/name` that looks
    like a path (`data/g3k`, `runs/x`: _LOCAL_FIRST; `x/train.jsonl`), not sent to the hub."""
    if source in SYNTHETIC or Path(source).expanduser().is_dir():
        return None
    path = Path(source).expanduser()
    if path.exists():
        return f"{source} is not a dataset folder"
    first = source.split("/")[0]
    if (source.startswith(("/", ".", "~")) or not _HUB_ID.fullmatch(source)
            or Path(first).is_dir() or first.lower() in _LOCAL_FIRST
            or source.endswith((".jsonl", ".json", ".parquet"))):
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        return (f"{source} is not a dataset folder: no such folder{where}; a source is "
                "\"synthetic\", a local folder, or a hub dataset id owner/name")
    return None


def refuse_images(vision: bool, model_path: str, dc) -> None:
    """A dataset with images (`[data]` dc) for a text-only model (not `vision`): ModelError."""
    if not vision and (dc.source == "synthetic" or (dc.images_column and
                                                    dc.source not in SYNTHETIC)):
        raise ModelError(f"model.path={model_path} is a text-only model: the dataset's images have "
                         "nowhere to go; use a text-only set (data.images_column = \"\", or "
                         f"data.source = \"synthetic-text\"), got data.source={dc.source!r}, "
                         f"data.images_column={dc.images_column!r}")


def load_problems(source: str, split: str, *, seed: int, n_synthetic: int, image_size: int,
                  prompt_len: Callable[[Problem], int], max_prompt_len: int,
                  columns: Mapping[str, str] | None = None) -> tuple[list[Problem], int]:
    """(problems, skipped count) of one split: bad rows and prompts longer than `max_prompt_len`
    (by `prompt_len`, image tokens counted) are skipped. Prompts are never truncated: the image
    tokens would be cut."""
    rows, skipped = load_split(source, split, seed=seed, n_synthetic=n_synthetic,
                               image_size=image_size, columns=columns)
    rows, more = skip_bad_rows(rows, is_too_long=lambda p: prompt_len(p) > max_prompt_len)
    if not rows:
        long = sum(why == "too long" for _, why in more)
        raise ValueError(f"data.source: no usable rows in split {split!r} of {source} "
                         f"({len(skipped) + len(more)} skipped: {len(skipped) + len(more) - long} "
                         f"bad rows, {long} prompts longer than data.max_prompt_len)")
    return rows, len(skipped) + len(more)


def step_problems(problems: list, step: int, per_step: int, seed: int) -> list:
    """The problems of `step`: an endless stream of per-epoch shuffles, seeded (so the data
    position of a resumed run is the step itself)."""
    out = []
    for i in range(step * per_step, (step + 1) * per_step):
        epoch, pos = divmod(i, len(problems))
        order = list(range(len(problems)))
        random.Random(seed * 100_003 + epoch).shuffle(order)
        out.append(problems[order[pos]])
    return out


if __name__ == "__main__":
    import synthetic
    synthetic.main(["--write" if a == "--write-synthetic" else a for a in sys.argv[1:]])
