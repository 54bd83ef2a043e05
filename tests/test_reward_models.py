"""[[reward.models]]: a judge and a classifier on the tiny models, scoring in batches (one
forward per batch) through rewards.RewardRunner; their config checks; the 3-rank demo with a
judge as the only reward and beside geometry (slow)."""
import pytest
import torch

import reward_models
import rewards
import train
from errors import ConfigError
from tests.util import TINY_TEXT, metrics, torchrun

JUDGE = {"name": "judge", "path": "tiny-qwen3", "kind": "judge", "batch_size": 4,
         "template": "Problem: {problem}\nAnswer: {response}\nGold: {gold}\nIs the answer right? yes or no"}
CLASSIFIER = {"name": "rm", "path": "tiny-qwen3", "kind": "classifier", "batch_size": 3}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return reward_models.load([JUDGE, CLASSIFIER], tmp_path_factory.mktemp("rm"), torch.device("cpu"), 0)


def _samples(n):
    return [{"answer": str(i), "problem": f"What is {i} + 0?", "index": i} for i in range(n)]


@pytest.mark.parametrize("name,batch", [("judge", 4), ("rm", 3)])
def test_a_model_scores_a_batch_per_forward_as_one_by_one(loaded, name, batch):
    m = loaded[name]
    responses = [f"<answer>{i}</answer>" + " x" * (i % 3) for i in range(7)]  # rows of unequal length
    runner = rewards.RewardRunner([{"name": name, "weight": 2.0}], timeout_s=60, models=loaded)
    before = m.forwards
    out = runner.score(responses, _samples(7))
    assert m.forwards - before == -(-7 // batch)  # ceil(7 / batch_size) forwards: one per batch
    alone = [m([r], [s])[0]["reward"] for r, s in zip(responses, _samples(7))]  # padding changes nothing
    assert [d["reward"] for d in out] == pytest.approx([2 * a for a in alone], abs=1e-5)
    assert [d[name] for d in out] == pytest.approx(alone, abs=1e-5)
    assert all(d["errors"] == 0 for d in out)
    assert len({round(a, 6) for a in alone}) > 1  # the responses are told apart
    if name == "judge":
        assert all(0 < a < 1 for a in alone)
    runner.close()


def test_judge_reads_the_yes_no_probability_after_the_filled_prompt(loaded):
    m = loaded["judge"]
    s = _samples(1)[0]
    text = m.text("<answer>0</answer>", s)
    assert "What is 0 + 0?" in text and "<answer>0</answer>" in text and "Gold: 0" in text
    ids = m.tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = m.model(input_ids=ids).logits[0, -1]
    yes, no = logits[m.ids].softmax(-1).tolist()
    assert m(["<answer>0</answer>"], [s])[0]["reward"] == pytest.approx(yes, abs=1e-6)
    assert yes + no == pytest.approx(1.0)
    assert m.load_s > 0


def test_beside_a_function_and_per_source(loaded):
    runner = rewards.RewardRunner([{"name": "judge", "weight": 1.0}, {"name": "geometry", "weight": 0.5}],
                                  timeout_s=60, models=loaded, sources={"b": [{"name": "rm", "weight": 1.0}]})
    samples = _samples(4)
    samples[3]["source"] = "b"
    out = runner.score(["a", "b", "<think>x</think><answer>2</answer>", "d"], samples)
    assert "judge" in out[0] and "rm" not in out[0] and "format" in out[0]
    assert out[2]["reward"] == pytest.approx(out[2]["judge"] + 0.5 * rewards.score(
        "<think>x</think><answer>2</answer>", samples[2], [{"name": "geometry"}])["reward"])
    assert "rm" in out[3] and "judge" not in out[3]
    runner.close()


def test_parse_rules_read_the_last_verdict_or_number():
    e = reward_models.entry({"name": "j", "path": "x", "kind": "judge"})
    assert reward_models.PARSE["yes_no"]("No... wait, YES.", e) == 1.0
    assert reward_models.PARSE["yes_no"]("yes, but no", e) == 0.0
    with pytest.raises(ValueError, match="neither 'yes' nor 'no'"):
        reward_models.PARSE["yes_no"]("yesterday, nobody", e)  # whole words only
    assert reward_models.PARSE["last_number"]("Grade: 7 of 10 -> 0.75", e) == 0.75
    with pytest.raises(ValueError, match="no number"):
        reward_models.PARSE["last_number"]("none", e)


def test_a_generating_judge_parses_its_text_one_generate_call_per_batch(tmp_path):
    judge = dict(JUDGE, name="gen", parse="yes_no", max_new_tokens=6, batch_size=3)
    m = reward_models.load([judge], tmp_path, torch.device("cpu"), 0)["gen"]
    responses = [f"<answer>{i}</answer>" for i in range(5)]
    fixed = iter(["yes.", "so: no", "neither", "No. Yes!", "YES"])  # what the judge says
    texts = []

    def say(t, skip_special_tokens):
        texts.append(t)
        return next(fixed)
    m.tok.decode = say
    runner = rewards.RewardRunner([{"name": "gen", "weight": 2.0}], timeout_s=60, models={"gen": m})
    out = runner.score(responses, _samples(5))
    assert m.forwards == 2 and len(texts) == 5 and all(isinstance(t, list) and len(t) <= 6 for t in texts)
    assert [d["reward"] for d in out] == [2.0, 0.0, 0.0, 2.0, 2.0]
    assert [d["errors"] for d in out] == [0, 0, 1, 0, 0] and "gen" not in out[2]
    assert out[1]["info"] == {"gen": "so: no"} and out[1]["gen"] == 0.0
    runner.close()


def _load(tmp_path, models, functions='[{name="judge"}]', *more):
    return train.load_config(TINY_TEXT[1], [f"--run.out_dir={tmp_path}", f"--reward.models={models}",
                                            f"--reward.functions={functions}", *more])


def test_config_entries_and_names(tmp_path):
    judge = '[{name="judge", path="tiny-qwen3", kind="judge", template="{response} ok?"}]'
    cfg = _load(tmp_path, judge, '[{name="judge", weight=1.0}, {name="geometry"}]',
                '--eval.functions=[{name="judge"}]')
    assert cfg.reward.models[0]["kind"] == "judge"
    bad = [
        ('[{name="judge", path="tiny-qwen3", kind="oracle", template="{response}"}]', "reward.models[0].kind"),
        ('[{name="judge", path="tiny-qwen3", kind="judge", template="{problem}"}]', "{response}"),
        ('[{name="judge", path="tiny-qwen3", kind="judge", template="{answer} {response}"}]', "unknown field"),
        ('[{name="judge", path="tiny-qwen3", kind="judge", template="{response}", role="gpu"}]', "reward.models[0].role"),
        ('[{name="judge", path="tiny-qwen3", kind="judge", template="{response}", batch_size=0}]', "batch_size"),
        ('[{name="judge", path="tiny-qwen3", kind="judge", template="{response}", parse="regex"}]', "reward.models[0].parse"),
        ('[{name="rm", path="tiny-qwen3", kind="classifier", parse="yes_no"}]', "only a judge generates"),
        ('[{name="judge", path="tiny-nope", kind="judge", template="{response}"}]', "reward.models[0].path"),
        ('[{name="geometry", path="tiny-qwen3", kind="classifier"}]', "registered reward function"),
        ('[{name="errors", path="tiny-qwen3", kind="classifier"}]', "runner's own key"),
        ('[{name="judge", path="tiny-qwen3", kind="judge", template="{response}", colour=1}]', "unknown key"),
    ]
    for models, said in bad:
        with pytest.raises(ConfigError) as e:
            _load(tmp_path, models)
        assert said in str(e.value) and "\n" not in str(e.value), (models, str(e.value))
    with pytest.raises(ConfigError, match="unknown reward 'judge2'"):
        _load(tmp_path, judge, '[{name="judge2"}]')
    with pytest.raises(ConfigError, match="takes only a weight"):
        _load(tmp_path, judge, '[{name="judge", temperature=0.5}]')
    on_trainers = judge.replace("ok?\"", "ok?\", role=\"trainer\"")
    _load(tmp_path, on_trainers)  # training alone: fine
    with pytest.raises(ConfigError, match=r"eval.functions\[0\]: reward model 'judge' has role = 'trainer'"):
        _load(tmp_path, on_trainers, '[{name="judge"}]', '--eval.functions=[{name="judge"}]')
    with pytest.raises(ConfigError, match=r"reward.functions: 'judge' is scored on the trainer ranks .* --rollout.max_refill_rounds=0$"):
        _load(tmp_path, on_trainers, '[{name="judge"}]', "--loss.drop_zero_variance=true")
    _load(tmp_path, on_trainers, '[{name="judge"}]', "--loss.drop_zero_variance=true", "--rollout.max_refill_rounds=0")
    with pytest.raises(ConfigError, match=r"data.sources\[0\].reward_functions\[0\]: .* role = 'trainer'"):
        _load(tmp_path, on_trainers, '[{name="judge"}]', '--data.sources=[{name="a", weight=1.0, source="synthetic-text", '
              'reward_functions=[{name="judge"}]}]')


def _on_one_rank(tmp_path, role: str, functions: str):
    """reward_models.runners as train.py calls it on a rank of a world of one (trainer and
    generation rank), the judge with `role`."""
    import dataclasses
    from types import SimpleNamespace

    import torch.distributed as dist
    from device import detect
    models = ('[{name="judge", path="tiny-qwen3", kind="judge", batch_size=3, role="' + role + '", '
              'template="Problem: {problem} Answer: {response} Gold: {gold}. Right? yes or no"}]')
    cfg = _load(tmp_path, models, functions)
    cfg = dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, timeout_s=60.0))
    world = SimpleNamespace(is_trainer=True, is_gen=True, is_root=True, gen_index=0, local_rank=0,
                            trainers=[0], trainer_index=0, train_group=dist.group.WORLD)
    live = SimpleNamespace(phase=lambda *a: None)
    tr = SimpleNamespace(rewards=None)  # the trainer.Trainer field runners() sets
    scorer, _ = reward_models.runners(cfg, world, detect(), live, (cfg.reward.functions, cfg.eval.functions), tr)
    return scorer, world, tr


