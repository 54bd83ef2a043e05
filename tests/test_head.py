"""head.py: the LM head's logprobs and entropies in token chunks equal the full-vocabulary
computation (model.token_logprobs over the logits) to 1e-6 in fp32, values and gradients, with
suppressed ids, a temperature and the entropy bonus; and so does the trainer's forward
(model.sequence_logprobs) in every layout."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import head as H
import model as M
import sharding


def _full(hidden, weight, targets, suppressed, temperature):
    """Today's: every logit at once, then model.token_logprobs."""
    tokens = SimpleNamespace(suppressed=suppressed)
    return M.token_logprobs(torch.nn.functional.linear(hidden, weight), targets, tokens, temperature)


def _grads(fn, hidden, weight, a, b):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = fn(h, w)
    (lp * a).sum().add((ent * b).sum()).backward() if ent.requires_grad else (lp * a).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunks_equal_the_full_vocabulary(chunk, entropy_grad):
    g = torch.Generator().manual_seed(0)
    N, V, Hd = 37, 300, 16
    hidden, weight = torch.randn(N, Hd, generator=g), 0.3 * torch.randn(V, Hd, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    suppressed = (3, 5, int(targets[0]))                 # a target may be a removed id: -inf, no grad
    a, b = torch.randn(N, generator=g), torch.randn(N, generator=g)
    ref = _grads(lambda h, w: _full(h, w, targets, suppressed, 0.7) if entropy_grad else
                 (lambda lp, e: (lp, e.detach()))(*_full(h, w, targets, suppressed, 0.7)),
                 hidden, weight, a, b)
    got = _grads(lambda h, w: H.logprobs(h, w, targets, suppressed, 0.7, entropy_grad, chunk),
                 hidden, weight, a, b)
    assert got[0][0] == float("-inf") and ref[0][0] == float("-inf")
    for r, x, name in zip(ref, got, ("logprob", "entropy", "hidden grad", "weight grad")):
        assert rel_diff(x, r) <= 1e-6, (name, rel_diff(x, r))


def rel_diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude (-inf where it is)."""
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(x), inf) and not x.isnan().any()
    return float((x - ref)[~inf].abs().max() / ref[~inf].abs().max().clamp(min=1e-30))


def _episodes(path: str, vision: bool):
    """3 prompts x 3 responses of varied lengths (random ordinary tokens: their values do not
    matter here), with the prompts' images."""
    import data
    import inputs as I
    import rollout as R
    import synthetic
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    problems = (synthetic.make_synthetic(3, seed=3) if vision
                else synthetic.make_synthetic_text(3, seed=3))
    g = torch.Generator().manual_seed(1)
    eps = []
    for k, p in enumerate(problems):
        prompt = I.prompt_ids(procs, data.user_text(p), len(p.images))
        for j in range(3):
            ids = torch.randint(10, 200, (3 + 4 * j + k,), generator=g).tolist()
            eps.append(R.Episode(p.index, k, prompt, ids, [0.0] * len(ids), 0.0, {}, 0, False))
    return procs, eps, {p.index: p.images for p in problems}


def _full_head(hidden, weight, targets, suppressed=(), temperature=1.0, entropy_grad=False,
               chunk=None):
    """head.logprobs as it was before head.py: the [N, V] logits, then model.token_logprobs."""
    return _full(hidden, weight, targets, suppressed, temperature)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3"])        # qwen3's tiny: tied embeddings
@pytest.mark.parametrize("layout", ["padded", "shared-prompt", "packed"])
def test_the_trainer_forward_equals_the_full_head_in_every_layout(layout, family, tiny_dir,
                                                                   monkeypatch):
    """model.sequence_logprobs with the chunked head (several chunks) against the same forward
    whose head computes every logit at once (model.token_logprobs, what the trainer did before):
    logprobs, entropies and every parameter's gradient of a loss with an entropy bonus, at a
    temperature, suppressed ids removed, to 1e-6 relative."""
    import inputs as I
    path = tiny_dir(family)
    model = M.load_model(path).train()
    procs, eps, images = _episodes(path, family == "qwen2_5_vl")
    tokens = procs.tokens
    assert tokens.suppressed or family == "qwen3"
    if layout == "packed":
        model.set_attn_implementation(M.attention_for("segments"))
    batch = I.collate(eps, [I.episode_images(images, e) for e in eps], procs, torch.device("cpu"),
                      M.RowLayout("segments" if layout == "packed" else None, layout != "padded"))
    monkeypatch.setattr(H, "CHUNK_BYTES", 4 * 7 * model.config.get_text_config().vocab_size)  # 7 tokens

    def run():
        model.zero_grad(set_to_none=True)
        lp, ent = M.sequence_logprobs(model, batch, tokens, 0.7, entropy_grad=True)
        mask = batch.response_mask.float()
        ((lp * mask).sum() - 0.3 * (ent * mask).sum()).backward()
        return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                           if p.grad is not None}

    lp, ent, grads = run()
    with monkeypatch.context() as m:
        m.setattr(H, "logprobs", _full_head)
        lp_ref, ent_ref, grads_ref = run()
    assert int(batch.response_mask.sum()) > 7 and ent.abs().sum() > 0
    assert rel_diff(lp, lp_ref) <= 1e-6 and rel_diff(ent, ent_ref) <= 1e-6
    assert set(grads) == set(grads_ref) and grads
    assert max(rel_diff(grads[n], grads_ref[n]) for n in grads if grads_ref[n].abs().max() > 0) <= 1e-6


