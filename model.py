"""The policy model: loading any supported family, its logprobs, FSDP2.

Everything that touches the model's structure lives here; what differs between families is in
families.py, the rest is asked of the config or the model (docs/families.md).
`sequence_logprobs` is the trainer's forward over an inputs.collate batch (`tokens`, here and
below: the run's inputs.Tokens); `apply_fsdp` / `shard_from_rank0` shard it over the
trainer-only mesh. The logprob convention, shared with the engines: docs/loss.md.
"""
from __future__ import annotations

from pathlib import Path

import torch

import attention as A
import device as D
import families as F
import head as H
import routing as R
from errors import ModelError, one_line

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def _model_inputs(batch: dict[str, torch.Tensor], tokens) -> dict:
    """The images of a batch as the model takes them ({} without images). mm_token_type_ids
    marks the image tokens; without it transformers silently falls back to text-only positions
    and the logprobs no longer match generation (mRoPE)."""
    if "pixel_values" not in batch:
        return {}
    return dict(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                mm_token_type_ids=(batch["input_ids"] == tokens.image_pad).int())


def sequence_logprobs(model, batch: dict[str, torch.Tensor], tokens,
                      temperature: float,
                      entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer forward: logprobs and entropies of the response tokens of an inputs.collate batch,
    aligned with its `response_mask` (zero elsewhere). The entropies are detached unless
    `entropy_grad` (the entropy bonus). Only the positions that predict a response token go
    through the LM head."""
    if "pred_seq" in batch:  # packed rows (inputs.pack)
        return _packed_logprobs(model, batch, tokens, temperature, entropy_grad)
    ids = batch["input_ids"]
    mask = batch["response_mask"][:, 1:].bool()                  # [B, L-1]: predicts t+1
    rows = mask.nonzero(as_tuple=True)                           # the positions that predict, row-major
    lp_sel, ent_sel = _logprobs_at(model, rows, ids[:, 1:][rows], tokens, temperature, entropy_grad,
                                   batch.get("routing"), batch.get("routing_counted"), input_ids=ids,
                                   attention_mask=batch["attention_mask"], use_cache=False,
                                   **_model_inputs(batch, tokens))
    lp = torch.zeros(ids.shape, dtype=lp_sel.dtype, device=lp_sel.device)
    ent = torch.zeros(ids.shape, dtype=ent_sel.dtype, device=ent_sel.device)
    shifted = (rows[0], rows[1] + 1)                             # column t holds token t
    ent_sel = ent_sel if entropy_grad else ent_sel.detach()
    return lp.index_put(shifted, lp_sel), ent.index_put(shifted, ent_sel)


def _packed_logprobs(model, batch: dict[str, torch.Tensor], tokens,
                     temperature: float,
                     entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    ids, pr, pc = batch["input_ids"], batch["pred_row"], batch["pred_col"]
    # no 4-D mask for packed rows: attention.py's kernel takes the layout ("segments"), or the
    # varlen kernel finds the sequences from the restarting positions ("varlen")
    layout = {}
    if "segments" in batch:
        if (got := text_config(model.config)._attn_implementation) != A.NAME:
            raise ValueError(f"a packed batch's segments need a model built with attn_implementation="
                             f"{A.NAME!r} (trainer.build), not {got!r}")
        # the calls every layer makes, built once for the micro-batch
        layout = {"grpo_segments": A.plan(A.layout(batch["segments"].cpu()), ids.shape[1], ids.device)}
    # (pr, pc): a shared prompt's last position once per response it starts
    lp_sel, ent_sel = _logprobs_at(model, (pr, pc), ids[pr, batch["target_col"]], tokens, temperature,
                                   entropy_grad, batch.get("routing"), batch.get("routing_counted"),
                                   input_ids=ids, attention_mask=batch.get("attention_mask_4d"),
                                   position_ids=packed_positions(model, batch, tokens), use_cache=False,
                                   **_model_inputs(batch, tokens), **layout)
    slots = batch["response_slots"].bool()                       # [B, T], episode-major as pr
    keep = batch["response_mask"].bool()                         # multi-turn: without inserted tokens
    lp = torch.zeros(slots.shape, dtype=lp_sel.dtype, device=lp_sel.device)
    ent = torch.zeros(slots.shape, dtype=ent_sel.dtype, device=ent_sel.device)
    ent_sel = ent_sel if entropy_grad else ent_sel.detach()
    lp, ent = lp.masked_scatter(slots, lp_sel), ent.masked_scatter(slots, ent_sel)
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


def packed_positions(model, batch: dict[str, torch.Tensor], tokens) -> torch.Tensor:
    """Position ids of a packed batch (inputs.pack): each sequence's prompt as the model computes
    it alone (mRoPE [3, rows, W] with its images' 3D grids, where the model has its own rope
    index; else 1-D [rows, W]), then every response of it continues from the prompt's largest
    position + 1, as generation does. Padding gets 0."""
    ids, plen = batch["input_ids"], batch["prompt_len"]
    row, col = batch["seq_row"], batch["seq_col"]
    order = sorted(range(len(plen)), key=lambda k: (int(row[k]), int(col[k])))  # as the images
    S, P, dev = len(order), int(plen.max()), ids.device
    lens = plen[order].to(dev)
    am = torch.arange(P, device=dev)[None, :] < lens[:, None]                  # [S, P]
    cols = (col[order].to(dev)[:, None] + torch.arange(P, device=dev)[None, :]).clamp(max=ids.shape[1] - 1)
    prompt = torch.where(am, ids[row[order].to(dev)[:, None], cols], tokens.pad)  # [S, P]
    rope_index = rope_index_fn(model)
    if rope_index is None:
        pos = (torch.arange(P, device=dev)[None, :] * am)[None]                 # [1, S, P]
    else:
        pos, _ = rope_index(prompt, (prompt == tokens.image_pad).int(),
                            image_grid_thw=batch.get("image_grid_thw"), attention_mask=am.long())
    out = torch.zeros(pos.shape[0], ids.shape[0], ids.shape[1], dtype=torch.long, device=dev)
    r_idx = row[order].to(dev)[:, None].expand(-1, P)[am]
    out[:, r_idx, cols[am]] = pos[:, am]
    nxt = torch.zeros(S, dtype=torch.long, device=dev)
    nxt[torch.tensor(order, device=dev)] = pos.amax(dim=(0, 2)) + 1
    pr, tc = batch["pred_row"], batch["target_col"]
    # a response token j tokens into its response, of sequence k: position nxt[k] + j
    out[:, pr, tc] = (nxt[batch["pred_seq"]] + batch["offset"]).expand(pos.shape[0], -1)
    if rope_index is None:
        return out[0]
    if "attention_mask_4d" in batch or "segments" in batch:
        return out
    # varlen: a first row of text positions restarting per sequence, which is where transformers'
    # VL models find packed sequences ([4, rows, W]: text + the 3 mRoPE rows)
    text = torch.zeros(1, *ids.shape, dtype=torch.long, device=dev)
    text[0, r_idx, cols[am]] = torch.arange(P, device=dev)[None, :].expand(S, P)[am]
    text[0, pr, tc] = plen.to(dev)[batch["pred_seq"]] + batch["offset"]
    return torch.cat([text, out])


def _logprobs_at(model, at, targets: torch.Tensor, tokens, temperature: float, entropy_grad: bool,
                 routing: torch.Tensor | None = None, counted: torch.Tensor | None = None,
                 **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob, entropy) of `targets` [N] predicted at the `at` positions of the model's
    hidden states (head.on_head: computed inside the LM head's forward, where FSDP2 has gathered
    its weights, in token chunks, so no [N, vocab] tensor exists). `routing`: the batch's MoE
    routing to replay, `counted`: the entries its agreement counts (routing.replaying)."""
    with H.on_head(model.get_output_embeddings(), at, targets, tokens.suppressed, temperature,
                   entropy_grad), R.replaying(model, routing, counted):   # MoE: the engine's experts
        out = model(**inputs, logits_to_keep=0).logits           # 0: every position reaches the hook
    return out[:, 0], out[:, 1]                                  # [N, 2] -> [N], [N]


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
        return F.auto_class(config).from_config(config, dtype=dtype, attn_implementation=attention,
                                                **_kernels(device_type))


def attention_for(layout: str | None) -> str:
    """transformers' attn_implementation for the trainer's models under `train.packing`'s row
    layout (device.Device.packed_attention; None: not packing)."""
    return {"varlen": "flash_attention_2", "segments": A.NAME}.get(layout, "sdpa")


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


# ----------------------------------------------------------------------------- FSDP2
def fsdp_units(model) -> list:
    """The modules FSDP2 shards one at a time: every instance of the model's `_no_split_modules`
    (its decoder layers and vision blocks), children before parents."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def apply_fsdp(model, mesh, *, mixed_precision: bool = False, checkpointing: bool = False):
    """Shard the policy with FSDP2 over `mesh` (the trainer-only mesh): each decoder layer and
    vision block its own unit, children first, then the root (embeddings, norms, lm_head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if checkpointing:  # acts only in train mode (transformers checks `self.training`)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kw = {"mesh": mesh}
    if mixed_precision:  # bf16 compute, fp32 master weights and gradient reduction
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    for block in fsdp_units(model):
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


@torch.no_grad()
def shard_from_rank0(model, full, mesh, device: torch.device, group, *,
                     mixed_precision: bool = False, checkpointing: bool = False):
    """`model` sharded with FSDP2 over `mesh`, its weights those of `full` (the model loaded on
    the first trainer rank, None on the others). `model`: the architecture on the meta device
    (:func:`model_from_config`), with the same LoRA adapters as `full` if any; the first rank
    scatters each weight and broadcasts the buffers (rotary tables are in no state dict), so a
    trainer node holds one host copy of the model. Collective over `group` (the trainer ranks)."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    apply_fsdp(model, mesh, mixed_precision=mixed_precision, checkpointing=checkpointing)
    model.to_empty(device=device)
    src = dict(full.named_parameters()) if full is not None else {}
    for name, p in model.named_parameters():  # every parameter is a DTensor after fully_shard
        whole = (src[name].detach().to(device, p.dtype) if full is not None
                 else torch.empty(p.shape, dtype=p.dtype, device=device))
        p.to_local().copy_(distribute_tensor(whole, mesh, p.placements).to_local())
    bufs = dict(full.named_buffers()) if full is not None else {}
    for name, b in model.named_buffers():
        if full is not None:
            b.copy_(bufs[name])
        dist.broadcast(b, dist.get_global_rank(group, 0), group=group)
    return model
