"""Datasets and prompts: Geometry3K (local folder or hub id), the synthetic sets, several sources
mixed by weight (`data.sources`: :class:`Mixture`), the step stream.

Every split is a list of `Problem`. A bad row (missing or unreadable image, empty problem or
answer, a JSONL line that is not UTF-8, images and `<image>` markers that disagree) is dropped
and reported as (index, reason); a schema problem (missing split file or column, a JSONL line
that is not an object) is a ValueError naming the file. The accepted layouts: docs/data.md.

CLI (kept for compatibility; see synthetic.py): python data.py --write-synthetic DIR [...]
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import random
import re
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple

from PIL import Image

# the record and the split names live in synthetic.py, the lower module (data -> synthetic)
from config import DEFAULT_TEMPLATE, DataConfig
from errors import ConfigError, ModelError
from synthetic import IMAGE_MARKER, SPLITS, SYNTHETIC, Problem, _pyarrow, synthetic_split

log = logging.getLogger("data")

COLUMNS = ("images", "problem", "answer")  # the canonical names; `columns=` maps a dataset's own
#                                           ("images": "" = a text-only set)


def user_text(problem: Problem, template: str = DEFAULT_TEMPLATE) -> str:
    """The user turn: `template` with {problem} filled in (with the problem's `<image>` markers,
    where it has any: inputs.prompt_ids puts each image there), and {options}, where the template
    has it, with the row's `options` column (:func:`options_text`)."""
    if "{problem}" not in template:
        raise ValueError(f"prompt template has no {{problem}} placeholder: {template!r}")
    # replace, not str.format: templates such as "... in \boxed{}" carry literal braces.
    if "{options}" in template:
        template = template.replace("{options}", options_text(problem.columns.get("options")))
    return template.replace("{problem}", problem.raw or problem.problem)


def options_text(options: Any) -> str:
    """A row's list of answer options (MathVision's `options` column) as MathVista's queries
    write theirs ("\nChoices:\n(A) 3/11\n(B) 8/11"); "" for none (a free-form question)."""
    if not isinstance(options, (list, tuple)) or not options:
        return ""
    return "\nChoices:\n" + "\n".join(f"({chr(65 + i)}) {o}" for i, o in enumerate(options))


# ---------------------------------------------------------------- loading and bad rows
class _BadRow(Exception):
    pass


def _open_image(obj: Any) -> Image.Image:
    """An RGB copy of one `images` entry: PIL image, {"bytes", "path"} dict, or path string."""
    src = obj  # a PIL image, or what Image.open reads: a path or the bytes
    if isinstance(obj, Mapping) and isinstance(obj.get("bytes"), (bytes, bytearray)):
        src = io.BytesIO(bytes(obj["bytes"]))
    elif isinstance(obj, Mapping) and isinstance(obj.get("path"), str):
        src = obj["path"]
    elif not isinstance(obj, (Image.Image, str)):
        raise _BadRow(f"image is {type(obj).__name__}, not an image")
    if isinstance(src, str) and not Path(src).is_file():
        raise _BadRow(f"missing image file {src}")
    try:  # decoders raise many types (OSError, SyntaxError, ValueError, ...) on corrupt input
        if isinstance(src, Image.Image):
            return src.convert("RGB")
        with Image.open(src) as im:
            im.load()
            return im.convert("RGB")
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
    lead = re.sub(rf"^(?:{re.escape(IMAGE_MARKER)}|\s)+", "", problem)
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


def _missing(where: str, have: Iterable[str], cols: dict[str, str], key: str = "data") -> None:
    have = list(have)
    for canon in ("problem", "answer", "images"):
        name = cols.get(canon)
        if name is not None and name not in have:
            named = f" ({key}.{canon}_column)" if name != canon or canon == "images" else ""
            raise ValueError(f"{where}: missing column {name!r}{named}; has {sorted(have)}")


def _canonical(row: Mapping, cols: dict[str, str]) -> dict:
    """The row under the canonical names, plus every other column as it is."""
    mapped = set(cols.values())
    return {**{k: v for k, v in row.items() if k not in mapped and k not in COLUMNS},
            **{canon: row[name] for canon, name in cols.items()}}


def _read_jsonl(path: Path, cols: dict[str, str], key: str) -> Iterator[dict | _BadRow]:
    # split as bytes, decoded per line: a line that is not UTF-8 is one bad row, and a U+2028
    # inside a JSON string (where str.splitlines() would cut) stays in its row
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
        _missing(f"{path}:{n}", row, cols, key)
        row = _canonical(row, cols)
        images = row.get("images", [])
        if isinstance(images, str):
            images = [images]
        if isinstance(images, list):  # image paths are relative to the jsonl's folder
            row["images"] = [str(path.parent / i) if isinstance(i, str) else i for i in images]
        yield row


