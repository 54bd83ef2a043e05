"""The policy model: loading any supported family, its logprobs, FSDP2.

Everything that touches the model's structure lives here; what differs between families is in
families.py, the rest is asked of the config or the model (docs/families.md).
`sequence_logprobs` is the trainer's forward over a :class:`MicroBatch` (inputs.collate makes it,
laid out as the trainer's :class:`RowLayout` says; `tokens`, here and below: the run's
inputs.Tokens); `apply_fsdp` / `shard_from_rank0` shard it over the
trainer-only mesh. The logprob convention, shared with the engines: docs/loss.md.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

import attention
import device as D
import families as F
import head
import routing
from errors import ModelError, one_line

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------- the micro-batch
@dataclass(frozen=True)
class RowLayout:
    """How the trainer lays out a micro-batch's rows, decided once at start
    (microbatches.resolve_layout; the trainer holds it): `packed`, the layout packing every
    sequence of a micro-batch into one row ("segments" / "varlen", device.Device.packed_attention)
    or None; `share_prompt`, one sequence per prompt's run (train.share_prompt, where the model
    packs exactly)."""
    packed: str | None = None
    share_prompt: bool = False


def _to(record, device: torch.device):
    """`record` (a dataclass) with its tensors, and those of its records and tuples, on `device`."""
    def move(v):
        if isinstance(v, torch.Tensor):
            return v.to(device)
        if isinstance(v, tuple):
            return tuple(move(x) for x in v)
        if isinstance(v, dict):
            return {k: move(x) for k, x in v.items()}
        return _to(v, device) if isinstance(v, Packed) else v
    return replace(record, **{f.name: move(getattr(record, f.name)) for f in fields(record)})


@dataclass(frozen=True)
class Packed:
    """The part of a micro-batch whose rows hold whole sequences (inputs.pack): per sequence its
    row, first column and prompt length [S]; per response token (episode-major) its sequence,
    row, the column whose hidden state predicts it, its own column and its index in its response
    [N]."""
    response_slots: torch.Tensor        # [B, T] 1 on every response token (inserted turns' too)
    seq_row: torch.Tensor
    seq_col: torch.Tensor
    prompt_len: torch.Tensor
    pred_seq: torch.Tensor
    pred_row: torch.Tensor
    pred_col: torch.Tensor
    target_col: torch.Tensor
    offset: torch.Tensor
    mask_4d: torch.Tensor | None = None  # [rows, 1, W, W] bool: one row per prompt (no packing)
    plan: attention.Plan | None = None   # "segments": the kernel's calls, built once (inputs.pack)
    # per sequence its columns in the flattened rows [S, longest] (-1 past its end): linear-
    # attention layers run each sequence alone from a zero state (_alone_forward)
    seq_index: torch.Tensor | None = None
    # "varlen": flash-attention's kwargs (cu_seq_lens_q/k int32 [S + 1], max_length_q/k ints),
    # computed once here rather than from the position ids in every layer (a host sync each)
    fa_kwargs: dict | None = None


@dataclass(frozen=True)
class MicroBatch:
    """One trainer forward/backward's input (inputs.collate), what :func:`sequence_logprobs`
    takes. Every layout has these; `packed` is the part of packed rows (None: one row per
    episode, right-padded, T = W)."""
    input_ids: torch.Tensor             # [rows, W]
    attention_mask: torch.Tensor        # [rows, W] 1 on real tokens
    response_mask: torch.Tensor         # [B, T] episode order: 1 on the tokens the engine sampled
    engine_logprobs: torch.Tensor       # [B, T] the engine's logprob of each
    token_versions: torch.Tensor        # [B, T] the weight version each was sampled with, -1 elsewhere (inputs.compared_versions)
    attention_pairs: torch.Tensor       # [] the query-key pairs the layout's kernel computes
    episode_tokens: torch.Tensor        # [] prompt + response tokens of every episode, however laid out
    episode_pairs: torch.Tensor         # [] the query-key pairs of one unpadded row per episode
    pixel_values: torch.Tensor | None = None    # the images, in the order their tokens come
    image_grid_thw: torch.Tensor | None = None
    routing: torch.Tensor | None = None          # MoE replay [rows, W, L, k] (routing.batch_routing)
    routing_counted: torch.Tensor | None = None  # [rows, W] bool
    packed: Packed | None = None
    # (pixel_values, image_grid_thw) of a blank image, for a micro-batch without images whose
    # peers' may show some: the vision tower runs on it, its output counting 0 (_blank_vision)
    blank_image: tuple[torch.Tensor, torch.Tensor] | None = None
    # the record as inputs.collate built it, on the host (set by `to`): what is planned per
    # micro-batch (packed_positions) reads it there, with no device sync
    host: "MicroBatch | None" = None

    def to(self, device: torch.device) -> "MicroBatch":
        on_host = self.host if self.host is not None else (self if self.input_ids.device.type == "cpu" else None)
        return replace(_to(self, device), host=on_host)


# profiler scope (torch.profiler.record_function) of host-side work on host tensors (the
# micro-batch's plan and positions): its `.item()` / `nonzero` read host memory, no device sync
# (bench/step.py counts them apart from the host syncs)
HOST_SCOPE = "grpo::host"


def resolve_path(path: str, run_dir: Path, seed: int) -> str:
    """`"tiny"` / `"tiny-<model_type>"` -> build (once) that tiny random model under the run
    folder ("tiny-model" / "tiny-<model_type>"); else `path`."""
    kind = F.tiny_type(path)
    if kind is None:
        return path
    folder = run_dir / ("tiny-model" if path == F.TINY else path)
    return str(F.build_tiny(folder, seed=seed, model_type=kind))


# ----------------------------------------------------------------------------- what a model is
def load_config(path: str):
    """The model's config; ModelError naming `model.path` when its family is not in the table."""
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - an unknown model_type, a broken config.json, ...
        kind = F.model_type_of(path)
        if kind and kind not in F.FAMILIES:
            raise ModelError(f"model.path={path}: {F.unsupported(kind)}") from None
        raise ModelError(f"model.path={path}: cannot read its config ({one_line(e, 240, typed=False)})") from None
    if config.model_type not in F.FAMILIES:
        raise ModelError(f"model.path={path}: {F.unsupported(config.model_type)}")
    return config


