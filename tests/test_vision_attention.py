"""attention.one_call_vision: a vision block's windows (or images) in one attention call, exact
against transformers' one call per window, for every vision-language family."""
from __future__ import annotations

import pytest
import torch

import attention as A
import families as F
import model as M

VLMS = [t for t in F.FAMILIES if F.get(t).processor]


def _pixels(model, grids: list[tuple[int, int, int]], seed: int = 0):
    vc = model.config.vision_config
    dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    g = torch.Generator().manual_seed(seed)
    rows = sum(t * h * w for t, h, w in grids)
    return torch.randn(rows, dim, generator=g), torch.tensor(grids)


def _features(model, pixels, grid):
    out = model.get_image_features(pixels, image_grid_thw=grid)
    out = out.pooler_output if hasattr(out, "pooler_output") else out
    return torch.cat(list(out)) if isinstance(out, (list, tuple)) else out


@pytest.mark.parametrize("t", VLMS)
def test_one_call_per_block_equals_one_call_per_window(tmp_path, t):
    """Two images of different sizes (several windows each for a windowed tower, edge windows
    shorter): the features equal transformers' own to 1e-6 (fp32), every vision weight's
    gradient to 1e-6 of its largest entry, with one attention call per block."""
    model = M.load_model(str(F.build_tiny(tmp_path / t, model_type=t))).train()
    pixels, grid = _pixels(model, [(1, 16, 12), (1, 8, 20)])
    want = _features(model, pixels, grid)
    weights = [p for n, p in model.named_parameters() if "visual" in n]
    g_want = torch.autograd.grad(want.square().sum(), weights, allow_unused=True)  # deepstack's: unused
    assert A.one_call_vision(model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = _features(model, pixels, grid)
    calls = sum(e.name == "aten::scaled_dot_product_attention" for e in prof.events())
    assert calls == len(F.vision_attentions(model)) == model.config.vision_config.depth
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    g_got = torch.autograd.grad(got.square().sum(), weights, allow_unused=True)
    assert sum(g is not None for g in g_want) > 0
    for a, b in ((a, b) for a, b in zip(g_got, g_want) if b is not None or a is not None):  # sums over every row: 1e-6 of the gradient's scale
        torch.testing.assert_close(a, b, atol=1e-6 * float(b.abs().max()), rtol=0)


def test_windows_pads_to_the_longest_and_puts_each_row_back():
    w = A.windows([0, 4, 4, 6, 9], torch.device("cpu"))  # an empty window is dropped
    assert w.idx.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [6, 7, 8, 8]]  # past a window: masked
    assert w.keep[:, 0, 0].tolist() == [[True] * 4, [True, True, False, False], [True, True, True, False]]
    assert w.where.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10]
    assert A.windows([0, 7], torch.device("cpu")).idx is None


def test_a_varlen_kernel_gets_the_bounds_and_the_longest_window(tmp_path, monkeypatch):
    """Where the device has a varlen kernel (CUDA, half precision: device.varlen_attention) the
    block's one call is that kernel's, given every window's bounds and the longest; here a
    reference kernel (one SDPA per sequence) stands in for it, and the features are unchanged."""
    import device as D
    model = M.load_model(str(F.build_tiny(tmp_path / "t"))).train()
    pixels, grid = _pixels(model, [(1, 16, 12), (1, 8, 20)])
    want = _features(model, pixels, grid)
    seen = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k):
        seen.append((cu_q.tolist(), max_q))
        assert cu_q is cu_k and max_q == max_k and cu_q.dtype == torch.int32
        b = cu_q.tolist()
        return torch.cat([torch.nn.functional.scaled_dot_product_attention(
            *(t[s:e].transpose(0, 1) for t in (q, k, v))).transpose(0, 1) for s, e in zip(b, b[1:])])
    monkeypatch.setattr(D, "varlen_attention", lambda device_type, dtype: kernel)
    assert A.one_call_vision(model)
    got = _features(model, pixels, grid)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    windowed = [s for s in seen if len(s[0]) > 3]
    assert windowed and all(m == max(b - a for a, b in zip(c, c[1:])) for c, m in seen)