def test_a_trainer_side_judge_gives_the_rewards_of_a_generation_side_one(tmp_path, gloo_world):
    """The same responses scored with the judge on the generation side (rollout's runner) and
    on the trainer side (rollout's runner without it, then update.train_step's first phase):
    the same total, parts and metrics; the trainer side loads once, at start."""
    import rollout
    from episode import Episode
    functions = '[{name="geometry", weight=0.5}, {name="judge", weight=2.0}]'
    texts = [f"<think>x</think><answer>{i}</answer>" + " y" * (i % 3) for i in range(7)]
    got = {}
    for role in ("generation", "trainer"):
        scorer, world, tr = _on_one_rank(tmp_path / role, role, functions)
        assert (tr.rewards is None) == (role == "generation")
        problems = reward_models._problems(_load(tmp_path / role, "[]", '[{name="geometry"}]'))
        eps, rows = [], list(problems.values())[:7]
        samples = [{"answer": p.answer, "problem": p.problem, "index": p.index, "response_len": 3,
                    "truncated": False, "max_new_tokens": 16, "columns": p.columns, "source": ""} for p in rows]
        for i, (text, p, parts) in enumerate(zip(texts, rows, scorer.score(texts, samples))):  # as rollout.rollout
            total, info = parts.pop("reward"), parts.pop("info", {})
            eps.append(Episode(p.index, i // 4, [1], [5, 6, 7], [0.0] * 3, total, parts, 0, False, text, info=info))
        assert ("judge" in eps[0].parts) == (role == "generation")
        before = tr.rewards and tr.rewards.runner._models["judge"].forwards
        m = reward_models.score_on_trainers(tr, eps, world)
        if role == "trainer":
            assert tr.rewards.runner._models["judge"].forwards - before == 3  # ceil(7 / 3)
            want = rollout.episode_metrics(eps, [], 0)
            assert m == {k: v for k, v in want.items() if k.startswith("reward/")} and "reward/judge" in m
        else:
            assert m == {}
        got[role] = [(e.reward, e.parts) for e in eps]
    for (a, pa), (b, pb) in zip(got["generation"], got["trainer"]):
        assert b == pytest.approx(a, abs=1e-12) and pb == pytest.approx(pa, abs=1e-12)
    assert len({round(p["judge"], 6) for _, p in got["trainer"]}) > 1


@pytest.mark.slow
@pytest.mark.parametrize("functions,role", [
    ('[{name="judge", weight=1.0}]', "generation"),
    ('[{name="judge", weight=1.0}, {name="geometry", weight=1.0}]', "generation"),
    ('[{name="judge", weight=1.0}, {name="geometry", weight=1.0}]', "trainer")])  # on ranks 0-1
def test_demo_three_ranks_with_the_judge(tmp_path, functions, role):
    models = (f'[{{name="judge", path="tiny-qwen3", kind="judge", batch_size=8, role="{role}", '
              'template="Problem: {problem} Answer: {response} Gold: {gold}. Right? yes or no"}]')
    p = torchrun(3, [*TINY_TEXT, f"--run.out_dir={tmp_path}", "--run.steps=10",
                     f"--reward.models={models}", f"--reward.functions={functions}",
                     "--reward.timeout_s=5", *([] if "geometry" in functions else  # evaluation too
                                                 ["--run.eval_every=10", "--run.eval_size=4",
                                                  '--eval.functions=[{name="judge"}]'])], timeout=900)
    assert "reward model 'judge' (judge, tiny-qwen3, float32) loaded on" in p.stdout + p.stderr
    rows = [r for r in metrics(tmp_path) if "reward/judge" in r]
    assert len(rows) == 10
    assert all(0 < r["reward/judge"] < 1 and r["reward/errors"] == 0 for r in rows)
    if "geometry" in functions:
        assert all("reward/format" in r or "reward/accuracy" in r for r in rows)
        assert all(r["reward/mean"] == pytest.approx(  # the judge's reward and geometry's, each counted once
            r["reward/judge"] + 0.9 * r.get("reward/accuracy", 0.0) + 0.1 * r.get("reward/format", 0.0),
            abs=1e-9) for r in rows)
    else:
        evals = [r for r in metrics(tmp_path) if "eval/judge" in r]
        assert len(evals) == 1 and 0 < evals[0]["eval/judge"] < 1, evals


@pytest.mark.slow
def test_a_verdict_pair_the_tokenizer_cannot_tell_apart_stops_the_start_with_one_line(tmp_path):
    models = '[{name="judge", path="tiny-qwen3", kind="judge", no="yak", template="{response} yes or no"}]'
    p = torchrun(3, [*TINY_TEXT, f"--run.out_dir={tmp_path}", "--run.steps=2", f"--reward.models={models}",
                     '--reward.functions=[{name="judge"}]'], timeout=300, check=False)
    assert p.returncode != 0
    assert ("error: rank 2 (generation) failed during start: loading the reward models: reward.models "
            "'judge': yes = 'yes' and no = 'yak' start with the same token") in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists() or metrics(tmp_path) == []
