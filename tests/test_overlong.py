"""DAPO's soft overlong punishment against hand-computed values and verl's buffer formula."""
from __future__ import annotations

import pytest

from rewards import REGISTRY
from rewards.overlong import overlong_penalty


def _p(length: int, max_new_tokens: int = 10, **kw) -> float:
    out = overlong_penalty("any text", {"response_len": length, "max_new_tokens": max_new_tokens}, **kw)
    assert out["overlong"] == out["reward"] and set(out) == {"reward", "overlong"}
    return out["reward"]


def test_registered():
    assert REGISTRY["overlong"] is overlong_penalty


@pytest.mark.parametrize("length, expect", [
    (0, 0.0), (6, 0.0),          # L <= L_max - L_cache = 10 - 4 = 6: no penalty
    (7, -0.25),                  # (6 - 7) / 4
    (8, -0.5), (9, -0.75),
    (10, -1.0),                  # L = L_max: (6 - 10) / 4
    (11, -1.0), (50, -1.0),      # L > L_max: flat -1 (paper)
])
def test_hand_values(length, expect):
    # max_len 10 below a generation limit of 100, so the L > L_max branch is reachable
    assert _p(length, max_new_tokens=100, max_len=10, buffer=4) == pytest.approx(expect, abs=1e-15)


def test_defaults_and_factor():
    # max_len defaults to the generation limit
    assert _p(9, max_new_tokens=10, buffer=4) == pytest.approx(-0.75)
    assert _p(9, max_new_tokens=12, buffer=4) == pytest.approx(-0.25)      # (8 - 9) / 4
    assert _p(9, max_new_tokens=10, buffer=4, penalty_factor=0.5) == pytest.approx(-0.375)
    assert _p(11, max_new_tokens=20, max_len=10, buffer=4, penalty_factor=0.5) == pytest.approx(-0.5)
    # buffer 0: a hard cut at max_len
    assert _p(10, max_new_tokens=20, max_len=10) == 0.0
    assert _p(11, max_new_tokens=20, max_len=10) == -1.0
    # buffer = max_len: linear from length 0
    assert _p(5, max_len=10, buffer=10) == pytest.approx(-0.5)


@pytest.mark.parametrize("max_resp_len, buffer, factor", [(16, 4, 1.0), (20480, 4096, 1.0), (30, 7, 0.3)])
def test_matches_verl_inside_generation_limit(max_resp_len, buffer, factor):
    # verl reward_manager/dapo.py: min(-(L - (max_resp_len - buffer)) / buffer * factor, 0), L <= max_resp_len
    for length in range(0, max_resp_len + 1, max(1, max_resp_len // 97)):
        verl = min(-(length - (max_resp_len - buffer)) / buffer * factor, 0)
        got = _p(length, max_new_tokens=max_resp_len, buffer=buffer, penalty_factor=factor)
        assert got == pytest.approx(verl, abs=1e-12)


@pytest.mark.parametrize("kw", [dict(buffer=11), dict(buffer=-1), dict(max_len=0)])
def test_bad_params(kw):
    with pytest.raises(ValueError):
        _p(5, **kw)
