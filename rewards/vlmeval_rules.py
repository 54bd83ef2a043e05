"""Judge-free graders for the seed's out-of-domain sets: ``mathvista``, ``mathvision``,
``logicvista`` (eval.functions, or a data.sources entry's own reward_functions).

VLMEvalKit (open-compass/VLMEvalKit e8e78f05f, ``vlmeval/dataset/utils/mathvista.py``,
``mathv.py``, ``logicvista.py``, ``vlmeval/utils/matching_util.py``) scores these sets in two
steps: an LLM judge (gpt-4o-mini) EXTRACTS the answer from the response, then rules decide
whether it is right. Here the second step is VLMEvalKit's rules, reimplemented; the first is a
fixed rule standing in for the judge (:func:`extract`): the last complete ``\\boxed{...}``, else
the rest of the line after the last "answer is" / "Answer:", else the whole response. Where
VLMEvalKit tries rules on the raw response before it asks the judge ("prefetch": MathVista and
MathVision), so does this. So a response that states its answer plainly scores as it would with
the judge; one whose answer only a reader can find (a letter in a sentence, a number in prose)
can differ, in either direction. docs/evaluation.md says by how much it can differ.

Rules, per set (each reads the row's columns in its hub layout, ``sample["columns"]``):
- **mathvista** (AI4Math/MathVista: ``question_type``, ``answer_type``, ``choices``; gold =
  ``answer``, for multiple choice the text of the right choice). Multiple choice: the letter
  VLMEvalKit's ``can_infer`` reads from the response (prefetch; it may read "Z", which is
  wrong), else from the extracted answer, must be the gold choice's letter. ``integer`` /
  ``float``: the response, or else the extracted answer, read by Python's ``int()`` / ``float()``
  equals the gold read alike (exactly). Any other free-form type (``list``, ``text``) is never
  right: VLMEvalKit compares ``str(None)`` with the gold there (its rule, kept).
- **mathvision** (MathLLMs/MathVision: ``options``; gold = ``answer``, a letter when there are
  options). With options: the letter ``can_infer`` reads (prefetch, else from the extracted
  answer) equals the gold letter, case-blind. Without: the response, or else the extracted
  answer, equals the gold by VLMEvalKit's ``is_equal``: the same text (lower case, stripped), or
  both read as numbers within 1e-6. VLMEvalKit reads numbers with Python's ``eval`` and
  latex2sympy; here with the project's exact parser (rewards/_mathparse.py: integers,
  decimals, ``a/b``, ``\\frac``, ``\\sqrt``, ``\\pi``, powers), no ``eval``.
- **logicvista** (gold ``"A, C"``: one or several letters). VLMEvalKit's judge answers with the
  letters the response chose and a hit is the same set of letters; it has no prefetch. Here the
  letters are those of the extracted answer when it is only letters (``"A, C"``, ``"(B)"``,
  ``"BD"``), else the one letter A-H that ``can_infer``'s option rule reads from the whole
  response.

Each returns ``{"reward": a, "accuracy": a}`` (a in {0, 1}) and ``info["read"]``: what was read.
Bounded work, never raises on a response: texts are scanned once; numbers go through the capped
parser.
"""
from __future__ import annotations

import re
from typing import Any

from rewards import register
from rewards._mathparse import parse

MAX_SCAN = 4000  # characters scanned for a \boxed{...} closing brace

_BOX = "\\boxed{"
_ANSWER_IS = re.compile(r"(?:answer\s+is|answer\s*:)\s*(.*)", re.IGNORECASE)


# ---- The judge's stand-in

def _last_box(text: str) -> str | None:
    start = text.rfind(_BOX)
    if start < 0:
        return None
    depth, body = 0, text[start + len(_BOX):start + len(_BOX) + MAX_SCAN]
    for i, ch in enumerate(body):
        depth += (ch == "{") - (ch == "}")
        if depth < 0:
            return body[:i].strip()
    return None


def extract(response: str) -> str:
    """The answer a reader would take: the last complete ``\\boxed{}``, else what follows the last
    "answer is" / "Answer:" on its line (a trailing period and ``$`` / ``**`` wrappers dropped),
    else the whole response, stripped."""
    box = _last_box(response)
    if box is not None:
        return box
    found = None
    for found in _ANSWER_IS.finditer(response):
        pass
    if found is None:
        return response.strip()
    line = found.group(1).split("\n", 1)[0].strip().strip("*$ ").rstrip(".").strip("*$ ")
    return line


# ---- VLMEvalKit's option matching (vlmeval/utils/matching_util.py: can_infer), restated

_REFUSALS = ("Sorry, I can't help with images of people yet.", "I can't process this file.",
             "I'm sorry, but without the image provided", "Cannot determine the answer")
_VERBOSE = re.compile(r"(?i)(?:correct\s+)?answer\s+is\s+\**([ABCD])\**")
_PUNCT = str.maketrans({c: " " for c in ".()[],:;!*#{}"})


