"""RewardRunner: a step's responses scored at once; failing, hanging and NaN rewards contained.

Timing checks use wide margins (a loaded 2-core machine): the old per-sample behaviour waits
timeout_s once per sample, here a step waits about timeout_s once.
"""
import logging
import subprocess
import sys
import threading
import time

import pytest

import rewards
from tests.util import ROOT

rewards.names()  # import the built-in rewards now, not inside a timed call


@rewards.register("_tr_hang")
def _hang(response, sample):
    sample.get("calls", []).append(1)
    sample["gate"].wait()       # until the test's teardown opens the gate
    return {"reward": 1.0}


@rewards.register("_tr_hang_if")
def _hang_if(response, sample):
    if sample.get("hang"):
        sample["gate"].wait()
    return {"reward": 0.5, "ok": 1.0}


@rewards.register("_tr_raise_value")
def _raise_value(response, sample):
    raise ValueError(f"bad answer {sample['index']}\nsecond line")


@rewards.register("_tr_raise_zero")
def _raise_zero(response, sample):
    return {"reward": 1 / 0}


@rewards.register("_tr_returns")
def _returns(response, sample):
    return sample["ret"]


@rewards.register("_tr_sleep")
def _sleep(response, sample):
    time.sleep(sample["sleep"])
    return {"reward": 1.0, "slept": 1.0}


@pytest.fixture
def gate():
    ev = threading.Event()
    yield ev
    ev.set()    # releases the threads the test's hung calls hold


@pytest.fixture
def make_runner():
    made = []

    def make(*a, **kw):
        made.append(rewards.RewardRunner(*a, **kw))
        return made[-1]
    yield make
    for r in made:
        r.close()


def batch(n, **extra):
    return ["r"] * n, [dict(index=i, response_len=3, **extra) for i in range(n)]


def old_score(response, sample, functions):
    """The pre-runner rewards.score() for functions that behave (serial, no threads)."""
    out = {"reward": 0.0, "errors": 0.0}
    for spec in functions:
        params = {k: v for k, v in spec.items() if k not in ("name", "weight")}
        parts = rewards.get(spec["name"])(response, sample, **params)
        total = float(parts["reward"])
        out["reward"] += float(spec.get("weight", 1.0)) * total
        for k, v in parts.items():
            if k != "reward":
                out[k] = out.get(k, 0.0) + float(v)
    return out


GOOD = [{"name": "geometry", "weight": 1.3},
        {"name": "target_fraction", "weight": 0.7, "target": "a"},
        {"name": "overlong", "weight": 0.1, "buffer": 4},
        {"name": "target_fraction", "weight": 1.0 / 3.0, "target": "b"}]


def test_well_behaved_functions_give_the_old_results_bit_for_bit(make_runner):
    texts = ["<think>ab</think><answer>\\frac{40}{3}</answer>", "aab \\boxed{13.33}", "bbb",
             "The answer is 5 cm.", "", "a" * 7 + "<answer>6\\sqrt{2}</answer>"]
    golds = ["\\frac { 40 } { 3 }", "\\frac { 40 } { 3 }", "5", "5", "2", "\\sqrt { 72 }"]
    samples = [{"answer": g, "index": i, "response_len": 3 + 2 * i, "truncated": False,
                "max_new_tokens": 10} for i, g in enumerate(golds)]
    want = [old_score(t, s, GOOD) for t, s in zip(texts, samples)]
    got = make_runner(GOOD, timeout_s=5.0).score(texts, samples)
    assert [list(d.items()) for d in got] == [list(d.items()) for d in want]   # keys, order, floats
    assert {d["accuracy"] for d in got} == {0.0, 1.0}                          # a real mix
    assert rewards.score(texts[0], samples[0], GOOD) == want[0]               # the one-off API


