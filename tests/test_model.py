"""The tiny model, prompts, and engine/trainer logprob parity in one process (Qwen2.5-VL, the
default family; tests/test_families.py runs the same checks on every family)."""
from __future__ import annotations

import pytest
import torch

import data
import families as F
import inputs as I
import model as M
import sharding
import synthetic
import hf_engine as HF
import episode as E
from tests.util import CheckpointCounter

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    path = tiny_dir("qwen2_5_vl")
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    return path, procs


def test_build_is_deterministic_and_loadable(tmp_path, tiny):
    path, procs = tiny
    other = F.build_tiny(tmp_path / "again", seed=0)
    a = M.load_model(path).state_dict()
    b = M.load_model(str(other)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    for t in ("<answer>", "</answer>", "<think>", "</think>", "<|image_pad|>"):
        assert len(procs.tokenizer.encode(t, add_special_tokens=False)) == 1, t


def test_tokens_suppress_vision_and_chat_specials_but_not_eos(tiny):
    _, procs = tiny
    tok, tokens = procs.tokenizer, procs.tokens
    for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_start|>", "<|endoftext|>"):
        assert tok.convert_tokens_to_ids(t) in tokens.suppressed
    assert tokens.eos not in tokens.suppressed and tokens.stops == (tokens.eos,)
    assert tok.convert_tokens_to_ids("<answer>") not in tokens.suppressed


def test_prompt_has_one_unexpanded_placeholder_then_expands(tiny):
    _, procs = tiny
    tok, tokens = procs.tokenizer, procs.tokens
    ids = I.prompt_ids(procs, "Find x.", 1)
    assert ids.count(tokens.image_pad) == 1
    i = ids.index(tokens.image_pad)
    assert ids[i - 1] == tokens.vision_start and ids[i + 1] == tokens.vision_end
    # the family's template: Qwen2-VL / Qwen2.5-VL add their default system turn
    assert tok.decode(ids) == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                               "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
                               "Find x.<|im_end|>\n<|im_start|>assistant\n")
    exp = I.expand_images(ids, [16], tokens.image_pad)
    assert exp.count(tokens.image_pad) == 16 and len(exp) == len(ids) + 15
    with pytest.raises(ValueError):
        I.expand_images(ids + ids, [4], tokens.image_pad)


def test_system_prompt_and_image_markers(tiny):
    """data.system_prompt replaces the template's default system turn; `<image>` markers put
    each image where the text has it; markers and images must agree in number."""
    import dataclasses
    path, procs = tiny
    tok, tokens = procs.tokenizer, procs.tokens
    mine = dataclasses.replace(procs, chat=dataclasses.replace(procs.chat, system_prompt="Be terse."))
    text = tok.decode(I.prompt_ids(mine, "Compare <image> with <image>.", 2))
    assert text == ("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nCompare "
                    "<|vision_start|><|image_pad|><|vision_end|> with "
                    "<|vision_start|><|image_pad|><|vision_end|>.<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="3 image.*2 <image> placeholder"):
        I.prompt_ids(procs, "Compare <image> with <image>.", 3)
    assert I.prompt_ids(procs, "No images here.", 0).count(tokens.image_pad) == 0


def test_hf_engine_logprobs_equal_trainer_forward(tiny):
    """Left-padded cached generation vs right-padded full forward with mRoPE positions."""
    path, procs = tiny
    tokens = procs.tokens
    engine = HF.HFEngine(path, torch.float32, procs, torch.device("cpu"))
    problems = synthetic.make_synthetic(3, seed=1)
    prompts = [(I.prompt_ids(procs, data.user_text(p) * (1 + i), 1), p.images)
               for i, p in enumerate(problems)]  # different lengths: padding matters
    for temp in (1.0, 0.7):
        out = engine.generate(prompts, E.Sampling(n=3, temperature=temp, max_new_tokens=12), seed=0)
        assert [len(c) for c in out] == [3, 3, 3]
        eps = [E.Episode(p.index, g, prompts[g][0], c.ids, c.logprobs, 0.0, {}, 0, c.truncated)
               for g, (p, cs) in enumerate(zip(problems, out)) for c in cs]
        for e in eps:
            assert not set(e.response_ids) & set(tokens.suppressed)
            assert (tokens.eos in e.response_ids) != e.truncated
        batch = I.collate(eps, [problems[e.group].images for e in eps], procs, torch.device("cpu"))
        with torch.no_grad():
            lp, _ = M.sequence_logprobs(engine.model, batch, tokens, temp)
        m = batch.response_mask.bool()
        assert (lp[m] - batch.engine_logprobs[m]).abs().max() < 1e-4


def test_text_only_positions_would_be_caught(tiny):
    """Without mm_token_type_ids transformers uses text-only positions: the parity check sees it."""
    path, procs = tiny
    tokens = procs.tokens
    engine = HF.HFEngine(path, torch.float32, procs, torch.device("cpu"))
    p = synthetic.make_synthetic(1, seed=2)[0]
    ids = I.prompt_ids(procs, data.user_text(p), 1)
    c = engine.generate([(ids, p.images)], E.Sampling(n=2, max_new_tokens=8), seed=0)[0][0]
    e = E.Episode(p.index, 0, ids, c.ids, c.logprobs, 0.0, {}, 0, c.truncated)
    batch = I.collate([e], [p.images], procs, torch.device("cpu"))
    with torch.no_grad():
        out = engine.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           pixel_values=batch.pixel_values, image_grid_thw=batch.image_grid_thw)
    lp, _ = M.token_logprobs(out.logits[:, :-1], batch.input_ids[:, 1:], tokens, 1.0)
    m = batch.response_mask[:, 1:].bool()
    assert (lp[m] - batch.engine_logprobs[:, 1:][m]).abs().max() > 1e-3


