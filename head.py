"""The LM head's logprobs and entropies in token chunks: no [tokens x vocabulary] tensor.

The trainer needs, for each response token, log p(target) and the entropy of the tempered
distribution over the whole vocabulary (the convention of docs/loss.md, as model.masked_logits:
fp32, suppressed ids removed, divided by the temperature). Done at once, that is three or more
[N, V] fp32 tensors held for backward: ~5 GB each at 8,192 tokens and a 151,936-token vocabulary.
Here :class:`HeadLogprobs` takes the hidden states [N, H] and the head weight [V, H], computes
the logits chunk by chunk (logits -> log-softmax -> the target's logprob and the entropy), saves
only its inputs, and recomputes each chunk's logits in backward: the head's peak is one chunk's
(:data:`CHUNK_BYTES` of fp32 logits, a few times over), whatever N.

:func:`on_head` runs it inside the head module's own forward (hooks on it): that is where FSDP2
has gathered the head's weight (the root unit holds it, tied to the embeddings or not), and the
model's output then carries the result, so FSDP2's backward hooks see the graph as they would see
logits. The head must be a bias-free nn.Linear (every family's is), or a peft LoRA layer over
one (:func:`head_weight`).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

# One chunk's fp32 logits (tokens per chunk = CHUNK_BYTES // (4 V), at least 1): 441 tokens at a
# 151,936-token vocabulary; the head's peak is a few such buffers. Larger chunks: fewer launches.
CHUNK_BYTES = 256 * 2**20


def chunk_tokens(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // (4 * vocab))


def _log_softmax(h: torch.Tensor, weight: torch.Tensor, suppressed: torch.Tensor | None,
                 temperature: float) -> torch.Tensor:
    """[C, V] fp32 log-softmax of the tempered logits of hidden states `h` [C, H] (the ops of
    model.masked_logits + torch.log_softmax, so a chunk's values are today's)."""
    z = F.linear(h, weight).float()
    if suppressed is not None:
        z = z.index_fill(-1, suppressed, float("-inf"))
    return torch.log_softmax(z / temperature, dim=-1)


class HeadLogprobs(torch.autograd.Function):
    """(logprob of each target [N], entropy [N]) from hidden states [N, H] and the head weight
    [V, H]; the entropy is differentiable only with `entropy_grad` (the entropy bonus)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, suppressed, temperature, chunk, entropy_grad):
        N = hidden.shape[0]
        lp = torch.empty(N, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(N, dtype=torch.float32, device=hidden.device)
        for s in range(0, N, chunk):
            e = min(N, s + chunk)
            logp = _log_softmax(hidden[s:e], weight, suppressed, temperature)     # [C, V]
            lp[s:e] = logp.gather(-1, targets[s:e, None]).squeeze(-1)
            p = logp.exp()
            ent[s:e] = -(p.mul_(logp.nan_to_num_(neginf=0.0))).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, suppressed, ent)
        ctx.temperature, ctx.chunk, ctx.entropy_grad = temperature, chunk, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, suppressed, ent = ctx.saved_tensors
        g_ent = g_ent if ctx.entropy_grad else None
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_lp is None and g_ent is None) or not (want_h or want_w):
            return (None,) * 7
        N, T = hidden.shape[0], ctx.temperature
        g_h = torch.empty_like(hidden) if want_h else None
        # fp32 accumulation across chunks; a low-precision weight gets one rounding at the end,
        # as one matmul over every token would
        g_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        for s in range(0, N, ctx.chunk):
            e = min(N, s + ctx.chunk)
            g = _chunk_grad(_log_softmax(hidden[s:e], weight, suppressed, T), targets[s:e],
                            None if g_lp is None else g_lp[s:e],
                            None if g_ent is None else (g_ent[s:e], ent[s:e]))    # [C, V] d/dz
            if suppressed is not None:  # index_fill's backward: nothing reaches a removed id
                g.index_fill_(-1, suppressed, 0.0)
            g = g.div_(T).to(weight.dtype)                                        # d/dlogits
            if want_h:
                g_h[s:e] = g @ weight
            if want_w:
                if g_w.dtype == g.dtype:
                    g_w.addmm_(g.t(), hidden[s:e])
                else:
                    g_w += g.t() @ hidden[s:e]
        return g_h, None if g_w is None else g_w.to(weight.dtype), None, None, None, None, None


