"""train.packing: sequences of different prompts side by side in rows (inputs.pack, planned by
microbatches.plan_share, ranks balanced by microbatches.rank_shares) give the loss and every
gradient of unpacked rows, for every family that packs exactly, each aggregation, LoRA and the
KL; a linear-attention family packs one sequence per episode, each from a zero state (the leak
that once made it refuse packing is gone), and "varlen" hands flash-attention its boundaries."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import data
import families as F
import inputs as I
import lora
import microbatches as MB
import model as M
import hf_engine as HF
import episode as E
import synthetic
import update as U
from errors import ConfigError
from tests.util import TINY, layout_of, metrics, torchrun
from train import load_config

CPU = torch.device("cpu")
PACKING = list(F.FAMILIES)  # linear attention too: one sequence per episode, each from zero
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


LONG = 300  # one response this long: rows as wide as it hold several of the others


def _episodes(path: str, vision: bool):
    """Four prompts of two lengths x 4 sampled responses of varied lengths, the first one
    stretched to LONG tokens (long-tailed, as GRPO's are)."""
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    problems = (synthetic.make_synthetic(4, seed=3) if vision
                else synthetic.make_synthetic_text(4, seed=3))
    prompts = [(I.prompt_ids(procs, data.user_text(p) * (1 + i % 2), len(p.images)), p.images)
               for i, p in enumerate(problems)]
    engine = HF.HFEngine(path, torch.float32, procs, CPU)
    out = engine.generate(prompts, E.Sampling(n=4, max_new_tokens=12), seed=1)
    eps = [E.Episode(p.index, g, prompts[g][0], c.ids, c.logprobs, float(sum(c.ids) % 5), {}, 0,
                     c.truncated) for g, (p, cs) in enumerate(zip(problems, out)) for c in cs]
    for i, e in enumerate(eps[1:], 1):                        # a random tiny model never stops
        n = 2 + (7 * i) % 11
        e.response_ids, e.logprobs = e.response_ids[:n], e.logprobs[:n]
    e = eps[0]
    reps = -(-LONG // len(e.response_ids))
    e.response_ids, e.logprobs = (e.response_ids * reps)[:LONG], (e.logprobs * reps)[:LONG]
    return procs, eps, {p.index: p.images for p in problems}


def _attend(layout, *models) -> None:
    """The attention the trainer builds its models with for `layout` (model.attention_for)."""
    name = M.attention_for(layout.packed)
    for m in models:
        if m is not None:
            m.set_attn_implementation(name)


def _grads(policy, ref, procs, eps, images, over: list[str]):
    cfg = load_config(None, [f"--rollout.max_new_tokens={LONG}", *over])
    layout = layout_of(cfg.train, procs)
    _attend(layout, policy, ref)
    policy.zero_grad(set_to_none=True)
    tr = SimpleNamespace(policy=policy, ref=ref, base_ref=False, teacher=None, base_teacher=False,
                         replay_ref=False, device=CPU, pixels={}, kl_coef=None, version=0, layout=layout)
    world = SimpleNamespace(trainers=[0], trainer_index=0, train_group=dist.group.WORLD)
    s = U.Step(tr, world, procs, cfg.train, cfg.loss, cfg.rollout, 0, 0, eps, images)
    U.plan(s)
    U.denominators(s)
    U.advantages(s)
    stats = U.accumulate_gradients(s, s.updates[0])
    return stats, {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}


def _compare(policy, ref, procs, eps, images, over):
    flat, g_flat = _grads(policy, ref, procs, eps, images, over + ["--train.share_prompt=false"])
    for layout in (["--train.share_prompt=false"], ["--train.share_prompt=true"]):
        packed, g = _grads(policy, ref, procs, eps, images,
                           over + layout + ["--train.packing=true", "--train.micro_batch_tokens=100000"])
        assert packed["loss"] == pytest.approx(flat["loss"], abs=1e-5, rel=1e-5)
        assert packed["micro_batches"] == 1 and packed["slots"] < flat["slots"]
        assert packed["slots"] == packed["tokens"] and packed["pairs"] < flat["pairs"]  # no padding
        assert set(g) == set(g_flat) and g_flat
        for n in g:
            torch.testing.assert_close(g[n], g_flat[n], atol=1e-5, rtol=1e-4, msg=n)
    return flat


@pytest.mark.slow
@pytest.mark.parametrize("family", PACKING)
def test_packed_rows_give_the_loss_and_gradient_of_unpacked_rows(family, tiny_dir, gloo_world):
    path = tiny_dir(family)
    procs, eps, images = _episodes(path, F.is_vlm(M.load_config(path)))
    policy = M.load_model(path)
    lens = {len(e.response_ids) for e in eps}
    assert len(lens) > 2                                  # varied lengths: rows really combine
    for agg in AGGS:
        _compare(policy, None, procs, eps, images, [f"--loss.aggregation={agg}", "--loss.kl_coef=0"])
    ref = M.load_model(path)                              # the KL to a reference that differs
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    ref.requires_grad_(False)
    _compare(policy, ref.eval(), procs, eps, images, ["--loss.kl_coef=0.1"])


@pytest.mark.slow
def test_packed_rows_with_lora(tiny_dir, gloo_world):
    path = tiny_dir("qwen2_5_vl")
    procs, eps, images = _episodes(path, True)
    cfg = load_config(None, ["--model.lora_rank=4"])
    policy = lora.add_lora(M.load_model(path), cfg.model, seed=0)
    with torch.no_grad():                                  # B = 0 at init: give the adapters weight
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    _compare(policy, None, procs, eps, images, ["--model.lora_rank=4", "--loss.kl_coef=0"])


def test_plan_fills_micro_batches_to_the_budget_and_ranks_balance_by_tokens():
    """Long-tailed lengths: first-fit decreasing fills each micro-batch (one packed row) up to
    the token budget, a longer sequence alone; balanced ranks within 5% of the mean."""
    lens = [256, 30, 8, 200, 60, 12, 250, 40]
    rows = I.first_fit(lens, 300)
    assert all(sum(lens[i] for i in r) <= 300 for r in rows)
    assert sorted(i for r in rows for i in r) == list(range(8)) and len(rows) == 3
    assert I.first_fit([500, 20], 300) == [[0], [1]]
    lengths = [256 if i % 10 == 0 else 8 + (i * 7) % 25 if i % 2 else 40 + i * 3 for i in range(64)]
    parts = MB._balance(lengths, 2)
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert [len(p) for p in parts] == [32, 32] and max(loads) / (sum(loads) / 2) <= 1.05


def test_auto_packs_only_where_the_layout_was_measured_faster(tiny_dir, monkeypatch):
    """train.packing = "auto" (the default): on for the CPU's kernel; on CUDA on only when
    micro-batches are counted in rows (there it was measured faster than padded micro-batches,
    slower than length-sorted ones of a token budget); off on NPU (its varlen layout has not run
    on hardware); off for an environment whose turns show images (one row per episode); each
    decision is one start-up line, the config left as written."""
    import envs
    path = tiny_dir("qwen2_5_vl")
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    npu = SimpleNamespace(type="npu")  # torch.device cannot name an NPU without torch_npu
    for device, over, on, why in (
            (CPU, [], True, "cpu's segments layout, measured faster"),
            (CPU, ["--train.micro_batch_tokens=4096"], True, "cpu's segments layout, measured faster"),
            (torch.device("cuda"), [], True, "cuda's segments layout, measured faster than padded "
                                             "micro-batches of micro_batch_size rows"),
            (torch.device("cuda"), ["--train.micro_batch_tokens=4096"], False,
             "cuda's segments layout measured slower than length-sorted micro-batches"),
            (npu, [], False, "npu's varlen layout has not run on hardware")):
        tc = load_config(None, over).train
        layout, [line] = MB.resolve_layout(tc, procs, path, device)
        assert (layout.packed is not None) is on and line.startswith(f"train.packing {'on' if on else 'off'} (auto: {why}")
        assert tc.packing == "auto" and layout.share_prompt
    monkeypatch.setitem(envs.REGISTRY, "shows_images", type("E", (), {"images_per_episode": 1}))
    tc = load_config(None, []).train
    layout, [line] = MB.resolve_layout(tc, procs, path, CPU, "shows_images")
    assert "turns show images" in line and layout.packed is None and tc.packing == "auto"


def test_a_layout_can_be_named(tiny_dir, monkeypatch):
    """train.packing = "segments" / "varlen" packs with that layout on any device (true: the
    device's own); a linear-attention model packs with either, one sequence per episode; an
    unknown value is one config error naming the key."""
    qwen = tiny_dir("qwen2_5_vl")
    vl_procs = I.load_processors(qwen, 56 * 56, 112 * 112)
    monkeypatch.setattr(MB, "find_spec", lambda name: True)  # varlen's package: looked at below
    for value, device, packed in (("segments", torch.device("cuda"), "segments"),
                                  ("varlen", CPU, "varlen"), ("true", torch.device("cuda"), "segments"),
                                  ("true", CPU, "segments"), ("false", CPU, None)):
        tc = load_config(None, [f"--train.packing={value}"]).train
        assert MB.resolve_layout(tc, vl_procs, qwen, device) == (M.RowLayout(packed, True), [])
    assert M.attention_for("varlen") == "flash_attention_2"
    linear = next(f for f, fam in F.FAMILIES.items() if fam.linear_attention)
    path = tiny_dir(linear)
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    for value in ("segments", "true"):
        layout, [note] = MB.resolve_layout(load_config(None, [f"--train.packing={value}"]).train,
                                           procs, path, CPU)
        assert layout == M.RowLayout("segments", False) and "one sequence per episode" in note
    with pytest.raises(ConfigError, match="train.packing: unknown 'dense' \\(known: true, false, auto, "
                                          "segments, varlen\\)"):
        load_config(None, ["--train.packing=dense"])
    # varlen runs under flash_attention_2: without flash-attn one config error at start, not
    # transformers' traceback at the model's build; on NPU torch_npu's op needs none
    monkeypatch.setattr(MB, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="needs the flash_attn package on cpu .*\"segments\" packs"):
        MB.resolve_layout(load_config(None, ["--train.packing=varlen"]).train, vl_procs, qwen, CPU)
    npu = SimpleNamespace(type="npu")
    assert MB.resolve_layout(load_config(None, ["--train.packing=true"]).train, vl_procs, qwen, npu) == (
        M.RowLayout("varlen", True), [])


def test_a_linear_attention_family_packs_each_sequence_from_a_zero_state(tiny_dir, gloo_world):
    """Qwen3.5 packs (auto and true): one sequence per episode; in a row where sequences follow
    one another each one's logprobs equal it alone (its recurrent state and short convolution
    start at its first token), as they do for a family that packs exactly; without the boundary
    (the plain mixer) the leak is real, which is what this test would catch."""
    linear = next(f for f, fam in F.FAMILIES.items() if fam.linear_attention)
    path = tiny_dir(linear)
    procs, eps, images = _episodes(path, F.is_vlm(M.load_config(path)))
    tc = load_config(None, ["--train.packing=true", "--train.micro_batch_tokens=4096"]).train
    assert MB.resolve_layout(tc, procs, path, CPU)[0] == M.RowLayout("segments", False)
    auto = load_config(None, []).train                    # the default: on for it, as for the others
    layout, notes = MB.resolve_layout(auto, procs, path, CPU)
    assert notes[0].startswith("train.packing on (auto:") and layout == M.RowLayout("segments", False)
    assert _packed_gap(path, procs, eps, images) < 1e-5
    exact = tiny_dir("qwen3")
    assert _packed_gap(exact, *_episodes(exact, False)) < 1e-5
    assert _packed_gap(path, procs, eps, images, _without_boundaries(path)) > 1e-3


# Odd sizes the tiny builder's defaults never take: an odd hidden size, intermediate size and
# number of attention heads; odd linear-attention head counts, key and value head dims and
# convolution width (families.build_tiny's `sizes`; head_dim stays 32: the rotary sections)
ODD = dict(num_attention_heads=3, num_key_value_heads=1, intermediate_size=97,
           linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=15,
           linear_value_head_dim=13, linear_conv_kernel_dim=3)


@pytest.mark.slow
def test_an_odd_sized_linear_attention_model_packs(tmp_path, gloo_world):
    """A tiny Qwen3.5 of odd sizes, responses of odd lengths: packed rows (a sequence following
    another in a row) give each sequence's logprobs alone, and the loss and gradients of
    unpacked rows (1e-5); its mixers without the boundaries leak (what the check would catch)."""
    linear = next(f for f, fam in F.FAMILIES.items() if fam.linear_attention)
    path = str(F.build_tiny(tmp_path / "odd", hidden=75, model_type=linear, sizes=ODD))
    text = M.load_config(path).text_config
    assert all(getattr(text, k) == v for k, v in ODD.items()) and text.hidden_size == 75
    procs, eps, images = _episodes(path, True)
    for e in eps:                                         # odd lengths: 1 to 11 tokens, and 299
        n = len(e.response_ids) - 1 + len(e.response_ids) % 2
        e.response_ids, e.logprobs = e.response_ids[:n], e.logprobs[:n]
    assert all(len(e.response_ids) % 2 == 1 for e in eps) and len({len(e.response_ids) for e in eps}) > 4
    assert _packed_gap(path, procs, eps, images) < 1e-5
    _compare(M.load_model(path), None, procs, eps, images, ["--loss.kl_coef=0"])
    assert _packed_gap(path, procs, eps, images, _without_boundaries(path)) > 1e-3


def _without_boundaries(path: str):
    """The model at `path` with its linear-attention mixers' plain forwards (no boundaries)."""
    plain = M.load_model(path)
    M.bind_sequences(plain)
    for m in plain.modules():
        mixer = getattr(m, F.LINEAR_ATTENTION_MODULE, None)
        if mixer is not None:
            mixer.forward = mixer._grpo_forward
    return plain


def _packed_gap(path, procs, eps, images, policy=None) -> float:
    """Largest |logprob packed - logprob alone| over the response tokens of `eps`."""
    policy = (policy or M.load_model(path)).eval()
    with torch.no_grad():
        both = I.collate(eps, [images[e.index] for e in eps], procs, CPU, M.RowLayout("segments"))
        policy.set_attn_implementation(M.attention_for("segments"))
        lp = M.sequence_logprobs(policy, both, procs.tokens, 1.0)[0]
        policy.set_attn_implementation("sdpa")
        assert both.input_ids.shape[0] < len(eps)             # rows hold several sequences
        gap = 0.0
        for i, e in enumerate(eps):
            one = I.collate([e], [images[e.index]], procs, CPU)
            alone = M.sequence_logprobs(policy, one, procs.tokens, 1.0)[0][one.response_mask.bool()]
            gap = max(gap, float((lp[i, :len(e.response_ids)] - alone).abs().max()))
    return gap


@pytest.mark.slow
def test_demo_learns_with_packing_and_two_trainer_ranks(tmp_path):
    """Two trainer ranks: the first step's loss and gradient norm equal unpacked rows', the
    engine parity holds, and the demo learns as it does without packing."""
    runs = {}
    for name, extra in (("flat", ["--train.packing=false"]), ("packed", ["--train.packing=true", "--train.micro_batch_tokens=2048"])):
        out = tmp_path / name
        torchrun(3, [*TINY, f"--run.out_dir={out}", "--run.steps=12", "--run.keep_last=0", *extra])
        runs[name] = metrics(out)
    flat, packed = runs["flat"], runs["packed"]
    for k in ("loss", "grad_norm"):
        assert packed[1][k] == pytest.approx(flat[1][k], rel=1e-4, abs=1e-6), k
    assert all(r["logprob_diff/max"] <= 1e-4 for r in packed)
    assert all(r["train/rank_token_imbalance"] >= 1.0 for r in packed)
    assert packed[-1]["reward/mean"] > 0.3 and flat[-1]["reward/mean"] > 0.3


def test_the_kernels_pair_count_is_what_it_computes():
    """attention.pairs (train/attention_frac): spans (a prompt and its first response) in buckets
    of similar length, each span as long as its bucket's longest, then each further response
    over its prompt and itself."""
    import attention as A
    assert A.buckets([10, 30, 11, 12, 40, 13]) == [[0, 2, 3], [5], [1], [4]]
    row = [(0, 4, [(4, 2), (6, 3)]), (9, 5, [(14, 1)]), (15, 20, [(35, 10)])]  # spans 6, 6, 30
    p = A.plan([row], 47, CPU)                      # the row's last 2 columns unused
    assert A.pairs(p) == 2 * 6 ** 2 + 30 ** 2 + 3 * (4 + 3)
    # the calls: spans 0-5 and 9-14 batched (6 wide), 15-44 alone, then the further response
    # 6-8 over its prompt (keys 0-3, then 6-8)
    assert [c.q.tolist() for c in p.calls[0]] == [[list(range(6)), list(range(9, 15))],
                                                  [list(range(15, 45))], [[6, 7, 8]]]
    assert p.calls[0][2].k.tolist() == [[0, 1, 2, 3, 6, 7, 8]] and p.calls[0][0].mask is None
    # each column's output in the calls' outputs concatenated; unused columns: the zero row (45)
    assert p.where[0].tolist() == [*range(6), 42, 43, 44, *range(6, 12), *range(12, 42), 45, 45]


def _each_alone(policy, lp, procs, eps, images) -> None:
    """`lp` (a packed row's logprobs, episode-major) equals each episode's own row's."""
    for i, e in enumerate(eps):
        one = I.collate([e], [images[e.index]], procs, CPU)
        alone = M.sequence_logprobs(policy, one, procs.tokens, 1.0)[0][one.response_mask.bool()]
        torch.testing.assert_close(lp[i, :len(e.response_ids)], alone, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3"])
def test_the_cpu_kernel_computes_each_sequence_alone_without_a_mask(family, tiny_dir, gloo_world):
    """device.Device.packed_attention = "segments" (the CPU's): every sequence of a micro-batch
    in one row with shared prompts and no padding, attention.py's kernel computing each prompt
    causally and each response over its prompt and itself: the logprobs equal each episode's
    alone, with fewer query-key pairs than one dense row per prompt; a model built with plain
    SDPA refuses such a batch instead of attending across sequences."""
    path = tiny_dir(family)
    procs, eps, images = _episodes(path, F.is_vlm(M.load_config(path)))
    policy = M.load_model(path).eval()
    with torch.no_grad():
        row = I.collate(eps, [images[e.index] for e in eps], procs, CPU, M.RowLayout("segments", True))
        dense = I.collate(eps, [images[e.index] for e in eps], procs, CPU, M.RowLayout(share_prompt=True))
        assert row.input_ids.shape[0] == 1 and row.packed.mask_4d is None
        assert int(row.attention_mask.sum()) == row.input_ids.numel()   # no padding at all
        assert int(row.attention_pairs) < int(dense.attention_pairs)
        with pytest.raises(ValueError, match="attn_implementation='grpo_segments'"):
            M.sequence_logprobs(policy, row, procs.tokens, 1.0)
        policy.set_attn_implementation(M.attention_for("segments"))
        lp = M.sequence_logprobs(policy, row, procs.tokens, 1.0)[0]
        policy.set_attn_implementation("sdpa")
        _each_alone(policy, lp, procs, eps, images)


def test_a_wider_bucket_ratio_makes_fewer_calls_and_the_same_logprobs_and_gradients(
        tiny_dir, gloo_world, monkeypatch):
    """CUDA's bucket ratio (device.Device.bucket_ratio 4: fewer, wider calls, the accelerator
    being bound by the calls it launches) on the CPU: fewer calls and more computed pairs than
    the CPU's 1.25, the same logprobs as each episode alone, the same gradients."""
    from dataclasses import replace

    import device as D
    path = tiny_dir("qwen2_5_vl")
    procs, eps, images = _episodes(path, True)
    policy = M.load_model(path)
    policy.set_attn_implementation(M.attention_for("segments"))
    runs = {}
    for ratio in (1.25, D.TABLE["cuda"].bucket_ratio):
        monkeypatch.setitem(D.TABLE, "cpu", replace(D.TABLE["cpu"], bucket_ratio=ratio))
        row = I.collate(eps, [images[e.index] for e in eps], procs, CPU, M.RowLayout("segments", True))
        calls = sum(len(r) for r in row.packed.plan.calls)  # the plan the forward runs
        policy.zero_grad(set_to_none=True)
        lp = M.sequence_logprobs(policy, row, procs.tokens, 1.0)[0]
        (lp * row.response_mask).sum().backward()
        runs[ratio] = (calls, int(row.attention_pairs), lp.detach(),
                       {n: q.grad.clone() for n, q in policy.named_parameters() if q.grad is not None})
    (c1, p1, lp1, g1), (c4, p4, lp4, g4) = runs.values()
    assert c4 < c1 and p4 > p1
    torch.testing.assert_close(lp4, lp1, atol=1e-5, rtol=1e-4)
    for n, g in g1.items():
        torch.testing.assert_close(g4[n], g, atol=1e-5, rtol=1e-4, msg=n)
    policy.set_attn_implementation("sdpa")
    _each_alone(policy, lp4, procs, eps, images)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3"])
def test_varlen_rows_need_no_mask(family, tiny_dir, gloo_world):
    """The accelerators' layout (device.Device.packed_attention = "varlen"): every sequence of a
    micro-batch in one row with no mask, positions restarting per sequence (with the text row a
    VL model finds packed sequences by); transformers' SDPA finds them the same way on the CPU,
    so the logprobs equal each sequence's alone."""
    path = tiny_dir(family)
    procs, eps, images = _episodes(path, F.is_vlm(M.load_config(path)))
    policy = M.load_model(path).eval()
    with torch.no_grad():
        row = I.collate(eps, [images[e.index] for e in eps], procs, CPU, M.RowLayout("varlen", True))
        assert row.input_ids.shape[0] == 1 and row.packed.mask_4d is None
        assert int(row.attention_mask.sum()) == row.input_ids.numel()   # no padding at all
        lp = M.sequence_logprobs(policy, row, procs.tokens, 1.0)[0]
        _each_alone(policy, lp, procs, eps, images)


@pytest.mark.slow
def test_packing_with_every_option_equals_unpacked(tmp_path):
    """Several updates per batch (the proximal pass), the KL reference in the reward and the
    loss, DAPO's masked groups and activation checkpointing: the first step equals unpacked."""
    opts = ["--train.mini_batches=2", "--train.ppo_epochs=2", "--loss.kl_coef=0.05",
            "--loss.kl_target=0.01", "--loss.drop_zero_variance=true", "--rollout.max_refill_rounds=0",
            "--model.activation_checkpointing=true", "--train.micro_batch_tokens=2048"]
    runs = {}
    for name, extra in (("flat", ["--train.packing=false"]), ("packed", ["--train.packing=true"])):
        out = tmp_path / name
        torchrun(3, [*TINY, f"--run.out_dir={out}", "--run.steps=3", "--run.keep_last=0", *opts, *extra])
        runs[name] = metrics(out)
    for k in ("loss", "grad_norm", "kl", "train/approx_kl", "train/kl_coef"):
        assert runs["packed"][0][k] == pytest.approx(runs["flat"][0][k], rel=1e-4, abs=1e-7), k
    assert runs["packed"][0]["train/updates"] == 4


def test_varlen_boundaries_are_transformers_own_and_reach_every_attention_call(tiny_dir, gloo_world):
    """Issue 52 V2: a "varlen" micro-batch carries flash-attention's kwargs (model.Packed.fa_kwargs,
    built once by inputs.pack): equal to transformers' own helper's from the position ids (which
    it would otherwise rerun, with a host sync, in every layer; max lengths plain ints), and handed
    to every text attention call (recorded by an attention function registered with transformers)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    seen = []

    def record(module, q, k, v, attention_mask=None, **kw):
        if getattr(module, "is_causal", False):
            seen.append({n: kw.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")})
        kw = {n: x for n, x in kw.items() if not n.startswith(("cu_seq", "max_length"))}
        return sdpa_attention_forward(module, q, k, v, attention_mask, **kw)
    AttentionInterface.register("grpo_test_record", record)
    for family in ("qwen3", "qwen2_5_vl"):
        path = tiny_dir(family)
        procs, eps, images = _episodes(path, F.is_vlm(M.load_config(path)))
        batch = I.collate(eps, [images[e.index] for e in eps], procs, CPU, M.RowLayout("varlen"))
        policy = M.load_model(path).eval()
        pos = M.packed_positions(policy, batch, procs.tokens)
        (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(pos[0] if pos.dim() == 3 else pos)
        fa = batch.packed.fa_kwargs
        assert batch.input_ids.shape[0] == 1 and len(fa["cu_seq_lens_q"]) == len(eps) + 1
        assert torch.equal(fa["cu_seq_lens_q"], cu_q) and torch.equal(fa["cu_seq_lens_k"], cu_k)
        assert (fa["max_length_q"], fa["max_length_k"]) == (int(max_q), int(max_k))
        assert type(fa["max_length_q"]) is int
        seen.clear()
        policy.set_attn_implementation("grpo_test_record")
        with torch.no_grad():
            M.sequence_logprobs(policy, batch, procs.tokens, 1.0)
        layers = M.text_config(policy.config).num_hidden_layers
        assert len(seen) == layers and all(s == fa for s in seen), (family, len(seen))


@pytest.mark.slow
def test_linear_attention_packing_survives_activation_checkpointing(tiny_dir):
    """The recomputation in the backward (inside the decoder layer's own forward in transformers
    5.24) runs each packed sequence alone as the forward did: logprobs and every gradient equal
    those without checkpointing."""
    path = tiny_dir(next(f for f, fam in F.FAMILIES.items() if fam.linear_attention))
    procs, eps, images = _episodes(path, F.is_vlm(M.load_config(path)))
    batch = I.collate(eps, [images[e.index] for e in eps], procs, CPU, M.RowLayout("segments"))
    out = []
    for checkpointing in (False, True):
        policy = M.load_model(path).train()
        _attend(M.RowLayout("segments"), policy)
        if checkpointing:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lp = M.sequence_logprobs(policy, batch, procs.tokens, 1.0)[0]
        lp.sum().backward()
        out.append((lp.detach(), {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(out[1][0], out[0][0], atol=1e-6, rtol=0)
    assert set(out[0][1]) == set(out[1][1]) and out[0][1]
    for n, g in out[0][1].items():
        torch.testing.assert_close(out[1][1][n], g, atol=1e-6, rtol=1e-5, msg=n)