def _option(answer: str, choices: dict[str, str]) -> str | None:
    """A letter that stands alone near the end of `answer`, "Z" for a refusal or a lone Z."""
    if "Failed to obtain answer via API" in answer:
        return None
    if any(r in answer for r in _REFUSALS):
        return "Z"
    words = answer.translate(_PUNCT).split()
    present = [c for c in choices if c in words]
    if len(present) == 1 and words.index(present[0]) > len(words) - 5:
        return present[0]
    if not present and words.count("Z") == 1:
        return "Z"
    m = _VERBOSE.search(answer)
    return m.group(1).upper() if m and m.group(1).upper() in choices else None


def _option_text(answer: str, choices: dict[str, str]) -> str | None:
    """The one choice whose text the (short) answer contains."""
    answer = answer.lower()
    if len(answer) > 2 * sum(len(v) for v in choices.values()):
        return None
    hits = [k for k, v in choices.items() if v.lower() in answer]
    return hits[0] if len(hits) == 1 else None


def can_infer(answer: str, choices: dict[str, str]) -> str | None:
    """VLMEvalKit's ``can_infer``: the letter (or "Z") `answer` picks among `choices`."""
    answer = str(answer)
    return _option(answer, choices) or _option_text(answer, choices)


def _letters(options: Any) -> dict[str, str]:
    return {chr(65 + i): str(v) for i, v in enumerate(list(options or []))}


def _pick(response: str, choices: dict[str, str]) -> str | None:
    """Prefetch on the raw response, else the extracted answer (the judge's place)."""
    return can_infer(response, choices) or can_infer(extract(response), choices)


# ---- Numbers

def _number(text: str) -> float | None:
    text = str(text).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").strip("$ ")
    try:
        return parse(text).value()
    except Exception:  # noqa: BLE001 - anything the capped parser does not read is no number
        return None


def is_equal(answer: Any, gold: Any) -> bool:
    """MathVision's ``is_equal``: the same text (lower case, stripped) or the same number."""
    a, g = str(answer).lower().strip(), str(gold).lower().strip()
    if a == g:
        return True
    x, y = _number(a), _number(g)
    return x is not None and y is not None and abs(x - y) < 1e-6


def _same_typed(text: str, gold: str, kind: type) -> bool:
    try:
        return kind(text) == kind(gold)
    except (TypeError, ValueError, OverflowError):
        return False


def _result(ok: bool, read: Any) -> dict:
    a = 1.0 if ok else 0.0
    return {"reward": a, "accuracy": a, "info": {"read": "" if read is None else str(read)[:200]}}


# ---- The three sets

@register("mathvista")
def mathvista(response: str, sample: dict) -> dict:
    """MathVista (testmini) as VLMEvalKit's MathVista post_check, with :func:`extract` as the
    judge (module docstring)."""
    cols, gold = sample.get("columns", {}), sample["answer"]
    if cols.get("question_type") == "multi_choice":
        choices = _letters(cols.get("choices"))
        want = next((k for k, v in choices.items() if v == gold), None)
        got = _pick(response, choices)
        return _result(got is not None and got == want, got)
    kind = {"integer": int, "float": float}.get(cols.get("answer_type"))
    if kind is None:  # VLMEvalKit: str(None) == answer
        return _result(gold == "None", None)
    for text in (response, extract(response)):
        if _same_typed(text, gold, kind):
            return _result(True, text)
    return _result(False, extract(response))


@register("mathvision")
def mathvision(response: str, sample: dict) -> dict:
    """MATH-Vision (testmini) as VLMEvalKit's MathVision post_check, with :func:`extract` as
    the judge (module docstring)."""
    choices, gold = _letters(sample.get("columns", {}).get("options")), sample["answer"]
    if choices:
        got = _pick(response, choices)
        return _result(got is not None and is_equal(got, gold), got)
    for text in (response, extract(response)):
        if is_equal(text, gold):
            return _result(True, text)
    return _result(False, extract(response))


_ONLY_LETTERS = re.compile(r"[\s,()\[\].]*(?:[A-Z](?:[\s,()\[\].]|\band\b)*)+")


@register("logicvista")
def logicvista(response: str, sample: dict) -> dict:
    """LogicVista as VLMEvalKit's LogicVista_auxeval: the chosen letters, as a set, equal the
    gold's (module docstring)."""
    want = sorted(x.strip().lower() for x in sample["answer"].split(","))
    said = extract(response)
    if _ONLY_LETTERS.fullmatch(said):
        got = re.findall(r"[A-Z]", said)
    else:  # a letter standing alone near the end (VLMEvalKit's option rule; no text to match);
        # A-H: LogicVista's options, without the pronoun "I"
        one = _option(response, _letters("ABCDEFGH"))
        got = [one] if one else []
    ok = bool(got) and "Z" not in got and sorted(x.lower() for x in got) == want
    return _result(ok, "".join(got))