def text_config(config):
    return getattr(config, "text_config", None) or config


def has_linear_attention(config) -> bool:
    """Whether some text layer is not full attention (Gated DeltaNet): such a layer carries a
    recurrent state over the whole row and takes no 4D mask."""
    kinds = getattr(text_config(config), "layer_types", None) or ["full_attention"]
    return any(k != "full_attention" for k in kinds)


def packs_exactly(config) -> bool:
    """One packed row per prompt (train.share_prompt) equals one row per episode only when every
    text layer is full attention (else a response would see the responses before it)."""
    return not has_linear_attention(config)


def peek_config(path: str):
    """The config of `path` without building or downloading anything: a local folder's, a tiny
    family's (`tiny-<model_type>`, ids of no consequence), else None (a hub id: read at start)."""
    kind = F.tiny_type(path)
    if kind is not None:
        if kind not in F.FAMILIES:
            return None
        ids = dict(vocab=300, pad=0, eos=1, image_pad=2, video_pad=3, vision_start=4, vision_end=5)
        return F.tiny_config(kind, ids)
    return load_config(path) if (Path(path) / "config.json").is_file() else None


# ----------------------------------------------------------------------------- logprobs
def masked_logits(logits: torch.Tensor, tokens, temperature: float) -> torch.Tensor:
    """The policy's logits as the engines sample them: suppressed ids removed, tempered."""
    logits = logits.float()
    if tokens.suppressed:
        logits = logits.index_fill(-1, torch.tensor(tokens.suppressed, device=logits.device),
                                   float("-inf"))
    return logits / temperature


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, tokens,
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each target token, entropy): log softmax of `logits / temperature` over the
    full vocabulary, suppressed ids removed (the convention of docs/loss.md)."""
    lp = torch.log_softmax(masked_logits(logits, tokens, temperature), dim=-1)
    picked = lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    p = lp.exp()
    entropy = -(p * lp.nan_to_num(neginf=0.0)).sum(-1)
    return picked, entropy


def _model_inputs(batch: MicroBatch, tokens, model=None) -> dict:
    """The images of a batch as the model takes them ({} without images). mm_token_type_ids
    marks the image tokens; without it transformers silently falls back to text-only positions
    and the logprobs no longer match generation (mRoPE). A family whose image features the
    trainer places (families.places_images; `model` given) gets none: :func:`_image_hook` puts
    them in."""
    if batch.pixel_values is None or (model is not None and F.places_images(model)):
        return {}
    return dict(pixel_values=batch.pixel_values, image_grid_thw=batch.image_grid_thw,
                mm_token_type_ids=(batch.input_ids == tokens.image_pad).int())


def sequence_logprobs(model, batch: MicroBatch, tokens, temperature: float,
                      entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer forward: logprobs and entropies of the response tokens of an inputs.collate batch,
    aligned with its `response_mask` (zero elsewhere). The entropies are detached unless
    `entropy_grad` (the entropy bonus). Only the positions that predict a response token go
    through the LM head."""
    if batch.packed is not None:  # packed rows (inputs.pack)
        return _packed_logprobs(model, batch, tokens, temperature, entropy_grad)
    ids = batch.input_ids
    with torch.profiler.record_function(HOST_SCOPE):  # from the host record: no device sync
        h = batch.host if batch.host is not None else batch
        at = h.response_mask.bool().nonzero(as_tuple=True)       # the response tokens, row-major
        at = tuple(t.to(ids.device) for t in at)
    rows = (at[0], at[1] - 1)                                    # column t - 1 predicts token t
    placed = {} if batch.pixel_values is None or not F.places_images(model) else {
        "position_ids": padded_positions(model, batch, tokens)}  # the model's own, from the host
    lp_sel, ent_sel = _logprobs_at(model, rows, ids[at], tokens, temperature, entropy_grad,
                                   batch, input_ids=ids, attention_mask=batch.attention_mask,
                                   use_cache=False, **_model_inputs(batch, tokens, model), **placed)
    resp = batch.response_mask.bool()                            # column t holds token t
    return _spread(lp_sel, ent_sel, at, resp, entropy_grad)