def _read_parquet(paths: list[Path], cols: dict[str, str], key: str) -> Iterator[dict]:
    pa, pq = _pyarrow()
    for path in paths:
        try:
            table = pq.read_table(path)
        except Exception as e:
            raise ValueError(f"{path}: not a readable parquet file ({type(e).__name__})") from None
        _missing(str(path), table.column_names, cols, key)
        for row in table.to_pylist():
            yield _canonical(row, cols)


def _read_hub(name: str, split: str, cols: dict[str, str], key: str) -> Iterator[dict]:
    try:
        import datasets
    except ImportError:
        raise ImportError(f"loading {name!r} needs `pip install datasets`; or pass a local folder") from None
    ds = datasets.load_dataset(name, split=split)
    _missing(f"{name} [{split}]", ds.column_names, cols, key)
    return (_canonical(row, cols) for row in ds)


def load_split(
    source: str, split: str, *, seed: int = 0, n_synthetic: int = 256, image_size: int = 112,
    columns: Mapping[str, str] | None = None, key: str = "data",
) -> tuple[list[Problem], list[tuple[int, str]]]:
    """(problems, skipped) for one split of "synthetic", a local folder, or a hub id. `columns`
    maps the canonical names ("problem", "answer", "images") to the dataset's own ("images": ""
    for a text-only set); a missing mapped column is a ValueError naming the file and column.
    `key`: where the source is configured, for messages ("data", or "data.sources[i]")."""
    if source in SYNTHETIC:
        return synthetic_split(split, seed=seed, n=n_synthetic, image_size=image_size,
                               text=source == "synthetic-text"), []
    root = Path(source).expanduser()
    # canonical name -> the dataset's own (identity where not mapped; images mapped to "": left out)
    cols = {c: name for c in COLUMNS if (name := (columns or {}).get(c, c))}
    if root.is_dir():
        files = _split_files(root, split)
        rows = (_read_jsonl(files[0], cols, key) if files[0].suffix == ".jsonl"
                else _read_parquet(files, cols, key))
        kept, skipped = skip_bad_rows(rows)
        if not kept and not skipped:  # not a max_prompt_len matter: there is nothing to read
            raise ValueError(f"{key}.source: {' + '.join(map(str, files))} is empty (no rows in "
                             f"split {split!r})")
        return kept, skipped
    problem = source_problem(source)
    if problem:
        raise ValueError(f"{key}.source: {problem}")
    return skip_bad_rows(_read_hub(source, split, cols, key))


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# First components that name a local folder, not a hub owner: `data/g3k` typed in another
# working directory is a folder that is missing there, not a dataset to download.
_LOCAL_FIRST = {"data", "dataset", "datasets", "runs", "out", "output", "outputs", "tmp", "home",
                "mnt", "scratch", "work", "local", "shared"}


def check_source(source: str, key: str = "data") -> None:
    """`<key>.source` can be read (:func:`source_problem`), else a ConfigError naming the key."""
    problem = source_problem(source)
    if problem:
        raise ConfigError(f"{key}.source: {problem}")


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


def refuse_images(vision: bool, model_path: str, dc: DataConfig) -> None:
    """A dataset with images (any source of `[data]` dc) for a text-only model (not `vision`):
    ModelError naming the source's keys."""
    for src in sources(dc):
        key, images = src.key, src.columns["images"]
        if not vision and (src.source == "synthetic" or (images and src.source not in SYNTHETIC)):
            raise ModelError(f"model.path={model_path} is a text-only model: the dataset's images "
                             f"have nowhere to go; use a text-only set ({key}.images_column = \"\", "
                             f"or {key}.source = \"synthetic-text\"), got {key}.source="
                             f"{src.source!r}, {key}.images_column={images!r}")


def load_problems(source: str, split: str, *, seed: int, n_synthetic: int, image_size: int,
                  prompt_len: Callable[[Problem], int], max_prompt_len: int,
                  columns: Mapping[str, str] | None = None,
                  key: str = "data", prepare: Callable[[Problem], Problem] | None = None,
                  ) -> tuple[list[Problem], int]:
    """(problems, skipped count) of one split: bad rows and prompts longer than `max_prompt_len`
    (by `prompt_len`, image tokens counted) are skipped. Prompts are never truncated: the image
    tokens would be cut. `key`: as :func:`load_split`'s; `prepare`: applied to each row first
    (:func:`prepare_problem`)."""
    rows, skipped = load_split(source, split, seed=seed, n_synthetic=n_synthetic,
                               image_size=image_size, columns=columns, key=key)
    rows = [prepare(p) for p in rows] if prepare is not None else rows
    rows, more = skip_bad_rows(rows, is_too_long=lambda p: prompt_len(p) > max_prompt_len)
    if not rows:
        long = sum(why == "too long" for _, why in more)
        raise ValueError(f"{key}.source: no usable rows in split {split!r} of {source} "
                         f"({len(skipped) + len(more)} skipped: {len(skipped) + len(more) - long} "
                         f"bad rows, {long} prompts longer than data.max_prompt_len)")
    return rows, len(skipped) + len(more)


