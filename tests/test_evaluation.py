"""evaluation.py: its decoding from [eval] over [rollout], what an eval row records, and the
metrics (pass@1 over every sample, pass@n over problems) on hand-made episodes, with the
generation ranks' gather done in-process."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import config as C
import evaluation as E
import episode as EP
import rollout as R
from synthetic import Problem


def _ep(index, accuracy, n_tokens=3):
    return EP.Episode(index=index, group=0, prompt_ids=[1], response_ids=[7] * n_tokens,
                     logprobs=[-1.0] * n_tokens, reward=accuracy, parts={"accuracy": accuracy,
                     "errors": 0.0}, version=4, truncated=False, text="x",
                     info={"difficulty": index + 1})  # what a reward returns beside the score


def test_sampling_is_greedy_at_n_1_and_overrides_only_what_is_set():
    ro = C.RolloutConfig(max_new_tokens=16, top_p=0.9, top_k=5, temperature=0.7)
    assert E.sampling(C.EvalConfig(), ro) == EP.Sampling(n=1, greedy=True, max_new_tokens=16)
    sp = E.sampling(C.EvalConfig(n=4, temperature=0.6, max_new_tokens=32), ro)
    assert sp == EP.Sampling(n=4, temperature=0.6, top_p=0.9, top_k=5, max_new_tokens=32)
    assert E.sampling(C.EvalConfig(n=4, top_p=0.5), ro).top_p == 0.5
    assert E.settings(C.EvalConfig(), ro) == {"split": "validation", "n": 1, "temperature": 0.0,
                                              "top_p": 1.0, "max_new_tokens": 16}


@pytest.mark.parametrize("gens", [(0,), (1, 2)])
def test_pass_at_1_and_pass_at_n_on_hand_made_episodes(monkeypatch, gens):
    """3 problems x 2 samples; accuracy 1/0, 0/0, 1/1: pass@1 = 3/6, pass@2 = 2/3. With two
    generation ranks each gets every other problem and the gather puts them back in order."""
    import torch.distributed as dist
    acc = {0: [1.0, 0.0], 1: [0.0, 0.0], 2: [1.0, 1.0]}
    problems = [Problem(i, [], f"p{i}", str(i)) for i in range(3)]

    def rollout(engine, probs, procs, sp, *, version, **_):  # the arguments it checks, by keyword
        assert sp.n == 2 and not sp.greedy and version == 4
        return [_ep(p.index, a) for p in probs for a in acc[p.index]], {}
    monkeypatch.setattr(R, "rollout", rollout)
    cfg = SimpleNamespace(eval=C.EvalConfig(n=2), rollout=C.RolloutConfig(), data=C.DataConfig())
    # every generation rank's share, as all_gather_object would return them
    shares = [rollout(None, problems[i::len(gens)], None, E.sampling(cfg.eval, cfg.rollout),
                      version=4) for i in range(len(gens))]

    def gather(out, obj, group=None):
        out[:] = shares + [([], {})] * (len(out) - len(shares))
    monkeypatch.setattr(dist, "all_gather_object", gather)
    world = SimpleNamespace(is_gen=True, gens=gens, gen_index=0, size=len(gens) + 1, ctrl=None)
    out, eps = E.evaluate(world, None, None, problems, None, cfg, version=4, seed=0, skipped=2)
    assert out["eval/accuracy"] == pytest.approx(0.5) == out["eval/reward"]
    assert out["eval/accuracy/pass@2"] == pytest.approx(2 / 3)
    assert [k for k in out if "pass@" in k] == ["eval/accuracy/pass@2"]   # the score's alone
    assert out["eval/skipped_rows"] == 2                                  # rows over max_prompt_len
    assert "eval/errors" not in out
    assert (out["eval/n"], out["eval/samples"], out["eval/response_len"]) == (3, 6, 3.0)
    assert [e.index for e in eps] == [0, 0, 1, 1, 2, 2]
    rows = E.eval_rows(eps, problems)
    assert [(r["index"], r["sample"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert rows[5]["gold"] == "2" and rows[0]["problem"] == "p0" and rows[0]["version"] == 4
    # a reward's info reaches the records and no metric (no mean, no pass@n)
    assert rows[4]["info"] == {"difficulty": 3}
    assert not any("difficulty" in k for k in out), sorted(out)


def test_eval_records_keep_the_image_markers():
    """Several images: the record says where each went (leading markers when the row had them
    first, the row's own text where a marker sits after some text)."""
    from PIL import Image
    im = Image.new("RGB", (4, 4))
    first = Problem(0, [im, im], "Compare the two figures.", "1")
    inside = Problem(1, [im, im], "A is and B is", "2", raw="A <image> is and B <image> is")
    rows = E.eval_rows([_ep(0, 1.0), _ep(1, 0.0)], [first, inside])
    assert rows[0]["problem"] == "<image><image>Compare the two figures."
    assert rows[1]["problem"] == "A <image> is and B <image> is"


def test_pass_at_n_is_for_the_score_alone():
    """The geometry verifier's parts: accuracy (the score) gets pass@n; its format and the total
    that mixes them (0.9 accuracy + 0.1 format) are diagnostics, their means alone. Functions
    without an accuracy part: the total reward is the score."""
    def ep(i, acc, fmt):
        return R.Episode(index=i, group=0, prompt_ids=[1], response_ids=[7], logprobs=[-1.0],
                         reward=0.9 * acc + 0.1 * fmt, parts={"accuracy": acc, "format": fmt},
                         version=0, truncated=False, text="x")
    eps = [ep(0, 1.0, 0.0), ep(0, 0.0, 1.0), ep(1, 0.0, 1.0), ep(1, 0.0, 0.0)]
    out = E.metrics(eps, 2, "eval/")
    assert {k for k in out if "pass@" in k} == {"eval/accuracy/pass@2"}
    assert out["eval/accuracy/pass@2"] == pytest.approx(0.5) and out["eval/format"] == 0.5
    toy = [R.Episode(index=i, group=0, prompt_ids=[1], response_ids=[7], logprobs=[-1.0],
                     reward=r, parts={"target_fraction": r}, version=0, truncated=False, text="x")
           for i, r in [(0, 0.2), (0, 0.6), (1, 0.4), (1, 0.0)]]
    out = E.metrics(toy, 2, "eval/")
    assert {k for k in out if "pass@" in k} == {"eval/reward/pass@2"}
    assert out["eval/reward/pass@2"] == pytest.approx(0.5)
