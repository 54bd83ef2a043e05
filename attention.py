"""The CPU kernel for packed rows (`train.packing`, device.Device.packed_attention = "segments").

A packed row holds whole sequences side by side: a prompt and its responses (one response
each without `train.share_prompt`). A dense kernel under a 4-D block mask computes every
query-key pair of the row, masked or not, so a row wider than its longest sequence costs more
attention than the padding it saves. This kernel computes only the pairs that count: each
prompt attends to itself causally, each response to its prompt and to itself causally, one
`sdpa_attention_forward` call per piece (transformers' own: GQA, scaling and dtype as usual).
So a micro-batch is one row of whole sequences, as wide as `train.micro_batch_tokens`, with no
padding and no [W, W] mask.

It is registered with transformers under :data:`NAME` (the trainer's models are built with it,
trainer.build); the row's layout rides in the forward's keyword `grpo_segments` (through
activation checkpointing's recomputation too), built by inputs.pack. transformers builds no
mask for an attention name its mask registry lacks (masking_utils: checked in 5.5.4, 5.17 and
5.24). Any other call (the vision tower, a batch without the keyword) is plain SDPA.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "grpo_segments"

# One row's layout: [(prompt start, prompt length, [(response start, response length), ...]), ...]
Layout = list[list[tuple[int, int, list[tuple[int, int]]]]]


def segments_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask, dropout: float = 0.0, scaling: float | None = None,
                       grpo_segments: Layout | None = None, **kwargs):
    """transformers' attention interface: query [rows, H, W, D], key/value [rows, Hkv, W, D] ->
    ([rows, W, H, D], None). Columns outside every sequence (a row's unused tail) get zeros."""
    if grpo_segments is None or not getattr(module, "is_causal", False):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    kw = dict(dropout=dropout, scaling=scaling)
    rows = []
    for r, seqs in enumerate(grpo_segments):
        q, k, v = query[r:r + 1], key[r:r + 1], value[r:r + 1]
        cols, vals = [], []
        # a prompt and its first response (right after it) are plainly causal together
        _causal_buckets(module, q, k, v, [(st, rs[0][0] + rs[0][1] - st) for st, _, rs in seqs],
                        cols, vals, kw)
        # each further response over its prompt and itself, similar lengths batched
        _response_buckets(module, q, k, v, [(start, plen, s, n) for start, plen, responses in seqs
                                            for s, n in responses[1:]], cols, vals, kw)
        W, H, D = q.shape[2], q.shape[1], q.shape[3]
        rows.append(q.new_zeros(W, H, D).index_put((torch.cat(cols),), torch.cat(vals)))
    return torch.stack(rows), None


def _causal_buckets(module, q, k, v, spans: list[tuple[int, int]], cols: list, vals: list,
                    kw: dict, ratio: float = 1.25) -> None:
    """Causal attention within each span (start, length) of one row ([1, H, W, D]): spans of
    similar length (within `ratio` of a bucket's shortest) go through one batched call, each
    padded at its end with the columns after it (a causal query never sees them; the padded
    queries' outputs are dropped). Appends each span's columns and outputs [n, H, D]."""
    W = q.shape[2]
    for bucket in buckets([n for _, n in spans], ratio):
        group = [spans[t] for t in bucket]
        m = group[-1][1]
        idx = (torch.tensor([st for st, _ in group], device=q.device)[:, None]
               + torch.arange(m, device=q.device)[None, :]).clamp(max=W - 1)         # [n, m]
        out = sdpa_attention_forward(module, q[0][:, idx].transpose(0, 1), k[0][:, idx].transpose(0, 1),
                                     v[0][:, idx].transpose(0, 1), None, is_causal=True, **kw)[0]
        for b, (st, n) in enumerate(group):                                         # out [n, m, H, D]
            cols.append(torch.arange(st, st + n, device=q.device))
            vals.append(out[b, :n])


def _response_buckets(module, q, k, v, items: list[tuple[int, int, int, int]], cols: list,
                      vals: list, kw: dict, ratio: float = 1.25) -> None:
    """Each response (prompt start, prompt length, response start, length) of one row attending
    to its prompt and to itself causally: responses of similar length (within `ratio`) go
    through one call, whose keys are the longest prompt's width then the longest response's,
    with a mask for the shorter ones (a query past its response's end is dropped; every query
    sees its prompt, so no row of the mask is empty). Appends each response's columns and
    outputs [n, H, D]."""
    W, dev = q.shape[2], q.device
    for bucket in buckets([it[3] for it in items], ratio):
        group = [items[t] for t in bucket]
        m, P = group[-1][3], max(it[1] for it in group)
        ar_p, ar_m = torch.arange(P, device=dev), torch.arange(m, device=dev)
        starts = torch.tensor([[it[0], it[2]] for it in group], device=dev)      # [b, 2]
        qidx = (starts[:, 1:] + ar_m).clamp(max=W - 1)                          # [b, m]
        kidx = torch.cat([(starts[:, :1] + ar_p).clamp(max=W - 1), qidx], 1)    # [b, P + m]
        plens = torch.tensor([it[1] for it in group], device=dev)
        mask = torch.cat([(ar_p[None, :] < plens[:, None])[:, None, :].expand(-1, m, -1),
                          (ar_m[None, :] <= ar_m[:, None])[None].expand(len(group), -1, -1)], 2)
        out = sdpa_attention_forward(module, q[0][:, qidx].transpose(0, 1), k[0][:, kidx].transpose(0, 1),
                                     v[0][:, kidx].transpose(0, 1), mask[:, None], is_causal=False,
                                     **kw)[0]                                    # [b, m, H, D]
        for b, (_, _, s, n) in enumerate(group):
            cols.append(torch.arange(s, s + n, device=dev))
            vals.append(out[b, :n])


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


def pairs(layout: Layout) -> int:
    """The query-key pairs the kernel computes for `layout` (train/attention_frac): each bucket
    of spans (a prompt and its first response) as long as its longest span, then each further
    response over its prompt and itself."""
    total = 0
    for seqs in layout:
        spans = [plen + responses[0][1] for _, plen, responses in seqs]
        total += sum(len(b) * spans[b[-1]] ** 2 for b in buckets(spans))
        further = [(plen, n) for _, plen, responses in seqs for _, n in responses[1:]]
        for b in buckets([n for _, n in further]):
            m = further[b[-1]][1]
            total += len(b) * m * (max(further[t][0] for t in b) + m)
    return total


AttentionInterface.register(NAME, segments_attention)
