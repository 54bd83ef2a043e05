"""Mixing datasets ([[data.sources]]): the entries' checks, the seeded draw by weight (shares,
resume, one source as before), grading by each source's own functions, and a short run whose
resume continues the same draw."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

import config as C
import resume_rules
import data
import rewards
from train import load_config  # config.load + the checks of the modules config.py does not import
from tests.util import ROOT, TINY, metrics, torchrun, train_py

TINY_TOML = str(ROOT / "configs" / "tiny.toml")
TWO = """
[[data.sources]]
name = "geo"
source = "synthetic"
weight = 3
reward_functions = [{ name = "target_fraction", weight = 1.0, target = "<answer>" }]

[[data.sources]]
name = "txt"
source = "synthetic-text"
weight = 1
reward_functions = [{ name = "geometry", weight = 1.0 }]
"""


def two_sources(tmp_path: Path, text: str = TWO) -> str:
    path = tmp_path / "mix.toml"
    path.write_text(text)
    return str(path)


def entry(**kw) -> str:
    """One data.sources entry as a TOML inline table (for --data.sources=[...])."""
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in kw.items()) + "}"


# ----------------------------------------------------------------------------- the config
def test_a_later_config_replaces_data_source_and_a_later_data_source_the_list(tmp_path):
    cfg = load_config([TINY_TOML, two_sources(tmp_path)])
    assert cfg.data.source == "" and [e["name"] for e in cfg.data.sources] == ["geo", "txt"]
    assert [(s.name, s.weight) for s in data.sources(cfg.data)] == [("geo", 3.0), ("txt", 1.0)]
    assert data.own_functions(cfg.data)["txt"] == [{"name": "geometry", "weight": 1.0}]
    back = load_config([TINY_TOML, two_sources(tmp_path)], ["--data.source=synthetic-text"])
    assert back.data.source == "synthetic-text" and back.data.sources == []
    # the resolved config (config.toml) loads again as it was written
    (tmp_path / "resolved.toml").write_text(C.dump_toml(cfg))
    assert load_config(str(tmp_path / "resolved.toml")).data.sources == cfg.data.sources
    assert "data.sources" in resume_rules.MEANING_KEYS  # another mixture does not resume silently


@pytest.mark.parametrize("text, match", [
    ('[data]\nsource = "synthetic"\n[[data.sources]]\nname = "a"\nsource = "synthetic"\nweight = 1\n',
     r"sets both data.source and data.sources"),
    ('[[data.sources]]\nname = "a"\nsource = "synthetic"\nweight = 1\n[reward]\n'
     'extra_functions = [{name = "overlong"}]\n'
     '[[data.sources]]\nname = "b"\nsource = "synthetic"\nweight = 1\nreward_functions = [{name = "geometry"}]\n',
     None),  # one source uses [reward] functions: the extra ones join those
])
def test_one_layer_setting_both_is_refused(tmp_path, text, match):
    if match is None:
        load_config([TINY_TOML, two_sources(tmp_path, text)])
        return
    with pytest.raises(C.ConfigError, match=match):
        load_config([TINY_TOML, two_sources(tmp_path, text)])


@pytest.mark.parametrize("entries, match", [
    ([entry(name="a", source="synthetic", weight=1), entry(name="a", source="synthetic-text", weight=1)],
     r"^data.sources\[1\].name: 'a' is data.sources\[0\]'s name too"),
    ([entry(name="", source="synthetic", weight=1)], r"^data.sources\[0\].name: expected a name"),
    ([entry(name="a b", source="synthetic", weight=1)], r"^data.sources\[0\].name: expected a name"),
    ([entry(name="a", source="synthetic", weight=0)], r"^data.sources\[0\].weight must be a number > 0"),
    ([entry(name="a", source="synthetic", weight=-1.5)], r"^data.sources\[0\].weight must be a number > 0"),
    ([entry(name="a", source="synthetic")], r"^data.sources\[0\].weight must be a number > 0.*None"),
    ([entry(name="a", source="synthetic", weight=1, colour="red")],
     r"^data.sources\[0\].colour: unknown key \(known: name, source, weight"),
    ([entry(name="a", source="synthetic", weight=1, problem_column="")],
     r"^data.sources\[0\].problem_column must name a column"),
    ([entry(name="a", weight=1)], r"^data.sources\[0\].source: expected a dataset"),
    ([entry(name="a", source="/no/such/folder", weight=1)],
     r"^data.sources\[0\].source: /no/such/folder is not a dataset folder"),
    (['{name = "a", source = "synthetic", weight = 1, reward_functions = [{name = "nope"}]}'],
     r"^data.sources\[0\].reward_functions\[0\].name: unknown reward 'nope'"),
    (['{name = "a", source = "synthetic", weight = 1, reward_functions = []}'],
     r"^data.sources\[0\].reward_functions: at least one reward function"),
    (['{name = "a", source = "synthetic", weight = 1, reward_functions = [{name = "geometry", weight = nan}]}'],
     r"^data.sources\[0\].reward_functions\[0\].weight must be a finite number"),
    (['"synthetic"'], r"^data.sources\[0\]: expected a table"),
])
def test_bad_entries_are_one_line_naming_the_key(entries, match):
    with pytest.raises(C.ConfigError, match=match) as e:
        load_config(TINY_TOML, [f"--data.sources=[{', '.join(entries)}]"])
    assert "\n" not in str(e.value)


def test_extra_functions_that_no_source_would_use_are_refused(tmp_path):
    with pytest.raises(C.ConfigError, match=r"^reward.extra_functions join \[reward\] functions, "
                                            r"which no source uses"):
        load_config([TINY_TOML, two_sources(tmp_path)],
                    ['--reward.extra_functions=[{name = "overlong", buffer = 4}]'])


def test_a_text_model_refuses_the_source_with_images_by_its_key(tmp_path):
    cfg = load_config([TINY_TOML, two_sources(tmp_path)])
    with pytest.raises(C.ConfigError, match=r"data.sources\[0\].source='synthetic'"):
        data.refuse_images(False, "tiny-qwen3", cfg.data)
    data.refuse_images(True, "tiny", cfg.data)


# ----------------------------------------------------------------------------- the draw
def mixture(tmp_path, per_step: int = 4, seed: int = 0, weights=(3, 1), n: int = 12):
    """Two tiny sources (synthetic text, two seeds' worth of names) and their Mixture."""
    entries = [entry(name=name, source="synthetic-text", weight=w)
               for name, w in zip(("geo", "txt"), weights)]
    cfg = load_config(TINY_TOML, [f"--data.sources=[{', '.join(entries)}]", f"--data.n_synthetic={n}"])
    problems, _ = data.load_sources(cfg.data, "train", seed=seed, prompt_len=lambda p: 1)
    return problems, data.Mixture(problems, cfg.data, per_step, seed)


def test_the_draw_keeps_the_weights_over_40_steps_and_each_source_its_stream(tmp_path):
    problems, mix = mixture(tmp_path)
    assert len({p.index for p in problems}) == len(problems) == 24  # indices unique across sources
    assert [p.source for p in problems] == ["geo"] * 12 + ["txt"] * 12
    steps = [mix.step_problems(s) for s in range(40)]
    drawn = [p for ps in steps for p in ps]
    assert len(drawn) == 160
    # a quota every step: 0.75 / 0.25 of 4 prompts is 3 + 1 in each, in a seeded order
    assert all(sorted(p.source for p in ps) == ["geo"] * 3 + ["txt"] for ps in steps)
    assert len({tuple(p.source for p in ps) for ps in steps}) > 1
    for name in ("geo", "txt"):  # each source goes through its whole pool before repeating one
        mine = [p.index for p in drawn if p.source == name]
        assert len(set(mine[:12])) == min(12, len(mine)), mine[:12]
    # another weight gives another share; the same seed the same draw
    _, other = mixture(tmp_path, weights=(1, 3))
    assert sum(p.source == "geo" for s in range(40) for p in other.step_problems(s)) < 80
    _, again = mixture(tmp_path)
    assert [[p.index for p in again.step_problems(s)] for s in range(40)] == \
        [[p.index for p in ps] for ps in steps]


@pytest.mark.parametrize("weights", [(0.7, 0.3), (7, 3), (0.2, 0.5, 0.3)])
def test_quotas_are_exact_over_any_window_and_within_one_prompt_every_step(weights):
    total, q = sum(weights), data.quotas(list(weights), 4)
    steps = [next(q) for _ in range(100)]
    assert all(sum(s) == 4 and min(s) >= 0 for s in steps)
    for k, w in enumerate(weights):
        assert sum(s[k] for s in steps) == round(400 * w / total)  # 0.7 / 0.3: 280 + 120 exactly
        for n in range(1, 101):  # every prefix within one prompt of the ideal
            assert abs(sum(s[k] for s in steps[:n]) - 4 * n * w / total) < 1
    if weights == (0.7, 0.3):  # largest remainder with the remainders carried, not rounded down
        assert steps[:4] == [[3, 1], [3, 1], [2, 2], [3, 1]]
    assert data.quotas([0.75, 0.25], 4).__next__() == [3, 1]


def test_a_resumed_draw_continues_exactly_with_nothing_saved(tmp_path):
    _, mix = mixture(tmp_path)
    whole = [[p.index for p in mix.step_problems(s)] for s in range(30)]
    _, resumed = mixture(tmp_path)  # a new process: it starts at step 17
    assert [[p.index for p in resumed.step_problems(s)] for s in range(17, 30)] == whole[17:]
    # the engine's worker thread and the main thread may both draw (pipeline.py)
    _, shared = mixture(tmp_path)
    got: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda s=s: got.update({s: [p.index for p in shared.step_problems(s)]}))
               for s in range(29, -1, -1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert [got[s] for s in range(30)] == whole


def test_one_source_is_todays_stream():
    cfg = load_config(TINY_TOML, ["--data.source=synthetic-text", "--data.n_synthetic=10"])
    problems, _ = data.load_sources(cfg.data, "train", seed=3, prompt_len=lambda p: 1)
    assert [p.index for p in problems] == list(range(10)) and {p.source for p in problems} == {""}
    mix = data.Mixture(problems, cfg.data, 4, 3)
    assert mix.names == []
    for step in range(6):
        assert mix.step_problems(step) == data.step_problems(problems, step, 4, 3)


# ----------------------------------------------------------------------------- grading
SEEN: list[tuple[str, str]] = []


@rewards.register("_mix_a")
def _mix_a(response, sample):
    SEEN.append(("a", sample["source"]))
    return {"reward": 1.0, "part_a": 1.0}


@rewards.register("_mix_b")
def _mix_b(response, sample, bonus: float = 0.0):
    SEEN.append((f"b{bonus:g}", sample["source"]))
    return {"reward": 2.0 + bonus, "part_b": 2.0}


def test_each_source_is_graded_by_its_own_functions_alone():
    SEEN.clear()
    runner = rewards.RewardRunner([{"name": "_mix_a"}], timeout_s=5, sources={
        "geo": [{"name": "_mix_b", "weight": 0.5}],
        "txt": [{"name": "_mix_b", "weight": 2.0}, {"name": "_mix_b", "bonus": 1.0}]})
    samples = [{"source": s} for s in ("geo", "txt", "", "geo", "other")]
    out = runner.score(["r"] * 5, samples)
    assert [d["reward"] for d in out] == [1.0, 2 * 2.0 + 3.0, 1.0, 1.0, 1.0]
    assert [sorted(k for k in d if k.startswith("part")) for d in out] == [
        ["part_b"], ["part_b"], ["part_a"], ["part_b"], ["part_a"]]
    assert out[1]["part_b"] == 4.0 and all(d["errors"] == 0 for d in out)
    # each function saw only its own sources' samples; _mix_b as configured alike (no params) in
    # two lists ran once per sample, the one with another param on its own
    assert sorted(SEEN) == sorted([("b0", "geo"), ("b0", "txt"), ("a", ""), ("b0", "geo"),
                                   ("a", "other"), ("b1", "txt")])
    runner.close()


# ----------------------------------------------------------------------------- a run
@pytest.mark.slow
def test_two_sources_run_logs_each_and_a_resume_continues_the_same_draw(tmp_path):
    """A world of one, 6 steps of the tiny demo with two sources (each graded by its own reward),
    against the same run stopped after 3 and resumed."""
    mix = two_sources(tmp_path)
    common = [*TINY, "--config", mix, "--run.log_samples=-1", "--run.eval_every=3", "--run.eval_size=2"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    for out, steps in ((whole, 6), (part, 3), (part, 6)):
        p = train_py([*common, f"--run.out_dir={out}", f"--run.steps={steps}", "--run.save_every=3"])
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "resumed from" in p.stdout and "data geo (synthetic) 0.75 + txt (synthetic-text) 0.25" in p.stdout

    def draws(out: Path) -> dict[int, list[tuple[str, int]]]:
        rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        by_step: dict[int, list] = {}
        for r in rows:
            by_step.setdefault(r["step"], []).append((r["source"], r["index"], r["parts"]))
        return by_step

    a, b = draws(whole), draws(part)
    assert sorted(a) == sorted(b) == list(range(6))
    assert [[x[:2] for x in a[s]] for s in range(3, 6)] == [[x[:2] for x in b[s]] for s in range(3, 6)]
    rows = [x for s in range(6) for x in a[s]]
    assert {src for src, _, _ in rows} == {"geo", "txt"}
    for src, _, parts in rows:  # each source graded by its own functions alone
        assert set(parts) == ({"errors", "target_fraction"} if src == "geo" else {"errors", "accuracy", "format"})
    m = metrics(whole)
    for row in m:
        assert row["data/geo/frac"] + row["data/txt/frac"] == pytest.approx(1.0)
        for name in ("geo", "txt"):
            mine = [x for x in a[row["step"]] if x[0] == name]
            assert ("reward/" + name + "/mean" in row) == bool(mine)
    evals = [json.loads(line) for line in (whole / "eval.jsonl").read_text().splitlines()]
    assert {"eval/geo/target_fraction", "eval/txt/accuracy", "eval/geo/n"} <= set(evals[-1])
    assert evals[-1]["eval/geo/n"] == evals[-1]["eval/txt/n"] == 2 and evals[-1]["eval/n"] == 4
    assert "eval/geo/accuracy" not in evals[-1] and "eval/txt/target_fraction" not in evals[-1]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], ["--train.packing=false"],
                                    ["--train.packing=false", "--train.share_prompt=false"]],
                         ids=["packed", "shared_prompt", "padded"])
