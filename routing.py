"""MoE routing replay ("R3"): the trainer routes each token to the experts the engine chose.

The experts a token is routed to in the engine and in the trainer differ under bf16 and kernel
differences, and the policy ratio then compares two different sub-networks. With
`model.moe_routing_replay` the engine's choice travels with the episode and the trainer's
forwards (proximal pass, updates, reference) use it.

What is replayed: for each response token r_j, the experts of every MoE layer for the token that
PREDICTS it (the last prompt token for r_0, r_{j-1} after): the input whose hidden state gives
r_j's logprob, which is what the engine computed when it sampled r_j (`Episode.routing` [R, L, k]);
and every other prompt token's, as the engine's prefill routed it (`Episode.prompt_routing`
[P - 1, L, k] over the prompt as the trainer sees it, image tokens expanded; None where the engine
returns none or its count is not P - 1: those keep the trainer's own). The last response token,
which predicts nothing, and multi-turn's inserted tokens keep the trainer's own routing. R response
tokens, L MoE layers, k experts per token; uint8 up to 256 experts, else int16: L * k bytes per
token, twice that past 256 experts.

Mechanics: a forward hook on every router module (families.moe_routers, in layer order) reads
the replay tensor of the current forward (set by :func:`replaying` around it, one [N, L, k] row
per flattened input token, -1 = none) and returns the replayed indices with their weights taken
from the router's own softmax at those indices (normalised as the router normalises), so the
gradient still reaches the router; where the engine's choice equals the trainer's the output is
the router's own, bit for bit. The same hook counts, for every RESPONSE token's predictor with an
engine choice (the batch's `routing_counted`; prompt tokens are replayed, not counted), whether
the trainer's own top-k (as a set) equals it: `train/routing_agreement`, with or without replay.
:func:`capture` records what a transformers generate call routed (the HF engine).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

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
        counted = module._grpo_counted                             # [N] bool: response predictors
        counted = has if counted is None else has & counted.to(has.device)
        same = (own.sort(-1).values == want.sort(-1).values).all(-1) & counted
        counts = torch.stack([same.sum(), counted.sum()])          # stays on the device: no sync
        module._grpo_counts = counts if module._grpo_counts is None else module._grpo_counts + counts
        if not module._grpo_apply:
            return None
        idx = torch.where(has[:, None], want, own)
        h = args[0].reshape(-1, module.weight.shape[-1])
        probs = torch.softmax(torch.nn.functional.linear(h, module.weight), dim=-1, dtype=torch.float)
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
            r._grpo_counts = r._grpo_replay = r._grpo_counted = None
            r.register_forward_hook(_hook(layer))
        r._grpo_apply = replay
    return len(routers)


def fallback(model, episodes: list) -> int | None:
    """With replay on (:func:`attach` with `replay`), how many of `episodes` carry no engine
    routing, so that their tokens keep the trainer's own routing: `train/routing_fallback`
    (tracking.py warns the first time it is above 0); None when replay is off."""
    routers = families.moe_routers(model)
    if not routers or not getattr(routers[0], "_grpo_apply", False):
        return None
    return sum(getattr(e, "routing", None) is None for e in episodes)


@contextmanager
def replaying(model, routing: torch.Tensor | None, counted: torch.Tensor | None = None):
    """Around one forward of `model` over a batch whose `routing` is [rows, W, L, k] (-1 = the
    trainer's own): replay it (if attached so), count the agreement over the entries `counted`
    [rows, W] marks (None: every one with a choice). `routing` None: nothing."""
    routers = [r for r in families.moe_routers(model) if hasattr(r, "_grpo_counts")]
    if routing is None or not routers:
        yield
        return
    flat = routing.reshape(-1, *routing.shape[2:])                 # [rows * W, L, k]
    marks = None if counted is None else counted.reshape(-1)
    for r in routers:
        r._grpo_replay, r._grpo_counted = flat, marks
    try:
        yield
    finally:
        for r in routers:
            r._grpo_replay = r._grpo_counted = None


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
def as_reference(model, replay: bool):
    """A forward inside is the KL reference's: it leaves the agreement counts as they were, and
    routes the tokens its own way unless `replay` (`model.moe_routing_replay_ref`). slime and
    verl route the reference its own way, so the KL is to the reference as it would generate;
    replaying the engine's experts into it measures the KL between two policies that share the
    sampled routing instead (a different, smaller number: docs/families.md)."""
    routers = [r for r in families.moe_routers(model) if hasattr(r, "_grpo_counts")]
    saved = [(r._grpo_counts, r._grpo_apply) for r in routers]
    for r in routers:
        r._grpo_apply = r._grpo_apply and replay
    try:
        yield
    finally:
        for r, (c, a) in zip(routers, saved):
            r._grpo_counts, r._grpo_apply = c, a


@contextmanager
def capture(model):
    """Record every router's top-k indices for each forward call inside (a generate call: its
    prefill, then one call per decode step). Yields the list of calls, each [L] of [N, k]."""
    routers = families.moe_routers(model)
    calls: list[list[torch.Tensor]] = []

    def make(layer: int):
        def record(_module, _args, out):
            if layer == 0:
                calls.append([])
            calls[-1].append(out[2].detach())
        return record

    handles = [r.register_forward_hook(make(layer)) for layer, r in enumerate(routers)]
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


def prompt_routing(calls: list[list[torch.Tensor]], lengths: list[int],
                   num_experts: int) -> list[torch.Tensor]:
    """From :func:`capture`'s calls of one generate over len(`lengths`) left-padded rows (row r's
    prompt: the prefill's last `lengths[r]` positions, images expanded): each row's prompt tokens
    but the last (whose routing is :func:`generated_routing`'s entry 0), [lengths[r] - 1, L, k],
    each its own copy (a view would carry the whole prefill's storage when pickled)."""
    rows = len(lengths)
    pre = torch.stack([c.reshape(rows, -1, c.shape[-1]) for c in calls[0]], 2)  # [rows, W, L, k]
    W, dtype = pre.shape[1], expert_dtype(num_experts)
    return [pre[r, W - n:W - 1].to("cpu", dtype, copy=True) for r, n in enumerate(lengths)]


def shared(tensors: list) -> list:
    """`tensors` (the prompt routing of one prompt's G samples, maybe None) with each one equal
    to an earlier one replaced by that one: pickled together (the step's exchange), a shared
    tensor goes over the wire once."""
    out: list = []
    for t in tensors:
        out.append(next((u for u in out if t is not None and u is not None and u.shape == t.shape
                         and torch.equal(u, t)), t))
    return out


def batch_routing(shape: tuple[int, int], rows: torch.Tensor, cols: torch.Tensor, parts: list,
                  prompts: list = ()) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The [rows, W, L, k] replay tensor of a trainer batch of `shape` [rows, W] and which of its
    entries the agreement counts ([rows, W] bool: the response tokens' predictors). `parts`
    holds each episode's (routing [R, L, k] or None, the index of each of its batch tokens into
    its response: turn images expand); its tokens, in that order, are predicted at (`rows`,
    `cols`) [N]; each one's routing goes there. `prompts`: each prompt copy's (prompt routing
    [P - 1, L, k] or None, row, first column, P): its tokens but the last get it (only when its
    count is P - 1). -1 elsewhere (and for an episode without). None when no episode has
    routing."""
    ref = next((r for r, _ in parts if r is not None), None)
    if ref is None:
        return None
    rows_of = [r.to(torch.int16)[list(w)] if r is not None
               else torch.full((len(w), *ref.shape[1:]), -1, dtype=torch.int16) for r, w in parts]
    out = torch.full((*shape, *ref.shape[1:]), -1, dtype=torch.int16)
    for pr, row, col, n in prompts:
        if pr is not None and pr.shape[0] == n - 1 and pr.shape[1:] == ref.shape[1:]:
            out[row, col:col + n - 1] = pr.to(torch.int16)
    out[rows, cols] = torch.cat(rows_of)
    counted = torch.zeros(shape, dtype=torch.bool)
    counted[rows, cols] = True
    return out, counted


def from_vllm(routed, n: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """vLLM's capture `routed` [prompt + response - 1, L, k] of a response of `n` tokens as
    (routing.py's [n, L, k]: the rows of the positions predicting each token, its last `n`; the
    prompt's other tokens' [prompt - 1, L, k], the rows before: `Episode.prompt_routing`, used
    where their count matches the trainer's expanded prompt). (None, None) without a capture;
    ModelError for one that repeats an expert within a token's top-k (an engine whose MoE kernel
    does not fill the capture returns zeros)."""
    if routed is None or not n:
        return None, None
    import numpy as np
    every = np.asarray(routed)
    if every.shape[-1] > 1 and (np.sort(every, -1)[..., 1:] == np.sort(every, -1)[..., :-1]).any():
        raise ModelError("vLLM's routed experts repeat an expert within a token's top-k (its MoE "
                         "kernel did not fill the capture): model.moe_routing_replay cannot use them")
    dtype = expert_dtype(int(every.max()) + 1)
    return (torch.from_numpy(every[-n:].copy()).to(dtype),
            torch.from_numpy(every[:-n].copy()).to(dtype) if len(every) > n else None)