def _chunk_grad(logp: torch.Tensor, targets: torch.Tensor, g_lp: torch.Tensor | None,
                g_ent: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """d loss / d tempered logits of one chunk, in place over `logp` [C, V]:
    d lp_t / dz = onehot(t) - p; d H / dz = -p (log p + H) (removed ids: p = 0, no gradient)."""
    p = logp.exp()
    if g_ent is None:
        g = p.mul_(-g_lp[:, None])                            # -p g_lp
    else:
        coef = logp.nan_to_num_(neginf=0.0).add_(g_ent[1][:, None]).mul_(g_ent[0][:, None])
        if g_lp is not None:
            coef.add_(g_lp[:, None])
        g = p.mul_(coef).neg_()                               # -p (g_lp + g_ent (log p + H))
    if g_lp is not None:
        g.scatter_add_(-1, targets[:, None], g_lp[:, None])
    return g


def logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
             suppressed: tuple[int, ...] = (), temperature: float = 1.0,
             entropy_grad: bool = False, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob [N], entropy [N]) of `targets` under `hidden` [N, H] @ `weight` [V, H].T, tempered,
    `suppressed` ids removed, in chunks of `chunk` tokens (default: :func:`chunk_tokens`)."""
    idx = torch.tensor(suppressed, dtype=torch.long, device=hidden.device) if suppressed else None
    chunk = chunk or chunk_tokens(weight.shape[0])
    return HeadLogprobs.apply(hidden, weight, targets, idx, float(temperature), chunk, entropy_grad)


def head_weight(head: torch.nn.Module) -> torch.Tensor:
    """The [V, H] weight `head` applies: a Linear's own, or for a peft LoRA layer on the head
    (`[model] lora_target_modules` naming an untied head) its base weight plus each active
    adapter's `get_delta_weight` (differentiable: the adapters train through it; the project's
    adapters have no dropout: lora.add_lora makes them with 0, config.check_lora refuses
    model.lora_dropout > 0). Inside the forward: FSDP2's unsharded tensors."""
    if isinstance(head, torch.nn.Linear):
        return head.weight
    weight = head.base_layer.weight
    if getattr(head, "disable_adapters", False) or getattr(head, "merged", False):
        return weight                                         # peft's forward: the base alone
    for name in head.active_adapters:
        if name in head.lora_A:
            weight = weight + head.get_delta_weight(name)
    return weight


@contextlib.contextmanager
def on_head(head: torch.nn.Module, at, targets: torch.Tensor, suppressed: tuple[int, ...],
            temperature: float, entropy_grad: bool = False):
    """While active, `head`'s forward takes the hidden states at `at` (a [B, W] bool mask,
    row-major, or a tuple of index tensors; one row per target in `targets`) and returns
    [N, 2] = (logprob, entropy) per target (:func:`logprobs`) instead of logits."""
    base = head if isinstance(head, torch.nn.Linear) else getattr(head, "base_layer", None)
    if not isinstance(base, torch.nn.Linear) or base.bias is not None or (
            base is not head and not hasattr(head, "get_delta_weight")):
        raise ValueError(f"the chunked LM head needs a bias-free nn.Linear head (or a LoRA layer "
                         f"over one), not {head!r}")
    hidden = []

    def take(_module, args):
        hidden.append(args[0][at])                            # [N, H]
        return (args[0][:0],) + tuple(args[1:])               # the Linear itself runs on no rows

    def give(module, _args, _out):
        lp, ent = logprobs(hidden.pop(), head_weight(module), targets, suppressed, temperature,
                           entropy_grad)
        return torch.stack((lp, ent), dim=-1)

    handles = [head.register_forward_pre_hook(take), head.register_forward_hook(give)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
