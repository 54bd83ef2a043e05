"""MoE routing replay ("R3"): the trainer routes each token to the experts the engine chose.

The experts a token is routed to in the engine and in the trainer differ under bf16 and kernel
differences, and the policy ratio then compares two different sub-networks. With
`model.moe_routing_replay` the engine's choice travels with the episode (`Episode.routing`) and
the trainer's forwards (proximal pass, updates, reference) use it.

What is replayed: for each response token r_j, the experts of every MoE layer for the token that
PREDICTS it (the last prompt token for r_0, r_{j-1} after): the input whose hidden state gives
r_j's logprob, which is what the engine computed when it sampled r_j. Other prompt tokens (and
the last response token, which predicts nothing) keep the trainer's own routing.
`Episode.routing` is an int tensor [R, L, k] (R response tokens, L MoE layers, k experts per
token; uint8 up to 256 experts, else int16: L * k bytes per token, twice that past 256 experts).

Mechanics: a forward hook on every router module (families.moe_routers, in layer order) reads
the replay tensor of the current forward (set by :func:`replaying` around it, one [N, L, k] row
per flattened input token, -1 = none) and returns the replayed indices with their weights taken
from the router's own softmax at those indices (normalised as the router normalises), so the
gradient still reaches the router; where the engine's choice equals the trainer's the output is
the router's own, bit for bit. The same hook counts, for every token with an engine choice,
whether the trainer's own top-k (as a set) equals it: `train/routing_agreement`, with or
without replay. :func:`capture` records what a transformers generate call routed (the HF engine).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

import families
from errors import ModelError


def expert_dtype(num_experts: int) -> torch.dtype:
    return torch.uint8 if num_experts <= 256 else torch.int16


def _hook(layer: int):
    def hook(module, args, out):
        replay = getattr(module, "_grpo_replay", None)
        if replay is None:
            return None
        own = out[2]                                               # [N, k]
        want = replay[:, layer].to(own.device, torch.long)         # [N, k], -1: no choice
        has = want[:, 0] >= 0
        same = (own.sort(-1).values == want.sort(-1).values).all(-1) & has
        counts = torch.stack([same.sum(), has.sum()])              # stays on the device: no sync
        module._grpo_counts = counts if module._grpo_counts is None else module._grpo_counts + counts
        if not module._grpo_apply:
            return None
        idx = torch.where(has[:, None], want, own)
        h = args[0].reshape(-1, module.weight.shape[-1])
        probs = F.softmax(F.linear(h, module.weight), dtype=torch.float, dim=-1)
        scores = probs.gather(1, idx)
        if families.router_normalizes(module):
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return (out[0], scores.to(out[1].dtype), idx)
    return hook


def attach(model, replay: bool) -> int:
    """Hooks on every router of the trainer's `model` (once), replaying the engine's choice if
    `replay` (`model.moe_routing_replay`), else only counting the agreement; returns how many
    routers it has (0 for a dense model: nothing attached)."""
    routers = families.moe_routers(model)
    for layer, r in enumerate(routers):
        if not hasattr(r, "_grpo_counts"):
            r._grpo_counts = r._grpo_replay = None
            r.register_forward_hook(_hook(layer))
        r._grpo_apply = replay
    return len(routers)


@contextmanager
def replaying(model, routing: torch.Tensor | None):
    """Around one forward of `model` over a batch whose `routing` is [rows, W, L, k] (-1 = the
    trainer's own): replay it (if attached so), count the agreement. None: nothing."""
    routers = [r for r in families.moe_routers(model) if hasattr(r, "_grpo_counts")]
    if routing is None or not routers:
        yield
        return
    flat = routing.reshape(-1, *routing.shape[2:])                 # [rows * W, L, k]
    for r in routers:
        r._grpo_replay = flat
    try:
        yield
    finally:
        for r in routers:
            r._grpo_replay = None


def take_counts(model) -> tuple[int, int]:
    """(token-layer pairs whose trainer top-k equals the engine's, pairs with an engine choice)
    counted since the last call; resets them."""
    same = total = 0
    for r in families.moe_routers(model):
        if getattr(r, "_grpo_counts", None) is not None:
            same, total = same + int(r._grpo_counts[0]), total + int(r._grpo_counts[1])
            r._grpo_counts = None
    return same, total


@contextmanager
def not_counted(model):
    """A forward inside (the reference's) leaves the agreement counts as they were."""
    routers = [r for r in families.moe_routers(model) if hasattr(r, "_grpo_counts")]
    saved = [r._grpo_counts for r in routers]
    try:
        yield
    finally:
        for r, c in zip(routers, saved):
            r._grpo_counts = c


@contextmanager
def capture(model):
    """Record every router's top-k indices for each forward call inside (a generate call: its
    prefill, then one call per decode step). Yields the list of calls, each [L] of [N, k]."""
    routers = families.moe_routers(model)
    calls: list[list[torch.Tensor]] = []
    handles = []

    def make(layer: int):
        def record(_module, _args, out):
            if layer == 0:
                calls.append([])
            calls[-1].append(out[2].detach())
        return record

    for layer, r in enumerate(routers):
        handles.append(r.register_forward_hook(make(layer)))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def generated_routing(calls: list[list[torch.Tensor]], rows: int, steps: int,
                      num_experts: int) -> torch.Tensor:
    """From :func:`capture`'s calls of one generate over `rows` rows that sampled `steps` tokens:
    [rows, steps, L, k], row r's entry j the experts of the input predicting its token j (the
    prefill's last position for j = 0, decode call j after). The caller cuts each row to its
    length."""
    if len(calls) != steps:
        raise RuntimeError(f"routing capture: {len(calls)} forward calls for {steps} sampled "
                           f"tokens (a generate call that runs other forwards: not supported)")
    first = torch.stack([c.reshape(rows, -1, c.shape[-1])[:, -1] for c in calls[0]], 1)  # [rows, L, k]
    later = [torch.stack([c.reshape(rows, c.shape[-1]) for c in call], 1) for call in calls[1:]]
    return torch.stack([first] + later, 1).to(expert_dtype(num_experts))                # [rows, T, L, k]


def batch_routing(shape: tuple[int, int], rows: torch.Tensor, cols: torch.Tensor,
                  parts: list) -> torch.Tensor | None:
    """The [rows, W, L, k] replay tensor of a trainer batch of `shape` [rows, W]: `parts` holds
    each episode's (routing [R, L, k] or None, the index of each of its batch tokens into its
    response: turn images expand); its tokens, in that order, are predicted at (`rows`, `cols`)
    [N]; each one's routing goes there, -1 elsewhere (and for an episode without). None when no
    episode has routing."""
    ref = next((r for r, _ in parts if r is not None), None)
    if ref is None:
        return None
    rows_of = [r.to(torch.int16)[list(w)] if r is not None
               else torch.full((len(w), *ref.shape[1:]), -1, dtype=torch.int16) for r, w in parts]
    out = torch.full((*shape, *ref.shape[1:]), -1, dtype=torch.int16)
    out[rows, cols] = torch.cat(rows_of)
    return out


def from_vllm(routed, n: int):
    """Response token j's row of routing.py's [R, L, k]: vLLM's row of the position predicting
    it (the last prompt token, then token j - 1): its last `n` rows. None without a capture;
    ModelError for one that repeats an expert within a token's top-k (an engine whose MoE kernel
    does not fill the capture returns zeros)."""
    if routed is None or not n:
        return None
    import numpy as np
    rows = np.asarray(routed)[-n:]                                     # [n, L, k]
    if rows.shape[-1] > 1 and (np.sort(rows, -1)[..., 1:] == np.sort(rows, -1)[..., :-1]).any():
        raise ModelError("vLLM's routed experts repeat an expert within a token's top-k (its MoE "
                         "kernel did not fill the capture): model.moe_routing_replay cannot use them")
    return torch.from_numpy(rows).to(expert_dtype(int(rows.max()) + 1))