def _packed_logprobs(model, batch: MicroBatch, tokens, temperature: float,
                     entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    p, ids = batch.packed, batch.input_ids
    # no 4-D mask for packed rows: attention.py's kernel takes the plan ("segments"), or the
    # varlen kernel finds the sequences from the restarting positions ("varlen")
    layout = {}
    if p.plan is not None:
        if (got := text_config(model.config)._attn_implementation) != attention.NAME:
            raise ValueError(f"a packed batch's segments need a model built with attn_implementation="
                             f"{attention.NAME!r} (trainer.build), not {got!r}")
        layout = {"grpo_segments": p.plan}  # the calls every layer makes, built once (inputs.pack)
    if p.fa_kwargs is not None or has_linear_attention(model.config):
        bind_sequences(model)  # the layers that read the boundaries below (once per model)
        layout["grpo_packed"] = p
    # (pred_row, pred_col): a shared prompt's last position once per response it starts
    lp_sel, ent_sel = _logprobs_at(model, (p.pred_row, p.pred_col), ids[p.pred_row, p.target_col], tokens,
                                   temperature, entropy_grad, batch, input_ids=ids, attention_mask=p.mask_4d,
                                   position_ids=packed_positions(model, batch, tokens), use_cache=False,
                                   **_model_inputs(batch, tokens, model), **layout)
    with torch.profiler.record_function(HOST_SCOPE):  # from the host record: no device sync
        h = batch.host if batch.host is not None else batch
        at = tuple(t.to(ids.device) for t in h.packed.response_slots.bool().nonzero(as_tuple=True))
    # [B, T] episode-major as pred_row; multi-turn: without the inserted tokens
    return _spread(lp_sel, ent_sel, at, batch.response_mask.bool(), entropy_grad)


def bind_sequences(model) -> None:
    """Make `model`'s layers read a packed batch's boundaries from the forward's keyword
    `grpo_packed` (a Packed; it rides every decoder layer's kwargs, activation checkpointing's
    recomputation included): each linear-attention mixer (families.LINEAR_ATTENTION_MODULE) runs
    every sequence alone (:func:`_alone_forward`; its decoder layer hands it the batch, as
    5.5.4's layer passes the mixer no kwargs), each text attention (`is_causal`) gets
    flash-attention's precomputed kwargs (Packed.fa_kwargs, "varlen"). Idempotent."""
    for m in list(model.modules()):
        mixer = getattr(m, F.LINEAR_ATTENTION_MODULE, None)
        if isinstance(mixer, torch.nn.Module) and not hasattr(mixer, "_grpo_forward"):
            now: dict = {}
            mixer._grpo_forward, m._grpo_forward = mixer.forward, m.forward
            mixer.forward = _alone_forward(mixer._grpo_forward, now)
            m.forward = _handing(m._grpo_forward, now)
        if getattr(m, "is_causal", False) and not hasattr(m, "_grpo_forward"):
            m._grpo_forward = m.forward
            m.forward = _varlen_forward(m._grpo_forward)


def _handing(forward, now: dict):
    """A linear-attention decoder layer's forward: its batch's Packed (None: not packed) in `now`
    for its mixer. Kept after the call: activation checkpointing's recomputation in the backward
    (inside the layer's own forward in transformers 5.24, past this wrapper) reads the batch the
    layer last saw, that of the forward it recomputes (a micro-batch's forward then backward)."""
    def run(*args, grpo_packed: Packed | None = None, **kwargs):
        now["packed"] = grpo_packed
        return forward(*args, **kwargs)
    return run


def _varlen_forward(forward):
    """An attention module's forward given a packed batch's flash-attention kwargs, if any."""
    def run(*args, grpo_packed: Packed | None = None, **kwargs):
        if grpo_packed is not None and grpo_packed.fa_kwargs is not None:
            kwargs.update(grpo_packed.fa_kwargs)
        return forward(*args, **kwargs)
    return run


def _alone_forward(forward, now: dict):
    """A linear-attention mixer's forward over a packed batch (`now`, from its decoder layer):
    its rows [rows, W, D] regathered into one right-padded row per sequence [S, longest, D]
    (Packed.seq_index), run from a zero state with its short causal convolution starting at the
    sequence (exactly the sequence alone: padding past its end reaches nothing before it), and
    put back; columns outside every sequence get zeros. Without a packed batch: as it was."""
    def run(*args, **kwargs):
        p = now.get("packed")
        if p is None or p.seq_index is None:
            return forward(*args, **kwargs)
        hidden = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
        args = args if not args or args[0] is not hidden else args[1:]
        for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "attention_mask"):
            kwargs.pop(k, None)  # the sequences now lie one per row, unpadded up to their ends
        index, valid = p.seq_index, p.seq_index >= 0
        flat = hidden.reshape(-1, hidden.shape[-1])
        alone = flat[index.clamp(min=0)] * valid[..., None].to(flat.dtype)     # [S, L, D]
        out = forward(alone, *args, **kwargs)                                  # [S, L, D]
        back = out.new_zeros(flat.shape[0], out.shape[-1]).index_put((index[valid],), out[valid])
        return back.reshape(*hidden.shape[:-1], out.shape[-1])
    return run