# ---------------------------------------------------------------- a recipe's preprocessing
def center_crop(image: Image.Image, side: int) -> Image.Image:
    """`image` cut to side x side about its centre, padded with black (0) where it is smaller: a
    torchvision `CenterCrop(side)` (pad left/top (side - w) // 2, right/bottom the rest; then the
    crop at round((w - side) / 2), round((h - side) / 2))."""
    w, h = image.size
    if (w, h) == (side, side):
        return image
    if w < side or h < side:
        canvas = Image.new(image.mode, (max(w, side), max(h, side)))         # black
        canvas.paste(image, ((side - w) // 2 if side > w else 0, (side - h) // 2 if side > h else 0))
        image, (w, h) = canvas, canvas.size
    left, top = int(round((w - side) / 2.0)), int(round((h - side) / 2.0))
    return image.crop((left, top, left + side, top + side))


def crop_image(image: Image.Image, side: int) -> Image.Image:
    """data.image_crop: :func:`center_crop`, then JPEG re-encoded (PIL's default quality) and
    decoded, as AReaL's `convert_image(image, side, side)` (areal/dataset/geometry3k.py:19-39 at
    524d1d90f; it converts to RGB after the crop, this loader's images are RGB already)."""
    with io.BytesIO() as buf:
        center_crop(image, side).convert("RGB").save(buf, format="JPEG")
        buf.seek(0)
        with Image.open(buf) as out:
            return out.convert("RGB")


def prepare_problem(p: Problem, dc) -> Problem:
    """`[data]` dc's data.delete_text (each string deleted from the question, as AReaL's
    `.replace("different", "")`, areal/dataset/geometry3k.py:150-152) and data.image_crop."""
    problem, raw = p.problem, p.raw
    for text in dc.delete_text:
        problem, raw = problem.replace(text, ""), raw.replace(text, "")
    images = [crop_image(im, dc.image_crop) for im in p.images] if dc.image_crop else p.images
    return dataclasses.replace(p, problem=problem, raw=raw, images=images)


# ---------------------------------------------------------------- several sources (data.sources)
SOURCE_KEYS = ("name", "source", "weight", "problem_column", "answer_column", "images_column",
               "reward_functions", "splits", "env_args")  # the keys of one data.sources entry (docs/data.md, Mixing)


class Source(NamedTuple):
    """One configured dataset: data.source (name "") or one data.sources entry."""
    key: str                # where it is configured, for messages: "data" or "data.sources[i]"
    name: str               # its data.sources name ("" for data.source)
    source: str             # "synthetic", "synthetic-text", a local folder or a hub id
    weight: float           # its share of the prompts, relative to the other sources'
    columns: dict           # canonical name -> the dataset's own (load_split's `columns`)
    functions: list | None  # its own reward_functions (None: [reward] / [eval] functions)
    splits: dict | None = None  # a split's name in the run (eval.split) -> its name in this dataset


def sources(dc: DataConfig) -> list[Source]:
    """The sources of `[data]` (dc): data.sources' entries (their column keys defaulting to
    `[data]`'s), else data.source alone."""
    base = {"problem": dc.problem_column, "answer": dc.answer_column, "images": dc.images_column}
    if not dc.sources:
        return [Source("data", "", dc.source, 1.0, base, None)]
    return [Source(f"data.sources[{i}]", e["name"], e["source"], float(e["weight"]),
                   {c: e.get(f"{c}_column", v) for c, v in base.items()}, e.get("reward_functions"),
                   dict(e.get("splits", {})))
            for i, e in enumerate(dc.sources)]


def own_functions(dc: DataConfig) -> dict[str, list]:
    """Source name -> its own reward functions, for the sources that have them (the `sources`
    of rewards.RewardRunner: their episodes are graded by these alone)."""
    return {s.name: s.functions for s in sources(dc) if s.functions is not None}


def check_sources(dc: DataConfig, check_functions: Callable[[str, list], None] | None = None) -> None:
    """data.source, or every data.sources entry (its keys, a unique name, a weight > 0, column
    names), names a dataset that can be read (:func:`source_problem`); else a one-line
    ConfigError naming the key. An entry's reward_functions (their form: config.validate) go to
    `check_functions(key, specs)` (train.py: rewards.check_functions, the registered names)."""
    if not dc.sources:
        if not dc.source:
            raise ConfigError("data.source is empty: name a dataset (\"synthetic\", a local folder, "
                              "a hub id) or list [[data.sources]]")
        return check_source(dc.source)
    seen: dict[str, int] = {}
    for i, e in enumerate(dc.sources):
        key = f"data.sources[{i}]"
        if not isinstance(e, dict):
            raise ConfigError(f"{key}: expected a table {{name, source, weight}}, got {e!r}")
        _check_entry(key, e, seen)
        seen[e["name"]] = i
        if check_functions is not None and "reward_functions" in e:
            check_functions(f"{key}.reward_functions", e["reward_functions"])
        check_source(e["source"], key)


def _check_entry(key: str, e: dict, seen: dict[str, int]) -> None:
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(f"{key}.{msg}")
    for k in e:
        need(k in SOURCE_KEYS, f"{k}: unknown key (known: {', '.join(SOURCE_KEYS)})")
    name, source, w = e.get("name"), e.get("source"), e.get("weight")
    need(isinstance(name, str) and re.fullmatch(r"[\w.-]+", name) is not None,
         f"name: expected a name of letters, digits, '_', '.' or '-' (it names the metrics "
         f"reward/<name>/mean ...), got {name!r}")
    need(name not in seen, f"name: {name!r} is data.sources[{seen.get(name)}]'s name too; each "
         "source needs its own")
    need(isinstance(source, str) and bool(source),
         f"source: expected a dataset (\"synthetic\", a local folder, a hub id), got {source!r}")
    need(type(w) in (int, float) and math.isfinite(w) and w > 0,
         f"weight must be a number > 0 (the source's share of the prompts, relative to the "
         f"others'), got {w!r}")
    for c in ("problem_column", "answer_column", "images_column"):
        need(c not in e or (isinstance(e[c], str) and bool(e[c] or c == "images_column")),
             f"{c} must name a column" + (" (\"\": a text-only set)" if c == "images_column"
                                          else "") + f", got {e.get(c)!r}")
    splits = e.get("splits", {})
    need(isinstance(splits, dict) and all(isinstance(k, str) and isinstance(v, str) and v
                                          for k, v in splits.items()),
         f"splits: expected a table of split names, run's = this dataset's (e.g. {{testmini = "
         f"\"test\"}}), got {splits!r}")


def load_sources(dc: DataConfig, split: str, *, seed: int, prompt_len: Callable[[Problem], int],
                 limit: int | None = None) -> tuple[list[Problem], int]:
    """(problems, skipped count) of `split` of every source of `[data]` (dc), in their order
    (:func:`load_problems` each; `limit`: the first `limit` of each). With data.sources every
    problem carries its source's name, and its index is made unique across the sources: its
    row's, plus the preceding sources' largest index + 1 (the trainers find images by index)."""
    out: list[Problem] = []
    skipped = offset = 0
    for src in sources(dc):
        own = (src.splits or {}).get(split, split)  # its `splits` name for the run's split
        rows, n = load_problems(src.source, own, seed=seed, n_synthetic=dc.n_synthetic,
                                image_size=dc.image_size, prompt_len=prompt_len,
                                max_prompt_len=dc.max_prompt_len, columns=src.columns, key=src.key,
                                prepare=(lambda p: prepare_problem(p, dc))
                                if dc.image_crop or dc.delete_text else None)
        skipped += n
        if src.name:
            top = max(p.index for p in rows) + 1
            rows = [dataclasses.replace(p, index=offset + p.index, source=src.name) for p in rows]
            offset += top
        out += rows[:limit] if limit is not None else rows
    return out, skipped


class Mixture:
    """The run's prompt stream, `step_problems(step)`: one source's is :func:`step_problems`.
    With data.sources every step holds a quota of each source (:func:`quotas`: its share of the
    step's prompts by largest remainder, the remainders carried to the next steps, so a source's
    share is exact over any window and within one prompt of exact in every step), the prompts'
    order within the step shuffled seeded by (seed, step); a source's prompts are the next ones
    of its own stream of seeded per-epoch shuffles. Where a source's stream stands at a step is
    the sum of its quotas before it, counted again (and kept), so a resumed run continues the
    same stream with nothing saved."""

    def __init__(self, problems: list[Problem], dc: DataConfig, per_step: int, seed: int):
        srcs = sources(dc)
        self.names = [s.name for s in srcs if s.name]  # [] for data.source alone
        self.problems, self.per_step, self.seed = problems, per_step, seed
        self.weights = [s.weight for s in srcs]
        self.pools = [[p for p in problems if p.source == s.name] for s in srcs]
        self.counts = [[0] * len(srcs)]  # counts[s][k]: source k's prompts before step s
        self.orders: dict[int, tuple[int, list[int]]] = {}  # source -> (epoch, its shuffle)
        self.lock = threading.Lock()     # the engine's worker thread draws too (pipeline.py)
        self.quotas: list[list[int]] = []  # quotas[s][k]: source k's prompts in step s
        self._quota_stream = quotas(self.weights, per_step)

    def draw(self, step: int) -> list[int]:
        """The source (its position in data.sources) of each prompt of `step`."""
        while len(self.quotas) <= step:
            self.quotas.append(next(self._quota_stream))
        order = [k for k, q in enumerate(self.quotas[step]) for _ in range(q)]
        random.Random(f"mix:{self.seed}:{step}").shuffle(order)
        return order

    def step_problems(self, step: int) -> list[Problem]:
        """The problems of `step`, in prompt order."""
        if not self.names:
            return step_problems(self.problems, step, self.per_step, self.seed)
        with self.lock:
            order = self.draw(step)  # every earlier step's quotas drawn too
            while len(self.counts) <= step:  # counts[s] = counts[s - 1] + quotas[s - 1]
                self.counts.append([c + q for c, q in zip(self.counts[-1], self.quotas[len(self.counts) - 1])])
            at, out = list(self.counts[step]), []
            for k in order:
                out.append(self._nth(k, at[k]))
                at[k] += 1
        return out

    def _nth(self, k: int, i: int) -> Problem:
        """Item `i` of source `k`'s stream (epoch after epoch, each its own seeded shuffle)."""
        pool = self.pools[k]
        epoch, pos = divmod(i, len(pool))
        if self.orders.get(k, (None,))[0] != epoch:
            order = list(range(len(pool)))
            random.Random(f"mix:{self.seed}:{self.names[k]}:{epoch}").shuffle(order)
            self.orders[k] = (epoch, order)
        return pool[self.orders[k][1][pos]]


def epoch_steps(n: int, per_step: int, ranks: int) -> int:
    """Steps an epoch of `n` problems as AReaL counts them (areal/utils/dataloader.py:25-42 at
    524d1d90f): a DistributedSampler with drop_last over its `ranks` data-parallel ranks, then
    batches of per_step // ranks with drop_last; 1 rank where per_step does not split (AReaL
    refuses that). Geometry3K's 2,101 problems, 32 a step, 4 ranks: 65. This loader's stream
    wraps epochs mid-step instead (:func:`step_problems`: n / per_step steps an epoch)."""
    d = ranks if per_step % ranks == 0 else 1
    return (n // d) // (per_step // d)


def epoch_line(n: int, per_step: int, ranks: int, steps: int) -> str:
    """The start-up line on epochs (train.start)."""
    k = epoch_steps(n, per_step, ranks)
    return (f"epochs: {k} steps an epoch of {n} problems at {per_step} a step (AReaL's drop_last count over "
            f"{ranks} trainer rank(s)); run.steps {steps} = {steps / max(k, 1):.2f} such epochs")


def quotas(weights: list[float], per_step: int) -> Iterator[list[int]]:
    """Each step's prompts per source, step after step: the step's ideal shares (per_step x
    weight / total) plus what earlier steps owe each source, apportioned by largest remainder
    (ties to the earlier source), never below 0. What a source got is then what it was owed to
    within one prompt, so over any run of steps its share is exact to one prompt (ROLL's
    per-step quota rounds down every step instead, so 0.7 / 0.3 of 4 prompts becomes 2 + 2)."""
    total = sum(weights)
    owed = [0.0] * len(weights)  # ideal minus given so far; sums to 0 (up to rounding)
    while True:
        want = [per_step * w / total + o for w, o in zip(weights, owed)]
        got = [max(0, math.floor(x)) for x in want]
        while sum(got) > per_step:  # only where a source owes more than a step's share
            got[max((k for k in range(len(got)) if got[k]), key=lambda k: got[k] - want[k])] -= 1
        by_remainder = sorted(range(len(want)), key=lambda k: (got[k] - want[k], k))
        for k in by_remainder[:per_step - sum(got)]:
            got[k] += 1
        owed = [x - g for x, g in zip(want, got)]
        yield got


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