def test_first_failure_of_each_function_logged_once_every_one_counted(make_runner, caplog):
    fns = [{"name": "_tr_raise_value"}, {"name": "target_fraction", "target": "r"},
           {"name": "_tr_raise_zero"}, {"name": "_tr_returns"}]
    runner = make_runner(fns, timeout_s=5.0)
    with caplog.at_level(logging.WARNING, logger="rewards"):
        for _ in range(3):
            out = runner.score(*batch(4, ret=[1.0]))
            assert [d["errors"] for d in out] == [3.0] * 4
            assert [d["reward"] for d in out] == [1 / 3] * 4   # the working function only
    lines = [r.getMessage() for r in caplog.records if r.name == "rewards"]
    assert len(lines) == 3, lines
    by_fn = {name: [m for m in lines if f"'{name}'" in m]
             for name in ("_tr_raise_value", "_tr_raise_zero", "_tr_returns")}
    assert all(len(v) == 1 for v in by_fn.values()), by_fn
    assert "ValueError: bad answer 0 second line" in by_fn["_tr_raise_value"][0]  # the first one
    assert "ZeroDivisionError: division by zero" in by_fn["_tr_raise_zero"][0]
    assert "TypeError: returned list" in by_fn["_tr_returns"][0]
    assert all("\n" not in m for m in lines)


@pytest.mark.parametrize("ret", [
    {"reward": float("nan")}, {"reward": float("inf")}, {"reward": 1.0, "part": float("-inf")},
    {"reward": 1.0, "part": float("nan")}, 1.0, None, {"score": 1.0}, {"reward": "1.0"},
    {"reward": [1.0]}, {"reward": 1.0, "part": "x"}, {"reward": 1.0, 3: 1.0}])
def test_non_finite_or_malformed_results_are_errors_scoring_zero(make_runner, ret):
    fns = [{"name": "target_fraction", "target": "r"}, {"name": "_tr_returns", "weight": 2.0}]
    out = make_runner(fns, timeout_s=5.0).score(*batch(3, ret=ret))
    assert out == [{"reward": 1 / 3, "errors": 1.0, "target_fraction": 1 / 3}] * 3


def test_a_hung_function_costs_a_step_about_timeout_s_not_per_sample(make_runner, gate):
    runner = make_runner([{"name": "_tr_hang"}], timeout_s=0.3, max_consecutive_timeouts=0)
    for _ in range(2):   # the second step finds every worker still held by a hung call
        t0 = time.monotonic()
        out = runner.score(*batch(16, gate=gate))
        dt = time.monotonic() - t0
        assert dt < 2.0, f"{dt:.2f} s for 16 samples (per-sample waits: 16 x 0.3 = 4.8 s)"
        assert out == [{"reward": 0.0, "errors": 1.0}] * 16


def test_a_hung_function_does_not_starve_a_valid_one(make_runner, gate):
    fns = [{"name": "_tr_hang"}, {"name": "target_fraction", "target": "r", "weight": 0.5}]
    runner = make_runner(fns, timeout_s=0.3, max_consecutive_timeouts=0)
    for _ in range(2):
        out = runner.score(*batch(12, gate=gate))
        assert out == [{"reward": 0.5 / 3, "errors": 1.0, "target_fraction": 1 / 3}] * 12


def test_timeout_counts_from_a_calls_own_start_and_calls_run_concurrently(make_runner):
    # 48 calls of 0.1 s on 4 workers need ~1.2 s, more than timeout_s, but each one needs
    # only 0.1 s: none is a timeout. Serially they would need 4.8 s.
    t0 = time.monotonic()
    out = make_runner([{"name": "_tr_sleep"}], timeout_s=1.0).score(*batch(48, sleep=0.1))
    dt = time.monotonic() - t0
    assert out == [{"reward": 1.0, "errors": 0.0, "slept": 1.0}] * 48
    assert dt < 3.0, f"{dt:.2f} s: calls did not run concurrently"


def test_switched_off_after_n_timeouts_in_a_row_logged_once(make_runner, gate, caplog):
    calls = []
    runner = make_runner([{"name": "_tr_hang"}, {"name": "target_fraction", "target": "r"}],
                         timeout_s=0.3, max_consecutive_timeouts=3, workers_per_function=4)
    with caplog.at_level(logging.WARNING, logger="rewards"):
        for _ in range(6):
            out = runner.score(*batch(1, gate=gate, calls=calls))
            assert out == [{"reward": 1 / 3, "errors": 1.0, "target_fraction": 1 / 3}]
    assert len(calls) == 3   # steps 4-6 did not call it (so did not wait for it either)
    assert runner.switched_off == ["_tr_hang"]
    off = [r.getMessage() for r in caplog.records if "in a row" in r.getMessage()]
    assert len(off) == 1 and "'_tr_hang'" in off[0] and "3 times in a row" in off[0], off
    first = [r.getMessage() for r in caplog.records if "past timeout_s" in r.getMessage()]
    assert len(first) == 1 and "'_tr_hang'" in first[0]
    hung = [t for t in threading.enumerate() if t.name.startswith("reward-_tr_hang-")]
    assert len(hung) <= 4   # threads lost to hung calls: at most the function's workers


