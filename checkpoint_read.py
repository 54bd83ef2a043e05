"""Reading a checkpoint folder without running its code: `state/meta.pt` as plain data, the
files the manifest lists checked against their sizes and CRC-32s. Why, and what still must be
trusted (DCP's `state/.metadata` is a pickle): docs/checkpoints.md, "What a checkpoint can run".
"""
from __future__ import annotations

import json
import pickle
import re
import zlib
from pathlib import Path

import torch

from errors import StartError, one_line

MANIFEST = "manifest.json"


class Refused(StartError):
    """A checkpoint whose `state/meta.pt` holds more than plain data: unpickling it would run
    code. Stops the run (never skipped for an older checkpoint: the run folder is suspect)."""


def read_meta(path: Path) -> dict:
    """`state/meta.pt` of checkpoint `path`, loaded as plain data only (`weights_only=True`:
    tensors, dicts, lists, numbers, strings; no code runs). An object of any other kind raises
    :class:`Refused`; a damaged file raises what torch raises."""
    try:
        meta = torch.load(Path(path) / "state" / "meta.pt", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only load failed" not in str(e).lower():
            raise
        what = re.search(r"GLOBAL (\S+)|Unsupported operand \S+", str(e))
        raise Refused(f"checkpoint {path} refused: state/meta.pt holds more than plain data "
                      f"({what.group(1) or what.group(0) if what else 'an object torch refuses'}), "
                      "and loading it would run code (docs/checkpoints.md, \"What a checkpoint "
                      "can run\")") from None
    if not isinstance(meta, dict):
        raise ValueError(f"a {type(meta).__name__}, not a dict")
    return meta


def eval_step(checkpoint: str | Path) -> int:
    """The step an `--eval-only` checkpoint was saved at (its `state/meta.pt`, read as plain
    data), -1 for an HF export without training state."""
    f = Path(checkpoint) / "state" / "meta.pt"
    return int(read_meta(Path(checkpoint))["step"]) if f.is_file() else -1


def eval_problem(folder: Path) -> str | None:
    """What `--eval-only` reads of checkpoint `folder` (`hf/`, `state/meta.pt`), checked before
    anything is built: against the manifest when there is one, and meta.pt as plain data."""
    try:
        listing = (json.loads((folder / MANIFEST).read_text())["files"]
                   if (folder / MANIFEST).is_file() else {})
        for name, (size, checksum) in sorted(listing.items()):
            if name.startswith("hf/") or name == "state/meta.pt":
                if bad := file_problem(folder, name, size, checksum):
                    return f"checkpoint {folder} is damaged: {bad}"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"checkpoint {folder} is damaged: {MANIFEST}: unreadable ({type(e).__name__})"
    try:
        eval_step(folder)
    except Refused as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - a damaged file raises anything
        return f"checkpoint {folder} is damaged: state/meta.pt: cannot be loaded ({one_line(e)})"
    return None


def file_problem(folder: Path, name: str, size: int, checksum: int) -> str | None:
    """File `name` of `folder` against its manifest entry: "hf/config.json: missing", or None."""
    p = folder / name
    if not p.is_file():
        return f"{name}: missing"
    if p.stat().st_size != size:
        return f"{name}: {p.stat().st_size} bytes, expected {size}"
    if crc(p) != checksum:
        return f"{name}: contents changed since the save (CRC-32 mismatch)"
    return None


def crc(path: Path) -> int:
    c = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            c = zlib.crc32(chunk, c)
    return c