def test_lm_head_sees_only_response_positions_without_slice_logits_to_keep(tiny, monkeypatch):
    """The cheap logits path selects the positions itself (a hook on the LM head's input), so it
    needs no `slice_logits_to_keep` (transformers < 5.24 has none): with that function gone the
    logprobs are the same, and the head's own matmul runs on no rows (head.py computes the N
    response positions' logprobs in chunks), never [B, L, vocab]."""
    import transformers.modeling_utils as mu
    path, procs = tiny
    model = M.load_model(path)
    batch = _batch(tiny)
    with torch.no_grad():
        before, _ = M.sequence_logprobs(model, batch, procs.tokens, 1.0)
    monkeypatch.delattr(mu, "slice_logits_to_keep", raising=False)
    rows = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, out: rows.append(out.shape))
    try:
        with torch.no_grad():
            after, _ = M.sequence_logprobs(model, batch, procs.tokens, 1.0)
    finally:
        hook.remove()
    assert torch.equal(before, after)
    assert len(rows) == 1 and rows[0][0] == 0 and rows[0][-1] == procs.tokens.vocab_size


# --------------------------------------------------------------------- activation checkpointing
def _batch(tiny, n: int = 2):
    path, procs = tiny
    tokens = procs.tokens
    problems = synthetic.make_synthetic(n, seed=5)
    g = torch.Generator().manual_seed(0)
    allowed = [i for i in range(tokens.vocab_size) if i not in tokens.suppressed]
    eps = []
    for i, p in enumerate(problems):
        resp = [allowed[j] for j in torch.randint(len(allowed), (6 + i,), generator=g)]
        eps.append(E.Episode(p.index, i, I.prompt_ids(procs, data.user_text(p), 1), resp,
                             [0.0] * len(resp), 0.0, {}, 0, True))
    return I.collate(eps, [p.images for p in problems], procs, torch.device("cpu"))


@pytest.mark.parametrize("checkpointing", [True, "selective", False])
def test_trainer_policy_recomputes_layers_in_backward(tiny, one_rank_world, checkpointing):
    """trainer.build's policy is in train mode, so with model.activation_checkpointing every
    decoder layer (2 in the tiny model; the vision tower never) goes through the checkpoint
    function and is recomputed during backward ("selective": its non-matmul ops); the logprobs
    and gradients equal those without checkpointing, train-mode logprobs eval-mode ones bitwise."""
    import config as C
    import trainer as T
    path, procs = tiny
    tokens = procs.tokens
    batch, grads = _batch(tiny), []
    for mode in (checkpointing, False):
        mc = C.ModelConfig(activation_checkpointing=mode)
        tr = T.build(path, one_rank_world, torch.device("cpu"), C.Config(model=mc), M.RowLayout())
        assert tr.policy.training
        count = CheckpointCounter(tr.policy)
        lp, _ = M.sequence_logprobs(tr.policy, batch, tokens, 1.0)
        layers = 2 if mode else 0
        assert (count.calls, count.recomputes) == (layers, 0)
        (lp * batch.response_mask).sum().backward()
        assert (count.calls, count.recomputes) == (layers, layers)
        assert all(p.grad is not None for p in tr.policy.parameters() if p.requires_grad)
        grads.append([p.grad.full_tensor() for p in tr.policy.parameters()])
        tr.policy.eval()
        with torch.no_grad():
            lp_eval, _ = M.sequence_logprobs(tr.policy, batch, tokens, 1.0)
        assert count.calls == layers  # eval mode: no checkpointing
        assert torch.equal(lp.detach(), lp_eval)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("memory, mode", [(64, "off"), (0, "full")])
