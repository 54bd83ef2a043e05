"""The "segments" kernel for packed rows (`train.packing`; device.Device.packed_attention: the
CPU's and CUDA's).

A packed row holds whole sequences side by side: a prompt and its responses (one response
each without `train.share_prompt`). A dense kernel under a 4-D block mask computes every
query-key pair of the row, masked or not, so a row wider than its longest sequence costs more
attention than the padding it saves. This kernel computes only the pairs that count: each
prompt attends to itself causally, each response to its prompt and to itself causally.
Pieces of similar length go through one batched `sdpa_attention_forward` call (transformers'
own: GQA, scaling and dtype as usual), within the device's bucket ratio; the calls are planned
once per micro-batch (:func:`plan`) and serve every layer. So a micro-batch is one row of whole
sequences, as wide as `train.micro_batch_tokens`, with no padding and no [W, W] mask.

It is registered with transformers under :data:`NAME` (the trainer's models are built with it,
trainer.build); the plan, built once per micro-batch by inputs.pack (model.Packed.plan), rides
in the forward's keyword `grpo_segments` (through activation checkpointing's recomputation too).
transformers builds no mask for an attention name its mask registry lacks
(masking_utils: checked in 5.5.4, 5.17 and 5.24). Any other call (the vision tower, a batch
without the keyword) is plain SDPA.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import device as D

NAME = "grpo_segments"

# One row's layout: [(prompt start, prompt length, [(response start, response length), ...]), ...]
Layout = list[list[tuple[int, int, list[tuple[int, int]]]]]


@dataclass(frozen=True)
class Call:
    """One batched SDPA call of a row: queries at columns `q` [b, m], keys and values at `k`
    [b, K] (clamped into the row; what lies past a piece is masked or dropped), `mask` [b, 1, m,
    K] bool, or None for plain causal attention."""
    q: torch.Tensor
    k: torch.Tensor
    mask: torch.Tensor | None


@dataclass(frozen=True)
class Plan:
    """A packed micro-batch's calls, built once (:func:`plan`) for every layer's attention:
    `calls[r]` for row r, and `where[r]` [W]: for each column of the row, its output's index in
    the row's calls' outputs concatenated (flattened [b * m] each), or their total (a zero row)
    for a column outside every sequence."""
    calls: list[list[Call]]
    where: list[torch.Tensor]
    # [] int64 on the host: the plan's number in _PLANS, what a compiled layer passes (_op)
    handle: torch.Tensor = field(default=None, compare=False)

    def __post_init__(self):
        if self.handle is not None:  # dataclasses.replace (FSDP2's cast of a forward's inputs
            return                   # rebuilds them): the same plan, found through the original
        number = next(_NUMBERS)
        _PLANS[number] = self
        object.__setattr__(self, "handle", torch.tensor(number))

    def __reduce__(self):  # a copy (pickle, deepcopy) is a plan of its own, with its own handle
        return Plan, (self.calls, self.where)


# model.compile: a compiled decoder layer hands the op (_op) the plan's number (Plan.handle, a
# tensor: torch.compile guards on a tensor's shape, never on its value); the op finds the plan
# here, in its forward and its backward
_NUMBERS = itertools.count()
_PLANS: "weakref.WeakValueDictionary[int, Plan]" = weakref.WeakValueDictionary()


def _plan(handle: torch.Tensor) -> Plan:
    """The plan numbered `handle` (the host's: no device sync); it lives as long as its
    micro-batch (model.Packed.plan) holds it, which must outlive the micro-batch's backward."""
    plan = _PLANS.get(int(handle))
    if plan is None:
        raise RuntimeError(f"attention: packed plan {int(handle)} was freed before its micro-batch's "
                           "backward ran (keep the micro-batch until its backward)")
    return plan


def segments_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask, dropout: float = 0.0, scaling: float | None = None,
                       grpo_segments: Plan | None = None, **kwargs):
    """transformers' attention interface: query [rows, H, W, D], key/value [rows, Hkv, W, D] ->
    ([rows, W, H, D], None). Columns outside every sequence (a row's unused tail) get zeros.

    Under torch.compile (model.compile: each decoder layer) the calls run as one opaque custom
    op, :func:`_op`, given the plan's handle: the plan's Python lists (a different number and
    shape of calls every micro-batch) stay out of the traced code, so no micro-batch's plan
    recompiles the layer (tests/test_compile_plans.py); the op's backward runs the calls again
    and differentiates them (the same operators as eager: the same gradients; the price, one
    more attention forward per layer in the backward). So attention dropout must be 0 there."""
    if grpo_segments is None or not getattr(module, "is_causal", False):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if torch.compiler.is_compiling():
        if dropout:  # the backward's second run would draw other dropout masks
            raise ValueError(f"model.compile in the packed segments layout needs attention dropout "
                             f"0 (the model's is {dropout})")
        groups = getattr(module, "num_key_value_groups", 1)  # what sdpa_attention_forward reads
        return _op(query, key, value, grpo_segments.handle, groups, dropout, scaling), None
    return _segments(module, query, key, value, grpo_segments, dropout, scaling), None