def _fsdp_rank(rank: int, port: int, path: str, out: str) -> None:
    """One of two gloo ranks: the tiny model (tied embeddings) sharded with FSDP2 as the trainer
    does (activation checkpointing on), the chunked head, a loss with the entropy bonus; rank 0
    writes the largest relative difference of every gradient to an unsharded copy whose head
    computes every logit at once."""
    import json
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import inputs as I
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        procs, eps, images = _episodes(path, False)
        batch = I.collate(eps, [I.episode_images(images, e) for e in eps], procs, torch.device("cpu"))
        H.CHUNK_BYTES = 4 * 5 * M.load_config(path).get_text_config().vocab_size   # 5 tokens

        def grads(model):
            lp, ent = M.sequence_logprobs(model, batch, procs.tokens, 0.7, entropy_grad=True)
            mask = batch.response_mask.float()
            ((lp * mask).sum() - 0.3 * (ent * mask).sum()).backward()
            return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                    for n, p in model.named_parameters() if p.grad is not None}

        sharded = sharding.apply_fsdp(M.load_model(path).train(), DeviceMesh.from_group(dist.group.WORLD, "cpu"),
                               checkpointing=True)
        got = grads(sharded)                     # FSDP2 averages the two ranks' equal gradients
        chunked = H.logprobs
        H.logprobs = _full_head
        ref = grads(M.load_model(path).train())
        H.logprobs = chunked
        diffs = {n: rel_diff(got[n], ref[n]) for n in ref if ref[n].abs().max() > 0}
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"diffs": diffs, "names": sorted(got)}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_on_two_ranks_with_tied_embeddings(tiny_dir, tmp_path):
    """Under FSDP2 over two ranks (the head inside the root unit, its weight tied to the
    embeddings) the chunked head gives the unsharded full-vocabulary gradients to 1e-6."""
    import json

    import torch.multiprocessing as mp

    from tests.util import free_port
    path, out = tiny_dir("qwen3"), tmp_path / "diffs.json"
    assert M.load_config(path).tie_word_embeddings
    mp.spawn(_fsdp_rank, args=(free_port(), path, str(out)), nprocs=2)
    r = json.loads(out.read_text())
    assert "model.embed_tokens.weight" in r["diffs"] and len(r["diffs"]) > 5
    assert max(r["diffs"].values()) <= 1e-6, r["diffs"]


def test_a_lora_adapted_head_equals_its_own_forward(tiny_dir):
    """`[model] lora_target_modules` may name an untied head: the chunks use its base weight plus
    the adapter's delta (head.head_weight), and equal the peft layer's own forward (every logit
    at once, model.token_logprobs), values and the adapters' gradients; with the adapters
    disabled (the LoRA reference), the base alone."""
    import inputs as I
    import lora
    from train import load_config
    path = tiny_dir("qwen2_5_vl")
    cfg = load_config(None, ["--model.lora_rank=4", '--model.lora_target_modules=["lm_head","q_proj"]'])
    model = lora.add_lora(M.load_model(path), cfg.model, seed=0).train()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    assert hasattr(model.get_output_embeddings(), "lora_A")
    procs, eps, images = _episodes(path, True)
    batch = I.collate(eps, [I.episode_images(images, e) for e in eps], procs, torch.device("cpu"))
    mask = batch.response_mask[:, 1:].bool()
    targets = batch.input_ids[:, 1:][mask]

    def grads(lp):
        model.zero_grad(set_to_none=True)
        lp.sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    lp, _ = M.sequence_logprobs(model, batch, procs.tokens, 0.7)
    got = grads(lp[:, 1:][mask])
    logits = model(**dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask),
                   **M._model_inputs(batch, procs.tokens)).logits[:, :-1][mask]
    ref_lp, _ = M.token_logprobs(logits, targets, procs.tokens, 0.7)
    ref = grads(ref_lp)
    assert rel_diff(lp[:, 1:][mask].detach(), ref_lp.detach()) <= 1e-6
    assert any("lm_head" in n and "lora_B" in n for n in got) and set(got) == set(ref)
    assert max(rel_diff(got[n], ref[n]) for n in ref if ref[n].abs().max() > 0) <= 1e-6
    with torch.no_grad(), model.disable_adapter():
        off, _ = M.sequence_logprobs(model, batch, procs.tokens, 0.7)
        base = model(**dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask),
                     **M._model_inputs(batch, procs.tokens)).logits[:, :-1][mask]
        assert rel_diff(off[:, 1:][mask], M.token_logprobs(base, targets, procs.tokens, 0.7)[0]) <= 1e-6