def test_trainer_runs_the_mode_auto_resolved_to(tiny, one_rank_world, memory, mode):
    """model.activation_checkpointing = "auto": trainer.build runs (and holds) the mode the memory
    plan chose for the tiny model: none on a 64 GiB device, "full" where the device's memory is
    not given (every decoder layer recomputed in backward); under model.compile too, each
    compiled layer's checkpoint inside it or none (the layers compile at their first forward)."""
    import config as C
    import trainer as T
    path, procs = tiny
    cfg = C.load(None, ["--model.activation_checkpointing=auto", f"--cluster.device_memory_gib={memory}"])
    tr = T.build(path, one_rank_world, torch.device("cpu"), cfg, M.RowLayout())
    assert tr.checkpointing == mode == T.resolve_checkpointing(cfg, one_rank_world, path)[0]
    count, batch = CheckpointCounter(tr.policy), _batch(tiny)
    (M.sequence_logprobs(tr.policy, batch, procs.tokens, 1.0)[0] * batch.response_mask).sum().backward()
    layers = 2 if mode == "full" else 0
    assert (count.calls, count.recomputes) == (layers, layers)
    cfg.model.compile = True
    compiled = T.build(path, one_rank_world, torch.device("cpu"), cfg, M.RowLayout()).policy
    wrapped = [layer.forward.__qualname__.startswith("_checkpointed") for layer in sharding.decoder_layers(compiled)]
    assert wrapped == [mode == "full"] * 2


def test_attention_dropout_is_refused_at_load(tmp_path):
    import json
    path = F.build_tiny(tmp_path / "tiny", seed=0)
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["attention_dropout"] = 0.1
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"attention_dropout=0\.1") as e:
        M.load_model(str(path))
    assert "\n" not in str(e.value)


def test_packed_rows_equal_one_row_per_episode(tiny):
    """train.share_prompt: one row per prompt with its responses after it; each response sees
    the prompt and itself only, continues the prompt's mRoPE positions, and its logprobs,
    entropies and gradients equal the one-row-per-episode forward (and the engine's)."""
    path, procs = tiny
    tokens = procs.tokens
    engine = HF.HFEngine(path, torch.float32, procs, torch.device("cpu"))
    problems = synthetic.make_synthetic(3, seed=5)
    prompts = [(I.prompt_ids(procs, data.user_text(p) * (1 + i), 1), p.images)
               for i, p in enumerate(problems)]            # prompts of different lengths
    out = engine.generate(prompts, E.Sampling(n=3, max_new_tokens=10), seed=2)
    eps = [E.Episode(p.index, g, prompts[g][0], c.ids, c.logprobs, 0.0, {}, 0, c.truncated)
           for g, (p, cs) in enumerate(zip(problems, out)) for c in cs]
    images = [problems[e.group].images for e in eps]
    packed = I.collate(eps, images, procs, torch.device("cpu"), M.RowLayout(share_prompt=True), {})
    flat = I.collate(eps, images, procs, torch.device("cpu"))
    assert packed.input_ids.shape[0] == 3 and flat.input_ids.shape[0] == 9
    assert int(packed.episode_tokens) == int(flat.attention_mask.sum())
    # the mask: response 2 of row 0 sees the prompt and itself, not response 1
    m, plen = packed.packed.mask_4d[0, 0], int(packed.packed.prompt_len[0])
    s1, n1 = plen, len(eps[0].response_ids)
    s2 = s1 + n1
    assert m[s2, :plen].all() and not m[s2, s1:s2].any() and m[s2, s2] and not m[s2, s2 + 1]
    assert m[plen - 1, :plen].all() and not m[plen - 2, plen - 1]          # causal prompt
    # positions: a response continues from the prompt, as in its own row
    model = M.load_model(path).train()
    pos = M.packed_positions(model, packed, tokens)
    own, _ = model.model.get_rope_index(flat.input_ids[1:2], (flat.input_ids[1:2] == tokens.image_pad).int(),
                                        image_grid_thw=flat.image_grid_thw[1:2],
                                        attention_mask=flat.attention_mask[1:2])
    n2 = len(eps[1].response_ids)
    assert torch.equal(pos[:, 0, s2:s2 + n2], own[:, 0, plen:plen + n2])
    lp, ent = M.sequence_logprobs(model, packed, tokens, 1.0)
    flp, fent = M.sequence_logprobs(model, flat, tokens, 1.0)
    pm, fm = packed.response_mask.bool(), flat.response_mask.bool()
    torch.testing.assert_close(lp[pm], flp[fm], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[pm], fent[fm], atol=1e-5, rtol=0)
    assert float((lp[pm] - packed.engine_logprobs[pm]).abs().max()) <= 1e-4
    g1 = torch.autograd.grad(lp[pm].sum(), list(model.parameters()))
    g2 = torch.autograd.grad(flp[fm].sum(), list(model.parameters()))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------- images and text mixed