def _spread(lp_sel: torch.Tensor, ent_sel: torch.Tensor, at: tuple, keep: torch.Tensor,
            entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] (`keep`'s shape) logprobs and entropies: the computed ones at `at` (rows, columns;
    row-major), 0 outside `keep`; the entropies detached unless `entropy_grad`. index_put, not
    masked_scatter: the latter's backward reads the mask's count to the host."""
    lp = torch.zeros(keep.shape, dtype=lp_sel.dtype, device=lp_sel.device).index_put(at, lp_sel)
    ent = torch.zeros(keep.shape, dtype=ent_sel.dtype, device=ent_sel.device).index_put(
        at, ent_sel if entropy_grad else ent_sel.detach())
    return torch.where(keep, lp, 0.0), torch.where(keep, ent, 0.0)


def rope_index_fn(model):
    """The model's own mRoPE index function (`get_rope_index` of its multimodal base model), or
    None for a model with 1-D positions (text LLMs). Looks through wrappers (FSDP2, PEFT)."""
    todo, seen = [model], set()
    while todo:
        m = todo.pop(0)
        if m is None or id(m) in seen or len(seen) > 8:
            continue
        seen.add(id(m))
        fn = getattr(m, "get_rope_index", None)
        if callable(fn):
            return fn
        todo += [getattr(m, "model", None), getattr(m, "base_model", None)]
    return None


def padded_positions(model, batch: MicroBatch, tokens) -> torch.Tensor:
    """Position ids of one row per episode with images (mRoPE [3, rows, W]), as transformers'
    forward computes them from the same inputs (its rope index over the ids, image token types,
    grids and attention mask), on the host record and moved once (no device sync)."""
    with torch.profiler.record_function(HOST_SCOPE):
        h = batch.host if batch.host is not None else batch
        ids = h.input_ids.cpu()
        pos, _ = rope_index_fn(model)(ids, (ids == tokens.image_pad).int(),
                                      image_grid_thw=h.image_grid_thw.cpu(),
                                      attention_mask=h.attention_mask.cpu())
        return pos.to(batch.input_ids.device)


def packed_positions(model, batch: MicroBatch, tokens) -> torch.Tensor:
    """Position ids of a packed batch (inputs.pack): each sequence's prompt as the model computes
    it alone (mRoPE [3, rows, W] with its images' 3D grids, where the model has its own rope
    index; else 1-D [rows, W]), then every response of it continues from the prompt's largest
    position + 1, as generation does. Padding gets 0. Computed on the host, from the record as
    collated (MicroBatch.host), and moved to the batch's device once: the rope index reads its
    grids and token types per sequence, which on the device would be a host sync each."""
    with torch.profiler.record_function(HOST_SCOPE):
        h = batch.host if batch.host is not None else batch
        return _packed_positions(model, h, tokens).to(batch.input_ids.device)


def _packed_positions(model, batch: MicroBatch, tokens) -> torch.Tensor:
    p, ids = batch.packed, batch.input_ids
    plen, row, col = p.prompt_len.tolist(), p.seq_row.tolist(), p.seq_col.tolist()
    order = sorted(range(len(plen)), key=lambda k: (row[k], col[k]))  # as the images
    S, P, W = len(order), max(plen), ids.shape[1]
    lens = torch.tensor([plen[k] for k in order])
    am = torch.arange(P)[None, :] < lens[:, None]                               # [S, P]
    rows = torch.tensor([row[k] for k in order])
    cols = (torch.tensor([col[k] for k in order])[:, None] + torch.arange(P)[None, :]).clamp(max=W - 1)
    prompt = torch.where(am, ids.cpu()[rows[:, None], cols], tokens.pad)        # [S, P]
    rope_index = rope_index_fn(model)
    if rope_index is None:
        pos = (torch.arange(P)[None, :] * am)[None]                              # [1, S, P]
    else:
        grid = None if batch.image_grid_thw is None else batch.image_grid_thw.cpu()
        pos, _ = rope_index(prompt, (prompt == tokens.image_pad).int(), image_grid_thw=grid,
                            attention_mask=am.long())
    out = torch.zeros(pos.shape[0], ids.shape[0], W, dtype=torch.long)
    # the prompts' own columns, sequence-major: (row, column) of each, and where in [S, P]
    seq = [k for k in range(S) for _ in range(plen[order[k]])]
    at = [j for k in range(S) for j in range(plen[order[k]])]
    r_idx = rows[seq]
    c_idx = cols[seq, at]
    out[:, r_idx, c_idx] = pos[:, seq, at]
    nxt = torch.zeros(S, dtype=torch.long)
    nxt[torch.tensor(order)] = pos.amax(dim=(0, 2)) + 1
    # a response token j tokens into its response, of sequence k: position nxt[k] + j
    pred_seq, pred_row, target_col, offset = (t.cpu() for t in (p.pred_seq, p.pred_row, p.target_col, p.offset))
    out[:, pred_row, target_col] = (nxt[pred_seq] + offset).expand(pos.shape[0], -1)
    if rope_index is None:
        return out[0]
    if p.mask_4d is not None or p.plan is not None:
        return out
    # varlen: a first row of text positions restarting per sequence, which is where transformers'
    # VL models find packed sequences ([4, rows, W]: text + the 3 mRoPE rows)
    text = torch.zeros(1, *ids.shape, dtype=torch.long)
    text[0, r_idx, c_idx] = torch.tensor(at, dtype=torch.long)
    text[0, pred_row, target_col] = p.prompt_len.cpu()[pred_seq] + offset
    return torch.cat([text, out])


def _logprobs_at(model, at, targets: torch.Tensor, tokens, temperature: float, entropy_grad: bool,
                 batch: MicroBatch, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob, entropy) of `targets` [N] predicted at the `at` positions of the model's hidden
    states (head.on_head: computed inside the LM head's forward, where FSDP2 has gathered its
    weights, in token chunks, so no [N, vocab] tensor exists). The batch's MoE routing is
    replayed (routing.replaying), its blank image run (:func:`_blank_vision`)."""
    handles = []
    if batch.blank_image is not None:
        handles.append(model.get_input_embeddings().register_forward_hook(
            _blank_vision(model, *batch.blank_image)))
    if batch.pixel_values is not None and F.places_images(model):
        handles.append(model.get_input_embeddings().register_forward_hook(_image_hook(model, batch, tokens)))
    try:
        with head.on_head(model.get_output_embeddings(), at, targets, tokens.suppressed, temperature,
                          entropy_grad), routing.replaying(model, batch.routing, batch.routing_counted):
            out = model(**inputs, logits_to_keep=0).logits       # 0: every position reaches the hook
    finally:
        for h in handles:
            h.remove()
    return out[:, 0], out[:, 1]                                  # [N, 2] -> [N], [N]


