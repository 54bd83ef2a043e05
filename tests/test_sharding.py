"""sharding.apply_fsdp's model.compile with activation checkpointing: each decoder layer's
checkpoint inside its compiled region (torchtitan's order: checkpoint, compile, FSDP2), not
transformers' checkpointing around it."""
from __future__ import annotations

from collections import Counter

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
from train import load_config

CPU = torch.device("cpu")
MATMULS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    path = tiny_dir("qwen2_5_vl")
    return path, I.load_processors(path, 56 * 56, 112 * 112)


def _batch(procs, n: int = 2):
    tokens, g = procs.tokens, torch.Generator().manual_seed(0)
    allowed = [i for i in range(tokens.vocab_size) if i not in tokens.suppressed]
    problems, eps = synthetic.make_synthetic(n, seed=5), []
    for i, p in enumerate(problems):
        resp = [allowed[j] for j in torch.randint(len(allowed), (6 + i,), generator=g)]
        eps.append(E.Episode(p.index, i, I.prompt_ids(procs, data.user_text(p), 1), resp,
                             [0.0] * len(resp), 0.0, {}, 0, True))
    return I.collate(eps, [p.images for p in problems], procs, CPU)


def _recording_compile(monkeypatch) -> dict:
    """nn.Module.compile through AOTAutograd with inductor's partitioner (min-cut, which honours
    the checkpoint's tags as inductor does) and no code generation (seconds, not a minute): the
    joint graph's forward and backward halves as compiled land in the returned dict."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs, compile = {}, torch.nn.Module.compile

    def keep(kind):
        def compiler(gm, _example):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)
        return compiler
    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                           partition_fn=min_cut_rematerialization_partition)
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile(self, backend=backend))
    return graphs


def _run(tiny, world, batch, mode, compiled: bool, monkeypatch):
    """(loss, gradients, :func:`_shape` of the compiled layer's graphs) of the trainer's policy
    (trainer.build) with model.activation_checkpointing = `mode`, each decoder layer compiled or
    not; its no-grad forward in train mode gives the same logprobs."""
    path, procs = tiny
    torch._dynamo.reset()  # each build compiles afresh, into its own graphs
    graphs = _recording_compile(monkeypatch) if compiled else {}
    mc = C.ModelConfig(compile=compiled, activation_checkpointing=mode)
    tr = T.build(path, world, CPU, C.Config(model=mc), M.RowLayout())
    monkeypatch.undo()
    layers = sharding.decoder_layers(tr.policy)
    assert len(layers) == 2 and all((u._compiled_call_impl is not None) == compiled for u in layers)
    if compiled:  # transformers' checkpointing off: each layer checkpoints itself, inside
        assert not tr.policy.is_gradient_checkpointing
        assert not any(getattr(m, "gradient_checkpointing", False) for m in tr.policy.modules())
    lp, _ = M.sequence_logprobs(tr.policy, batch, procs.tokens, 1.0)
    loss = (lp * batch.response_mask).sum()
    loss.backward()
    shape = _shape(graphs) if compiled else None
    grads = [p.grad.full_tensor() for p in tr.policy.parameters()]
    with torch.no_grad():  # in train mode without a gradient (LoRA's reference: the policy itself)
        again, _ = M.sequence_logprobs(tr.policy, batch, procs.tokens, 1.0)
    torch.testing.assert_close(again, lp.detach(), atol=1e-6, rtol=0)
    return loss.detach(), grads, shape


def _shape(graphs) -> tuple[int, int]:
    """(tensors the compiled layer saves for its backward, with its outputs; matmuls its backward
    runs): the output count of the forward half (the layer's outputs, the same in every mode,
    and what it saves) and the matmuls of the backward half (recomputed forward ones included)."""
    ops = Counter(str(n.target) for n in graphs["backward"].graph.nodes if n.op == "call_function")
    out = next(n for n in graphs["forward"].graph.nodes if n.op == "output")
    return len(out.args[0]), sum(ops[m] for m in MATMULS)


def test_compiled_layers_checkpoint_inside_and_match_eager_checkpointing(tiny, one_rank_world,
                                                                          monkeypatch):
    """model.compile with checkpointing "full" and "selective": the loss and every gradient equal
    eager (transformers') checkpointing's to 1e-6 in fp32; each compiled layer's backward
    recomputes: "full" saves fewer tensors than no checkpointing and runs its forward matmuls
    again, "selective" keeps the matmuls' outputs (no matmul recomputed) and recomputes the rest
    (fewer saved than without checkpointing, more than "full")."""
    batch = _batch(tiny[1])
    saved, matmuls = _run(tiny, one_rank_world, batch, "off", True, monkeypatch)[2]
    # eager "selective" equals eager "full" (tests/test_model.py): one eager run for both
    eager_loss, eager_grads, _ = _run(tiny, one_rank_world, batch, "full", False, monkeypatch)
    got = {}
    for mode in ("full", "selective"):
        loss, grads, got[mode] = _run(tiny, one_rank_world, batch, mode, True, monkeypatch)
        torch.testing.assert_close(loss, eager_loss, atol=1e-6, rtol=0)
        for a, b in zip(grads, eager_grads):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    (saved_full, matmuls_full), (saved_sel, matmuls_sel) = got["full"], got["selective"]
    assert saved_full < saved_sel < saved and matmuls_full > matmuls == matmuls_sel


@pytest.mark.parametrize("mode", ["full", "selective", "true"])
def test_compile_with_checkpointing_loads(mode):
    """The combination trainer.check once refused (the compiled layers ran eagerly under
    transformers' checkpointing) loads."""
    cfg = load_config(None, ["--model.compile=true", f"--model.activation_checkpointing={mode}"])
    assert cfg.model.compile and sharding.checkpointing_mode(cfg.model.activation_checkpointing) != "off"