# --------------------------------------------------------------------- the trainer places the images
def _episodes_of(path: str, n: int = 3):
    import data
    import episode as E
    import inputs as I
    import synthetic
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    problems = synthetic.make_synthetic(n, seed=5)
    g = torch.Generator().manual_seed(0)
    allowed = [i for i in range(procs.tokens.vocab_size) if i not in procs.tokens.suppressed]
    eps = []
    for i, p in enumerate(problems):
        for r in range(2):  # two responses a prompt: a shared prompt's row holds both
            resp = [allowed[j] for j in torch.randint(len(allowed), (5 + i + r,), generator=g)]
            eps.append(E.Episode(p.index, i, I.prompt_ids(procs, data.user_text(p) * (1 + i), 1), resp,
                                 [0.0] * len(resp), 0.0, {}, 0, True))
    return procs, eps, [problems[e.group].images for e in eps]


PLACED = [t for t in VLMS if F.get(t).places_images]


@pytest.mark.parametrize("t", PLACED)
@pytest.mark.parametrize("layout", [M.RowLayout(), M.RowLayout(share_prompt=True),
                                    M.RowLayout(packed="segments", share_prompt=True)])
def test_the_trainer_places_image_features_as_transformers_does(tmp_path, monkeypatch, t, layout):
    """families.places_images: the vision tower's output put at the image tokens by the trainer
    (no get_placeholder_mask, no masked_scatter, the tower's grid tensors from the host, the
    positions from the host) gives transformers' own forward's logprobs, entropies and every
    gradient, to 1e-6 (fp32), in every layout; and its forward + backward makes no host sync
    outside model.HOST_SCOPE."""
    import inputs as I
    path = str(F.build_tiny(tmp_path / t, model_type=t))
    procs, eps, images = _episodes_of(path)
    model = M.load_model(path).train()
    if layout.packed:
        model.set_attn_implementation(M.attention_for(layout.packed))
    assert A.one_call_vision(model)
    if not F.places_images(model):  # e.g. transformers 5.5.4 (the NPU stack): not used there
        pytest.skip("this transformers' vision tower computes its grid tensors itself: the trainer "
                    "keeps the model's own forward (families.places_images)")
    batch = I.collate(eps, images, procs, torch.device("cpu"), layout, {})
    params = [p for p in model.parameters() if p.requires_grad]

    def run():
        lp, ent = M.sequence_logprobs(model, batch, procs.tokens, 0.7, entropy_grad=True)
        return lp, ent, torch.autograd.grad(lp.sum() + 0.01 * ent.sum(), params, allow_unused=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        lp, ent, grads = run()
    monkeypatch.setattr(F, "places_images", lambda m: False)  # transformers' own forward
    want_lp, want_ent, want = run()
    torch.testing.assert_close(lp, want_lp, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-6, rtol=0)
    assert float(lp.detach().abs().sum()) > 0
    for a, b in zip(grads, want):
        assert (a is None) == (b is None)
        if b is not None:
            torch.testing.assert_close(a, b, atol=1e-6 * max(float(b.abs().max()), 1.0), rtol=0)
    syncs = _syncs(prof)
    if batch.packed is not None:  # rows of whole sequences (a 4-D mask, or the segments' plan)
        assert syncs == []
    else:  # right-padded rows: transformers' sdpa mask asks whether any padding is there (2 reads;
        # the frames the profiler names around them differ between torch releases)
        assert 0 < len(syncs) <= 2, syncs


def _syncs(prof) -> list[str]:
    """The host syncs (`.item()` and friends, `nonzero`) outside model.HOST_SCOPE, each as the
    profiler's names of the scopes and Python frames around it."""
    out = []
    for e in prof.events():
        if e.name in ("aten::_local_scalar_dense", "aten::nonzero"):
            p, host, names = e.cpu_parent, False, []
            while p is not None:
                host |= p.name == M.HOST_SCOPE
                names.append(p.name)
                p = p.cpu_parent
            if not host:
                out.append(" < ".join(names))
    return out