def _segments(module, query, key, value, grpo_segments: Plan, dropout: float, scaling: float | None):
    """:func:`segments_attention`'s calls, row by row: [rows, W, H, D]."""
    rows = []
    for r, calls in enumerate(grpo_segments.calls):
        q, k, v = query[r], key[r], value[r]                                    # [H(kv), W, D]
        outs = [sdpa_attention_forward(module, q[:, c.q].transpose(0, 1), k[:, c.k].transpose(0, 1),
                                       v[:, c.k].transpose(0, 1), c.mask, dropout=dropout,
                                       scaling=scaling, is_causal=c.mask is None)[0].flatten(0, 1)
                for c in calls]                                                 # [b * m, H, D]
        outs.append(q.new_zeros(1, q.shape[0], q.shape[2]))
        rows.append(torch.cat(outs)[grpo_segments.where[r]])
    return torch.stack(rows)


@dataclass(frozen=True)
class _Heads:
    """What sdpa_attention_forward reads of an attention module (transformers 5.5.4 to 5.24)."""
    num_key_value_groups: int
    is_causal: bool = True


@torch.library.custom_op("grpo::segments_attention", mutates_args=())
def _op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, handle: torch.Tensor,
        groups: int, dropout: float, scaling: float | None) -> torch.Tensor:
    """:func:`_segments` of the plan numbered `handle` (:func:`_plan`), for an attention module
    with `groups` query heads per key-value head."""
    return _segments(_Heads(groups), query, key, value, _plan(handle), dropout, scaling)


@_op.register_fake
def _(query, key, value, handle, groups, dropout, scaling):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