def test_images_and_text_mixed_on_two_trainer_ranks_run_30_steps_and_learn(tmp_path, layout):
    """The mixing example of docs/data.md (an image source and a text-only one) on the 3-rank demo
    (2 trainer ranks): a trainer rank whose micro-batch holds no image runs the vision tower on a
    blank one as its peer runs it on images (before: gloo's "collective mismatch" at step 5, in
    every layout), and the image source's reward rises."""
    out = tmp_path / "run"
    # equal weights: 2 + 2 prompts a step (data.quotas), in a seeded order, so in some steps both
    # text prompts' groups fall to one trainer rank, whose micro-batches then hold no image
    mix = two_sources(tmp_path, TWO.replace("weight = 3", "weight = 1"))
    cfg = load_config([TINY_TOML, mix])
    problems, _ = data.load_sources(cfg.data, "train", seed=cfg.run.seed, prompt_len=lambda p: 1)
    stream = data.Mixture(problems, cfg.data, 4, cfg.run.seed)
    halves = [{p.source for p in stream.step_problems(k)[h:h + 2]} for k in range(30) for h in (0, 2)]
    assert {"txt"} in halves  # a text-only half: the blank image's case happens in this run
    torchrun(3, [*TINY, "--config", mix, "--run.steps=30", f"--run.out_dir={out}", *layout])
    m = metrics(out)
    geo = [r["reward/geo/mean"] for r in m]
    assert len(m) == 30 and all(r["data/txt/frac"] == 0.5 for r in m)
    assert sum(geo[-5:]) / 5 > sum(geo[:5]) / 5 + 0.3, geo


@pytest.mark.slow
def test_a_text_only_source_on_the_vision_model_runs_on_two_trainer_ranks(tmp_path):
    """data.sources holding a text-only source alone, on the tiny VLM over 2 trainer ranks: no
    step shows an image, so no rank runs the vision tower (none waits for another's)."""
    out = tmp_path / "run"
    only = '[{name = "txt", source = "synthetic-text", weight = 1}]'
    torchrun(3, [*TINY, f"--data.sources={only}", "--run.steps=6", f"--run.out_dir={out}"])
    assert [r["data/txt/frac"] for r in metrics(out)] == [1.0] * 6
