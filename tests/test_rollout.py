"""rollout.py: DAPO's refill (rollout_refilled) with a stand-in rollout, drawing more prompts
from the seeded refill stream (refill_problems) until enough groups have reward variance, or
stopping at its bound with the dropped groups filling the share; its metrics. Refill in a real
run: tests/test_presets_plan.py."""
from __future__ import annotations

from types import SimpleNamespace

import torch

import rollout as R
import episode as E
from loss import zero_variance_groups

F64 = torch.float64


# --------------------------------------------------------------------------- DAPO refill
G = 4


def _fake_rollout(calls, version=7):
    """rollout() stand-in (rollout_refilled's `roll`): problem p's group has reward variance iff
    p.index % 3 == 0; groups numbered from 0."""
    def fake(problems, *, seed):
        calls.append(([p.index for p in problems], seed))
        eps = []
        for g, p in enumerate(problems):
            for k in range(G):
                r = float(k % 2) if p.index % 3 == 0 else 0.5
                eps.append(E.Episode(p.index, g, [1], [2], [0.0], r, {}, version, False))
        return eps, {"generate_s": 1.0, "reward_s": 0.5, "prompts": len(problems), "refill_rounds": 0,
                     "reprefill_tokens": 2}
    return fake


def _problems(indices):
    return [SimpleNamespace(index=i) for i in indices]


def test_refill_keeps_drawing_until_enough_valid_groups():
    calls = []
    pool = _problems(range(60))
    mine = _problems([0, 1, 2, 4])          # only problem 0 has reward variance
    eps, st = R.rollout_refilled(_fake_rollout(calls), mine, G, seed=123,
                                 refill=R.Refill(pool, rounds=50), group_offset=8)
    assert len(eps) == 4 * G
    assert [e.group for e in eps] == [g for g in range(8, 12) for _ in range(G)]   # renumbered
    groups = [eps[i:i + G] for i in range(0, len(eps), G)]
    assert not zero_variance_groups(torch.tensor([e.reward for e in eps], dtype=F64), G).any()
    assert groups[0][0].index == 0                                   # round 0's valid group first
    assert st["refill_rounds"] == len(calls) - 1 >= 1
    assert st["prompts"] == 4 * len(calls) and st["generate_s"] == len(calls)
    # the extra rounds come from the seeded stream, with their own sampling seeds
    for rnd, (idx, seed) in enumerate(calls[1:], start=1):
        assert idx == [p.index for p in R.refill_problems(pool, 4, 123, rnd)]
        assert seed == 123 + rnd * 1_000_003
    assert calls[0] == ([0, 1, 2, 4], 123)
    # deterministic: the same call gives the same episodes
    calls2 = []
    eps2, _ = R.rollout_refilled(_fake_rollout(calls2), _problems([0, 1, 2, 4]), G, 123,
                                 R.Refill(pool, 50), 8)
    assert calls2 == calls and [(e.index, e.group) for e in eps2] == [(e.index, e.group) for e in eps]


def test_refill_stops_at_its_bound_and_fills_with_dropped_groups():
    calls = []
    pool = _problems([1, 2, 4, 5, 7, 8])       # no problem of the pool has reward variance
    eps, st = R.rollout_refilled(_fake_rollout(calls, 0), _problems([1, 3]), G,
                                 group_offset=0, seed=5, refill=R.Refill(pool, rounds=2))
    assert st["refill_rounds"] == 2 and len(calls) == 3 and st["prompts"] == 6
    # a full share: the valid group first, then the first dropped one (the trainer masks it)
    assert [e.index for e in eps] == [3] * G + [1] * G
    assert [e.group for e in eps] == [0] * G + [1] * G
    assert zero_variance_groups(torch.tensor([e.reward for e in eps], dtype=F64), G).tolist() == [False, True]
    # rounds = 0: exactly rollout()
    calls.clear()
    eps0, st0 = R.rollout_refilled(_fake_rollout(calls, 0), _problems([1, 3]), G,
                                   group_offset=4, seed=5, refill=R.Refill(pool, rounds=0))
    assert len(calls) == 1 and st0["refill_rounds"] == 0 and [e.group for e in eps0] == [4] * G + [5] * G
    assert [e.index for e in eps0] == [1] * G + [3] * G              # order kept, nothing moved


def test_refill_problems_stream():
    pool = _problems(range(100))
    a = R.refill_problems(pool, 10, 1, 1)
    assert [p.index for p in a] == [p.index for p in R.refill_problems(pool, 10, 1, 1)]
    assert len({p.index for p in a}) == 10                             # distinct
    assert [p.index for p in a] != [p.index for p in R.refill_problems(pool, 10, 1, 2)]
    assert [p.index for p in a] != [p.index for p in R.refill_problems(pool, 10, 2, 1)]
    assert len(R.refill_problems(pool[:3], 10, 1, 1)) == 3
    assert R.refill_metrics([{"refill_rounds": 2, "prompts": 12}, {"refill_rounds": 0, "prompts": 4}]) == \
        {"rollout/refill_rounds": 2, "rollout/prompts_drawn": 16, "rollout/reprefill_tokens": 0}
    assert R.refill_metrics([{"refill_rounds": 0, "prompts": 4, "reprefill_tokens": 30},
                             {"refill_rounds": 0, "prompts": 4, "reprefill_tokens": 12}])["rollout/reprefill_tokens"] == 42


def test_a_source_without_episodes_this_step_logs_frac_zero_and_no_mean():
    """data.sources' per-step metrics: every source's `data/<name>/frac` in every step (0.0 for
    one with no episodes), `reward/<name>/mean` left out for it (docs/metrics.md), and
    launch/plot.py's series skips the steps that lack it."""
    import importlib.util
    import pathlib
    eps = [E.Episode(0, 0, [1], [2], [0.0], r, {}, 0, False, source="geo") for r in (1.0, 0.0)]
    m = R.episode_metrics(eps, [{"generate_s": 1.0, "reward_s": 0.0, "prompts": 1, "refill_rounds": 0}],
                          0, ["geo", "txt"])
    assert m["data/geo/frac"] == 1.0 and m["data/txt/frac"] == 0.0
    assert m["reward/geo/mean"] == 0.5 and "reward/txt/mean" not in m
    path = pathlib.Path(__file__).parents[1] / "launch" / "plot.py"
    spec = importlib.util.spec_from_file_location("plot", path)
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    rows = [{"step": 0, **m}, {"step": 1, "reward/txt/mean": 0.25, "data/txt/frac": 0.5}]
    assert plot.series(rows, "reward/txt/mean") == ([1], [0.25])
    assert plot.series(rows, "data/txt/frac") == ([0, 1], [0.0, 0.5])