@torch.library.custom_op("grpo::segments_attention_backward", mutates_args=())
def _op_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 handle: torch.Tensor, groups: int, dropout: float,
                 scaling: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`_op` for query, key and value: its calls again, differentiated
    (torch.func.vjp: a custom op's body runs below autograd, where autograd.grad records nothing)."""
    plan, heads = _plan(handle), _Heads(groups)
    _, vjp = torch.func.vjp(lambda q, k, v: _segments(heads, q, k, v, plan, dropout, scaling),
                            query, key, value)
    return tuple(g.contiguous() for g in vjp(grad))


@_op_backward.register_fake
def _(grad, query, key, value, handle, groups, dropout, scaling):
    return tuple(t.new_empty(t.shape) for t in (query, key, value))  # contiguous, as the op's


def _setup(ctx, inputs, output):
    query, key, value, handle, groups, dropout, scaling = inputs
    ctx.save_for_backward(query, key, value, handle)
    ctx.rest = groups, dropout, scaling


def _backward(ctx, grad):
    return (*_op_backward(grad, *ctx.saved_tensors, *ctx.rest), None, None, None, None)


_op.register_autograd(_backward, setup_context=_setup)


def plan(layout: Layout, width: int, device: torch.device, ratio: float | None = None) -> Plan:
    """The calls of a packed batch's `layout` (rows `width` wide), on `device`: per row, each
    prompt with its first response (:func:`_span_calls`), then each further response over its
    prompt and itself (:func:`_response_calls`); pieces of similar length (within `ratio` of a
    bucket's shortest; default: `device`'s bucket_ratio) batched into one call."""
    calls, where, ratio = [], [], ratio or D.TABLE[device.type].bucket_ratio
    for seqs in layout:
        row, cols = [], []                          # cols: each call's (start, length) pieces
        _span_calls(seqs, width, ratio, row, cols)
        _response_calls(seqs, width, ratio, row, cols)
        calls.append([Call(c.q.to(device), c.k.to(device),
                           None if c.mask is None else c.mask.to(device)) for c in row])
        where.append(_where(row, cols, width).to(device))
    return Plan(calls, where)


def _span_calls(seqs, width: int, ratio: float, row: list, cols: list) -> None:
    """A prompt and its first response (right after it) are plainly causal together: spans of
    similar length in one causal call, each padded at its end with the columns after it (a
    causal query never sees them; their outputs are dropped)."""
    spans = [(st, rs[0][0] + rs[0][1] - st) for st, _, rs in seqs]
    for bucket in buckets([n for _, n in spans], ratio):
        group = [spans[t] for t in bucket]
        idx = _columns([st for st, _ in group], group[-1][1], width)
        row.append(Call(idx, idx, None))
        cols.append(group)


def _response_calls(seqs, width: int, ratio: float, row: list, cols: list) -> None:
    """Each further response over its prompt and itself causally: responses of similar length
    in one call, keys the bucket's longest prompt then its longest response, masked for the
    shorter ones (every query sees its prompt, so no row of a mask is empty)."""
    further = [(st, plen, s, n) for st, plen, rs in seqs for s, n in rs[1:]]
    for bucket in buckets([it[3] for it in further], ratio):
        group = [further[t] for t in bucket]
        m, P = group[-1][3], max(it[1] for it in group)
        qidx = _columns([it[2] for it in group], m, width)
        kidx = torch.cat([_columns([it[0] for it in group], P, width), qidx], 1)
        ar_p, ar_m = torch.arange(P), torch.arange(m)
        plens = torch.tensor([it[1] for it in group])
        mask = torch.cat([(ar_p[None, :] < plens[:, None])[:, None, :].expand(-1, m, -1),
                          (ar_m[None, :] <= ar_m[:, None])[None].expand(len(group), -1, -1)], 2)
        row.append(Call(qidx, kidx, mask[:, None]))
        cols.append([(it[2], it[3]) for it in group])


def _columns(starts: list[int], m: int, width: int) -> torch.Tensor:
    """[b, m] columns from each start, clamped into the row."""
    return (torch.tensor(starts)[:, None] + torch.arange(m)[None, :]).clamp(max=width - 1)


def _where(row: list[Call], cols: list[list[tuple[int, int]]], width: int) -> torch.Tensor:
    """Plan.where for one row: each column's index in its calls' outputs concatenated."""
    total = sum(c.q.numel() for c in row)
    where = torch.full((width,), total, dtype=torch.long)
    offset = 0
    for c, pieces in zip(row, cols):
        m = c.q.shape[1]
        for b, (st, n) in enumerate(pieces):
            where[st:st + n] = torch.arange(offset + b * m, offset + b * m + n)
        offset += c.q.numel()
    return where


def buckets(lengths: list[int], ratio: float = 1.25) -> list[list[int]]:
    """Indices of `lengths` in buckets of similar length, shortest first: a bucket takes every
    length up to `ratio` x its shortest, and its calls are as long as its longest."""
    order, out = sorted(range(len(lengths)), key=lambda i: lengths[i]), []
    for i in order:
        if out and lengths[i] <= lengths[out[-1][0]] * ratio:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def layout(segments: torch.Tensor) -> Layout:
    """The per-row layout of a packed batch's `segments` ([responses, 5]: row, prompt's column,
    prompt length, the response's column, its length, in row-major order; inputs.pack)."""
    out: Layout = []
    for row, pcol, plen, rcol, n in segments.tolist():
        while len(out) <= row:
            out.append([])
        if not out[row] or out[row][-1][0] != pcol:
            out[row].append((pcol, plen, []))
        out[row][-1][2].append((rcol, n))
    return out


def pairs(p: Plan) -> int:
    """The query-key pairs the calls of `p` compute (train/attention_frac): each causal call's
    b x m x m, each masked call's b x m x K, padding and masked pairs included."""
    return sum(c.q.numel() * c.k.shape[1] for row in p.calls for c in row)


# ----------------------------------------------------------------------------- the vision tower
@dataclass(frozen=True)
class Windows:
    """The sequences of one vision forward's `cu_seqlens` (its windows, or its whole images),
    padded to the longest for one batched call: `idx` [n, L] each sequence's rows (clamped into
    the S rows), `keep` [n, 1, 1, L] its real keys (None: none padded), `where` [S] each row's
    place in the call's flattened [n * L] output; `idx` and `where` None for one sequence. For a
    varlen kernel (device.varlen_attention): `cu` the bounds (int32) and `longest` = L."""
    idx: torch.Tensor | None
    keep: torch.Tensor | None
    where: torch.Tensor | None
    cu: torch.Tensor
    longest: int


def windows(cu: list[int], device: torch.device) -> Windows:
    """:class:`Windows` of cumulative sequence bounds `cu` ([0, ..., S]; empty sequences dropped)."""
    lens = [b - a for a, b in zip(cu, cu[1:]) if b > a]
    starts = [a for a, b in zip(cu, cu[1:]) if b > a]
    n, L, S = len(lens), max(lens), cu[-1]
    bounds = torch.tensor([0, *starts[1:], S], dtype=torch.int32, device=device)
    if n == 1:
        return Windows(None, None, None, bounds, L)
    ar, lt, st = torch.arange(L), torch.tensor(lens), torch.tensor(starts)
    idx = (st[:, None] + ar[None, :]).clamp(max=S - 1)
    keep = None if min(lens) == L else (ar[None, :] < lt[:, None])[:, None, None, :]
    where = torch.repeat_interleave(torch.arange(n) * L - st, lt, output_size=S) + torch.arange(S)  # no .item()
    return Windows(idx.to(device), None if keep is None else keep.to(device), where.to(device),
                   bounds, L)


class WindowPlans:
    """One tower's :class:`Windows` by `cu_seqlens` tensor: built on its first block (one copy
    to the host per forward and kind of block, windowed or full), reused by the others."""

    def __init__(self, keep: int = 4):
        self.plans: list[tuple[torch.Tensor, Windows]] = []
        self.keep = keep

    def __call__(self, cu_seqlens: torch.Tensor) -> Windows:
        w = next((w for t, w in self.plans if t is cu_seqlens), None)
        if w is None:
            w = windows(cu_seqlens.tolist(), cu_seqlens.device)
            self.plans = [(cu_seqlens, w), *self.plans][:self.keep]  # the tensor held: its id stays its
        return w


def one_call_vision(model) -> bool:
    """Replace the forward of `model`'s vision attention modules (families.vision_attentions)
    by :func:`vision_forward`: every window (or image) of a block in one SDPA call, padded to
    the longest and masked, instead of transformers' one call per window after a `.tolist()` of
    its lengths in every block. Not for a flash (varlen) tower, whose one call per block is
    transformers' own. Returns whether it replaced any."""
    import families as F
    mods = [m for m in F.vision_attentions(model) if "flash" not in (m.config._attn_implementation or "")]
    plans = WindowPlans()
    for m in mods:
        m.forward = vision_forward(m, F.vision_rotary(m), plans)
    return bool(mods)


def vision_forward(module, rotary, plans: WindowPlans):
    """A vision attention module's forward: hidden [S, dim] -> [S, dim], each row attending to
    the rows of its sequence in `cu_seqlens` (no mask within one), as transformers' own: one
    varlen kernel call where the device has one (device.varlen_attention), else one SDPA call
    over the sequences padded to the longest."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def forward(hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, position_embeddings=None,
                **_kwargs) -> torch.Tensor:
        S = hidden_states.shape[0]
        q, k, v = module.qkv(hidden_states).reshape(S, 3, module.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = rotary(q, k, *position_embeddings)                             # [S, H, D]
        w = plans(cu_seqlens)
        varlen = D.varlen_attention(q.device.type, q.dtype)
        if varlen is not None and w.idx is not None:  # no padding: the kernel takes the bounds
            return module.proj(varlen(q, k, v, w.cu, w.cu, w.longest, w.longest).reshape(S, -1))
        if w.idx is None:  # one sequence: the rows as they are
            out = sdpa(*(t.transpose(0, 1)[None] for t in (q, k, v)), scale=module.scaling)
            return module.proj(out[0].transpose(0, 1).reshape(S, -1))
        q, k, v = (t[w.idx].transpose(1, 2) for t in (q, k, v))               # [n, H, L, D]
        out = sdpa(q, k, v, attn_mask=w.keep, scale=module.scaling)           # [n, H, L, D]
        return module.proj(out.transpose(1, 2).flatten(0, 1)[w.where].reshape(S, -1))
    return forward


AttentionInterface.register(NAME, segments_attention)