@pytest.mark.parametrize("layout", [M.RowLayout(), M.RowLayout(share_prompt=True),
                                    M.RowLayout("segments", True)])
def test_a_text_only_micro_batch_runs_the_vision_tower_on_a_blank_image_and_changes_nothing(tiny, layout):
    """A micro-batch without images whose peers' may show some (inputs.collate's `vision`): the
    vision tower runs once on a blank image, in every layout, so its rank makes the tower's FSDP
    collectives as a peer with images does; the logprobs and every gradient are bit for bit those
    without it, the tower's weights getting exact zeros (a gradient, which FSDP reduces, where
    they had none)."""
    path, procs = tiny
    allowed = [i for i in range(procs.tokens.vocab_size) if i not in procs.tokens.suppressed]
    g = torch.Generator().manual_seed(1)
    eps = [E.Episode(i, i // 2, I.prompt_ids(procs, f"What is {i // 2} + 2?", 0),
                     [allowed[j] for j in torch.randint(len(allowed), (5 + i,), generator=g)],
                     [0.0] * (5 + i), 0.0, {}, 0, False) for i in range(4)]
    model = M.load_model(path)
    model.set_attn_implementation(M.attention_for(layout.packed))
    calls = []
    for unit in sharding.fsdp_units(model):  # decoder layers and vision blocks
        unit.register_forward_hook(lambda m, a, o: calls.append(m))
    runs = {}
    for vision in (False, True):
        batch = I.collate(eps, [[]] * len(eps), procs, CPU, layout, vision=vision)
        assert batch.pixel_values is None and (batch.blank_image is not None) is vision
        calls.clear()
        model.zero_grad(set_to_none=True)
        lp, ent = M.sequence_logprobs(model, batch, procs.tokens, 1.0, entropy_grad=True)
        (lp.sum() + ent.sum()).backward()
        runs[vision] = (len(calls), lp.detach(), {n: p.grad for n, p in model.named_parameters()})
    (n_plain, lp_plain, plain), (n_blank, lp_blank, blank) = runs[False], runs[True]
    tower = {n for n, grad in plain.items() if grad is None}
    assert tower and n_plain < n_blank == len(sharding.fsdp_units(model))  # once each: the tower ran
    assert torch.equal(lp_blank, lp_plain)
    for n, grad in blank.items():
        assert grad is not None, n  # every weight joins the backward: FSDP reduces every one
        assert torch.equal(grad, torch.zeros_like(grad) if n in tower else plain[n]), n
    # a micro-batch with an image of its own carries none
    problem = synthetic.make_synthetic(1, seed=5)[0]
    e = E.Episode(problem.index, 0, I.prompt_ids(procs, data.user_text(problem), 1), [allowed[0]] * 3,
                  [0.0] * 3, 0.0, {}, 0, False)
    assert I.collate([e], [problem.images], procs, CPU, layout, vision=True).blank_image is None


@pytest.mark.slow  # inductor compiles two layers, forward and backward (~a minute on 2 cores);
@pytest.mark.parametrize("checkpointing", ["off", "full"])  # selective: tests/test_sharding.py
def test_compiled_decoder_layers_give_the_same_logprobs_and_gradients(tiny, one_rank_world, checkpointing):
    """model.compile: each decoder layer under torch.compile (inductor), with its checkpoint inside
    (sharding.apply_fsdp), sharded as usual; the logprobs and gradients equal the eager policy's
    with the same checkpointing (transformers')."""
    import config as C
    import trainer as T
    path, procs = tiny
    batch, runs = _batch(tiny), []
    for compiled in (True, False):
        mc = C.ModelConfig(compile=compiled, activation_checkpointing=checkpointing)
        tr = T.build(path, one_rank_world, torch.device("cpu"), C.Config(model=mc), M.RowLayout())
        layers = sharding.decoder_layers(tr.policy)
        assert len(layers) == 2 and all((u._compiled_call_impl is not None) == compiled for u in layers)
        lp, _ = M.sequence_logprobs(tr.policy, batch, procs.tokens, 1.0)
        (lp * batch.response_mask).sum().backward()
        runs.append((lp.detach(), [p.grad.full_tensor() for p in tr.policy.parameters()]))
    torch.testing.assert_close(runs[0][0], runs[1][0], atol=1e-5, rtol=0)
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