def _blank_vision(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
    """A forward hook on the input embeddings for a micro-batch without images whose peers'
    (other trainer ranks') show some: the vision tower runs once on a blank image and its output,
    times 0, joins the embeddings (verl's and EasyR1's way). Every rank then all-gathers the
    tower's FSDP shards in the forward and reduces its gradients after the backward, as the peers
    do (a rank that skipped them would hang or break the collectives), while every value and
    gradient stays what it was without it (the tower's: exact zeros)."""
    ran = []

    def hook(_module, _args, out):
        if ran:  # one tower call per forward, as a peer's
            return None
        ran.append(True)
        features = model.get_image_features(pixel_values, image_grid_thw=grid_thw)
        zero = 0.0 * sum(t.float().sum() for t in _tensors(features))  # every output: every weight
        return out + zero.to(out.dtype)
    return hook


def _image_hook(model, batch: MicroBatch, tokens):
    """A forward hook on the input embeddings that puts the batch's image features (the vision
    tower's output, families.image_features) at its image tokens, whose places come from the
    host record: what transformers' forward does with `get_placeholder_mask` and
    `masked_scatter`, the same values in the same places, without their host syncs (the first
    formats the image-token count into its check, the second's backward reads its mask's count).
    The count is checked here, on the host."""
    with torch.profiler.record_function(HOST_SCOPE):
        h = batch.host if batch.host is not None else batch
        grid = h.image_grid_thw.cpu()
        at = (h.input_ids.cpu() == tokens.image_pad).nonzero(as_tuple=True)
        merge = F.vision_tower(model).spatial_merge_size
        if (n := int(grid.prod(-1).sum()) // merge ** 2) != at[0].numel():
            raise ModelError(f"image features and image tokens do not match: {n} features, "
                             f"{at[0].numel()} tokens")
        device = batch.input_ids.device
        at = tuple(t.to(device) for t in at)
        tower = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                 for k, v in F.vision_inputs(model, grid).items()}

    def hook(_module, _args, out):
        features = F.image_features(model, batch.pixel_values, batch.image_grid_thw, tower)
        return out.index_put(at, features.to(out.device, out.dtype))
    return hook


def _tensors(out) -> list[torch.Tensor]:
    """The floating-point tensors of a model output (a tensor, a ModelOutput, nested tuples)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict):  # transformers' ModelOutput is one
        out = list(out.values())
    return [t for x in out for t in _tensors(x)] if isinstance(out, (tuple, list)) else []


# ----------------------------------------------------------------------------- loading
def load_model(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """The model at `path`, every weight loaded, in eval mode (a policy that trains must call
    `.train()`, or activation checkpointing never runs). Any weight missing, unexpected or of
    another shape is a ModelError naming the first few keys."""
    config = load_config(path)
    refuse_dropout(config, path)
    try:
        model, info = F.auto_class(config).from_pretrained(path, dtype=dtype,
                                                           attn_implementation="sdpa",
                                                           output_loading_info=True,
                                                           **_kernels(torch.device(device).type))
    except (RuntimeError, ValueError) as e:  # size mismatches and the like
        raise ModelError(f"model.path={path}: the weights do not fit {config.model_type}'s "
                         f"architecture ({one_line(e, 240, typed=False)})") from None
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(kind) or ())
        if keys:
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            raise ModelError(f"model.path={path}: {kind.replace('_keys', '')} weights: "
                             f"{', '.join(keys[:3])}{more} ({config.model_type}); the folder does "
                             "not hold this model's weights")
    return model.to(device)


def model_from_config(path: str, dtype: torch.dtype = torch.float32, meta: bool = False,
                      device_type: str = "cpu", attention: str = "sdpa"):
    """The architecture of `path` with random (or, `meta`, no) weights: no weight file is read.
    `device_type`: where it will run ("cpu", "cuda", "npu"; its kernels: device.Device.experts)."""
    config = load_config(path)
    refuse_dropout(config, path)
    with torch.device("meta") if meta else torch.device("cpu"):
        model = F.auto_class(config).from_config(config, dtype=dtype, attn_implementation=attention,
                                                 **_kernels(device_type))
    if attention == "flash_attention_2":  # NPU's TND call takes at most so many sequences
        D.chunk_vision(model, D.TABLE[device_type].varlen_max_seqs)
    return model


def attention_for(packed: str | None) -> str:
    """transformers' attn_implementation for the trainer's models under a RowLayout's `packed`
    (device.Device.packed_attention; None: not packing)."""
    return {"varlen": "flash_attention_2", "segments": attention.NAME}.get(packed, "sdpa")


def _kernels(device_type: str) -> dict:
    """transformers' implementation choices for a model that runs on `device_type`: the MoE
    experts' (device.Device.experts; a dense model ignores it), where the device row names one."""
    row = D.TABLE.get(device_type)
    return {"experts_implementation": row.experts} if row is not None and row.experts else {}


def refuse_dropout(config, path: str) -> None:
    """ModelError for attention dropout: the trainer's train-mode logprobs must equal the
    engines' eval-mode ones (the GRPO ratio); it is the families' only mode-dependent op."""
    p = getattr(text_config(config), "attention_dropout", 0.0)
    if p:
        raise ModelError(f"model.path={path}: attention_dropout={p}; the policy must be "
                         "deterministic in train mode (GRPO ratio, engine/trainer logprob parity): "
                         "set it to 0.0 in the model's config.json")


def checkpoint_pieces(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple]]:
    """How parameter `name` of `shape` goes to an engine: [(checkpoint name, index into the
    parameter)], in order. Fused MoE experts (`experts.gate_up_proj` [E, 2I, H], gate rows
    first; `experts.down_proj` [E, H, I]) go per expert (`experts.{e}.gate_proj.weight`, ...);
    anything else goes whole (index `()`)."""
    head, _, leaf = name.rpartition(".")
    if head.endswith("experts") and len(shape) == 3 and leaf in ("gate_up_proj", "down_proj"):
        E, rows = shape[0], shape[1]
        if leaf == "down_proj":
            return [(f"{head}.{e}.down_proj.weight", (e,)) for e in range(E)]
        half = rows // 2
        return [piece for e in range(E) for piece in
                ((f"{head}.{e}.gate_proj.weight", (e, slice(0, half))),
                 (f"{head}.{e}.up_proj.weight", (e, slice(half, rows))))]
    return [(name, ())]
