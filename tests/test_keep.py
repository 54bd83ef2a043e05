"""rollout.partial = "keep" on the hf engine (hf_engine._Checked with keep): a weight version that arrives
between two decode steps is decoded on with the past key values as they are (no second prefill,
`Completion.reprefilled` 0), each token its own version and the logprob of the weights it was
sampled with over the KV as it was; "recompute" prefills the row again (reprefilled > 0)."""
from __future__ import annotations

import pytest
import torch

import config as C
import data
import episode as E
import hf_engine as HF
import inputs as I
import model as M
import multiturn
import synthetic
from errors import ConfigError

SWITCH = 3  # the check's third call (after token 1) loads version 1: tokens 0-1 v0, the rest v1


class _Arrives:
    """A stand-in for pipeline.Producer.check: on its SWITCH-th call it adds fixed noise to every
    weight in place (a load) and returns version 1 from then on."""

    def __init__(self, model, noise):
        self.model, self.noise, self.calls = model, noise, 0

    def __call__(self) -> int:
        self.calls += 1
        if self.calls == SWITCH:
            with torch.no_grad():
                for p, d in zip(self.model.parameters(), self.noise):
                    p.add_(d)
        return int(self.calls >= SWITCH)


@pytest.fixture(scope="module")
def setup(tiny_dir):
    path = tiny_dir("qwen3")  # text-only: plain positions for the hand-run KV below
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    p = synthetic.make_synthetic_text(1, seed=5)[0]
    prompt = (I.prompt_ids(procs, data.user_text(p), 0), [])
    return HF.HFEngine(path, torch.float32, procs, torch.device("cpu")), prompt


def _run(setup, keep):
    engine, prompt = setup
    engine.keep = keep
    g = torch.Generator().manual_seed(0)
    noise = [0.05 * torch.randn(p.shape, generator=g) for p in engine.model.parameters()]
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    sp = E.Sampling(n=1, max_new_tokens=6)
    out = multiturn.generate(engine, [prompt], sp, seed=11, check=_Arrives(engine.model, noise))
    return engine, before, out[0][0]


def test_keep_decodes_on_over_the_kept_kv_and_recompute_prefills_again(setup):
    engine, before, c = _run(setup, keep=True)
    assert len(c.ids) >= 4, c.ids  # (seeded: no stop token before the switch)
    assert c.versions == [0] * (SWITCH - 1) + [1] * (len(c.ids) - SWITCH + 1) and c.reprefilled == 0
    # logprob_diff compares a kept episode's tokens only when its oldest is the trainers' version
    ep = E.Episode(0, 0, [1], c.ids, c.logprobs, 0.0, {}, 0, False, versions=c.versions, kv_kept=c.kv_kept)
    assert c.kv_kept and I.compared_versions(ep) == [0] * len(c.ids) and I.token_versions(ep) == c.versions
    # token SWITCH - 1's logprob: the new weights on the KV the old ones computed
    prompt, ids, tk = setup[1][0], c.ids, engine.tokens
    model, after = engine.model, {k: v.clone() for k, v in engine.model.state_dict().items()}
    with torch.no_grad():
        model.load_state_dict(before)
        head = torch.tensor([prompt + ids[:SWITCH - 2]])
        past = model(input_ids=head, use_cache=True).past_key_values
        model.load_state_dict(after)
        last = model(input_ids=torch.tensor([[ids[SWITCH - 2]]]), past_key_values=past, use_cache=True,
                     attention_mask=torch.ones(1, head.shape[1] + 1, dtype=torch.long)).logits
        fresh = model(input_ids=torch.tensor([prompt + ids[:SWITCH - 1]])).logits  # a second prefill
    lp, _ = M.token_logprobs(last[:, -1:], torch.tensor([[ids[SWITCH - 1]]]), tk, 1.0)
    assert abs(lp.item() - c.logprobs[SWITCH - 1]) < 1e-4
    other, _ = M.token_logprobs(fresh[:, -1:], torch.tensor([[ids[SWITCH - 1]]]), tk, 1.0)
    assert abs(other.item() - c.logprobs[SWITCH - 1]) > 1e-3  # (what "recompute" would have given)
    # recompute: the same tokens up to the switch, then the row prefilled again
    model.load_state_dict(before)
    _, _, r = _run(setup, keep=False)
    assert r.ids[:SWITCH - 1] == ids[:SWITCH - 1] and r.logprobs[:SWITCH - 1] == pytest.approx(c.logprobs[:SWITCH - 1])
    assert r.reprefilled == len(prompt) + SWITCH - 1 and set(r.versions) == {0, 1} and not r.kv_kept


def test_partial_modes_at_load():
    base = ["--rollout.max_staleness=2", "--loss.correction=token_mask"]
    assert C.load(None, [*base, "--rollout.partial=true"]).rollout.partial is True
    assert C.load(None, [*base, '--rollout.partial="keep"']).rollout.partial == "keep"
    with pytest.raises(ConfigError, match="rollout.partial"):
        C.load(None, [*base, "--rollout.partial=kept"])
    from train import load_config  # engines.check: what the engines need
    assert load_config(None, [*base, "--rollout.partial=keep"]).rollout.partial == "keep"
    with pytest.raises(ConfigError, match="rollout.partial = \"keep\" needs rollout.engine = 'hf'"):
        load_config(None, [*base, "--rollout.partial=keep", "--rollout.engine=vllm"])
