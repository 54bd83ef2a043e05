"""model.compile in the packed "segments" layout: every micro-batch brings its own plan
(attention.Plan: a different number and shape of calls per row), which once recompiled each
compiled decoder layer until dynamo's recompile limit (8), past which the layers ran eagerly
without a word. The plan now reaches the kernel as one opaque custom op (attention._op) given
the plan's handle: the layers compile at most twice (a static shape, then a dynamic one), loss
and gradients those of eager; a layer that does hit the limit says so (sharding.RecompileLimitWarning)."""
from __future__ import annotations

import pytest
import torch

import config as C
import data
import episode as E
import inputs as I
import model as M
import sharding
import synthetic
import trainer as T

CPU = torch.device("cpu")
SEGMENTS = M.RowLayout(packed="segments", share_prompt=True)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    path = tiny_dir("qwen2_5_vl")
    return path, I.load_processors(path, 56 * 56, 112 * 112)


def _packed(procs, k: int):
    """Packed micro-batch `k`: 1 + k % 3 text prompts with 1 + (k + i) % 3 responses each, of
    lengths that vary with k: its plan differs from its neighbours' (calls per row, widths)."""
    tokens, g = procs.tokens, torch.Generator().manual_seed(k)
    allowed = [i for i in range(tokens.vocab_size) if i not in tokens.suppressed]
    problems, eps = synthetic.make_synthetic_text(1 + k % 3, seed=k), []
    for i, p in enumerate(problems):
        for j in range(1 + (k + i) % 3):
            n = 3 + (5 * k + 7 * j + i) % 13
            resp = [allowed[t] for t in torch.randint(len(allowed), (n,), generator=g)]
            eps.append(E.Episode(p.index, i, I.prompt_ids(procs, data.user_text(p), 0), resp,
                                 [0.0] * n, 0.0, {}, 0, True))
    return I.pack(eps, [[] for _ in eps], procs, CPU, SEGMENTS)


def _counting_compile(monkeypatch) -> dict:
    """nn.Module.compile through AOTAutograd with no code generation (seconds, not inductor's
    minute): counts the forward and backward graphs compiled, every layer's together."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    count, compile = {"forward": 0, "backward": 0}, torch.nn.Module.compile

    def keep(kind):
        def compiler(gm, _example):
            count[kind] += 1
            return make_boxed_func(gm.forward)
        return compiler
    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile(self, backend=backend))
    return count


def _train(tiny, world, batches, mode: str, compiled: bool, monkeypatch):
    """(per-batch losses, gradients summed over `batches`, graphs compiled after each batch) of
    the trainer's policy (trainer.build) in the "segments" layout, its layers compiled or not."""
    path, procs = tiny
    torch._dynamo.reset()
    count = _counting_compile(monkeypatch) if compiled else {}
    tr = T.build(path, world, CPU, C.Config(model=C.ModelConfig(compile=compiled, activation_checkpointing=mode)),
                 SEGMENTS)
    monkeypatch.undo()
    losses, compiles = [], []
    for b in batches:
        lp, _ = M.sequence_logprobs(tr.policy, b, procs.tokens, 1.0)
        loss = (lp * b.response_mask).sum()
        loss.backward()
        losses.append(loss.detach())
        compiles.append(dict(count))
    grads = [p.grad.full_tensor() for p in tr.policy.parameters() if p.grad is not None]
    return torch.stack(losses), grads, compiles


def test_distinct_plans_compile_each_layer_at_most_twice(tiny, one_rank_world, monkeypatch):
    """Six micro-batches, each with its own plan: two forward graphs and two backward ones in
    all (the first shape, then a dynamic one), none after the second micro-batch. Before
    attention._op: one more per micro-batch (the plan's lists guarded), 8 by the 10th."""
    batches = [_packed(tiny[1], k) for k in range(6)]
    plans = {(b.input_ids.shape[1], *(len(r) for r in b.packed.plan.calls)) for b in batches}
    assert len(plans) == 6 and len({len(b.packed.plan.calls[0]) for b in batches}) > 1
    _, _, compiles = _train(tiny, one_rank_world, batches, "off", True, monkeypatch)
    assert compiles[-1] == compiles[1] and compiles[-1]["forward"] <= 2 and compiles[-1]["backward"] <= 2


@pytest.mark.parametrize("mode", ["off", "full", "selective"])
def test_compiled_segments_equal_eager(tiny, one_rank_world, monkeypatch, mode):
    """The custom op's forward runs eager's calls, its backward differentiates them again: losses
    and gradients over micro-batches of distinct plans equal eager's (test_sharding's 1e-6)."""
    batches = [_packed(tiny[1], k) for k in (1, 2)]
    eager = _train(tiny, one_rank_world, batches, mode, False, monkeypatch)
    got = _train(tiny, one_rank_world, batches, mode, True, monkeypatch)
    torch.testing.assert_close(got[0], eager[0], atol=1e-6, rtol=0)
    assert got[2][-1]["forward"] >= 1 and len(got[1]) == len(eager[1]) and got[1]
    for a, b in zip(got[1], eager[1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_a_layer_past_the_recompile_limit_says_so(monkeypatch, capsys):
    """Dynamo's fallback to eager past its recompile limit prints model.compile's line, once."""
    monkeypatch.setattr(sharding.RecompileLimitWarning, "said", False)
    sharding.RecompileLimitWarning.install()
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    f = torch.compile(lambda x, n: x * n, backend="eager", dynamic=False)
    for n in range(4):  # each int a new constant: one compile each, then the limit
        assert f(torch.ones(2), n).tolist() == [n, n]
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "model.compile" in ln]
    assert len(lines) == 1 and "recompile limit" in lines[0]


def test_a_plan_rebuilt_as_fsdp_casts_inputs_is_the_same_plan(tiny):
    """FSDP2's mixed precision casts a forward's inputs by rebuilding dataclasses
    (dataclasses.replace): the rebuilt plan keeps the original's handle and registers nothing,
    so a checkpointed layer's recompute in the backward still finds the plan the micro-batch
    holds (bench/device_check.sh's compiled bf16 step once failed with 'plan freed')."""
    import dataclasses
    import gc

    import attention as A
    plan = _packed(tiny[1], 1).packed.plan
    copy = dataclasses.replace(plan, calls=list(plan.calls))
    assert copy is not plan and int(copy.handle) == int(plan.handle)
    del copy
    gc.collect()
    assert A._plan(plan.handle) is plan