def test_a_call_that_returns_resets_the_timeout_count(make_runner, gate):
    runner = make_runner([{"name": "_tr_hang_if"}], timeout_s=0.3, max_consecutive_timeouts=2,
                         workers_per_function=8)
    hang, ok = batch(1, gate=gate, hang=True), batch(1, gate=gate)
    ok_out = [{"reward": 0.5, "errors": 0.0, "ok": 1.0}]
    timed_out = [{"reward": 0.0, "errors": 1.0}]
    for b, want in [(hang, timed_out), (ok, ok_out), (hang, timed_out), (ok, ok_out),
                    (hang, timed_out), (ok, ok_out)]:
        assert runner.score(*b) == want
    # in sample order within a step too: hang, ok, hang is never two in a row
    assert runner.score(["r"] * 3, [hang[1][0], ok[1][0], hang[1][0]]) == [
        timed_out[0], ok_out[0], timed_out[0]]
    assert runner.score(*ok) == ok_out
    # the control: two in a row do switch it off
    assert runner.score(*hang) == timed_out and runner.score(*hang) == timed_out
    assert runner.score(*ok) == timed_out


def test_a_hung_reward_does_not_block_the_interpreter_exit(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(
        "import sys, threading\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import rewards\n"
        "rewards.register('_forever')(lambda response, sample: threading.Event().wait())\n"
        "print(rewards.score('r', {}, [{'name': '_forever'}], timeout_s=0.2))\n")
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit: a thread in a hung reward call was joined at exit")
    assert p.returncode == 0, p.stderr
    assert "'errors': 1.0" in p.stdout
    assert time.monotonic() - t0 < 30


def test_bad_arguments_fail_naming_the_culprit():
    with pytest.raises(ValueError, match="timeout_s must be a number > 0, got 0"):
        rewards.RewardRunner([{"name": "geometry"}], 0)
    with pytest.raises(ValueError, match="max_consecutive_timeouts must be an int >= 0"):
        rewards.RewardRunner([{"name": "geometry"}], 1.0, max_consecutive_timeouts=-1)
    with pytest.raises(ValueError, match="reward function 1: expected a dict with a 'name'"):
        rewards.RewardRunner([{"name": "geometry"}, {"weight": 1.0}], 1.0)
    with pytest.raises(KeyError, match="unknown reward 'nope'"):
        rewards.RewardRunner([{"name": "nope"}], 1.0)
    r = rewards.RewardRunner([{"name": "geometry"}], 1.0)
    with pytest.raises(ValueError, match="2 responses for 1 samples"):
        r.score(["a", "b"], [{"answer": "1"}])
    assert r.score([], []) == []
    r.close()


@rewards.register("_tr_info")
def _info(response, sample):
    return {"reward": 1.0, "length_ok": 1.0, "info": {"difficulty": 3, "source": "g3k"}}


def test_info_rides_beside_the_score_never_summed(make_runner):
    """A function's `info` mapping reaches the result as "info" (merged over the functions), is
    never added to the reward or made a part; a non-scalar value is a malformed result."""
    r = make_runner([{"name": "_tr_info", "weight": 2.0}, {"name": "_tr_sleep"}], timeout_s=5)
    out = r.score(*batch(2, sleep=0.0))
    assert out[0] == {"reward": 3.0, "errors": 0.0, "length_ok": 1.0, "slept": 1.0,
                      "info": {"difficulty": 3, "source": "g3k"}}
    bad = make_runner([{"name": "_tr_returns"}], timeout_s=5)
    got = bad.score(*batch(1, ret={"reward": 1.0, "info": {"x": [1, 2]}}))
    assert got[0]["errors"] == 1.0 and got[0]["reward"] == 0.0 and "info" not in got[0]
