"""The policy model: loading Qwen2.5-VL, building the tiny random one, prompts, logprobs, FSDP2.

Owns everything that touches the model's structure, so that train.py, rollout.py and sync.py
stay free of Qwen2.5-VL details:
- `build_tiny(dir)`: a randomly initialised Qwen2.5-VL (about 0.3M parameters) with a locally
  made byte-level tokenizer and an image-processor config, written as an ordinary Hugging Face
  folder. The CPU demo and every test use it; nothing is downloaded.
- `Tokens`: the token ids the engines and the trainer must agree on (image placeholder, eos,
  the ids sampling must never produce).
- `prompt_ids` / `expand_images`: the chat prompt as token ids, with ONE unexpanded image
  placeholder per image (what vLLM wants) or expanded to the image's patch count (what
  transformers wants).
- `sequence_logprobs`: the trainer's forward pass, with the same multimodal (mRoPE) positions
  the engine used.
- `apply_fsdp`: FSDP2 over the trainer-only mesh, one function.

Logprob convention (engine and trainer alike): log softmax of `logits / temperature` over the
full vocabulary with the suppressed ids removed, i.e. the policy that sampling draws from before
top-p / top-k truncation (as verl does). Top-p / top-k therefore make the engine sample from a
slightly different distribution than the one the loss sees; keep them off (the defaults) for
exact on-policy training.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

IMAGE_PAD = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
SYSTEM_PROMPT = "You are a helpful assistant."
TINY = "tiny"  # `[model] path = "tiny"` builds the random model under the run folder
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------- tiny model
def build_tiny(out_dir: str | Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    """Write a random tiny Qwen2.5-VL, its tokenizer and image processor to `out_dir`.

    Deterministic in `seed`. The tokenizer is byte-level (256 byte tokens, no merges) plus the
    Qwen chat / vision special tokens and `<think>`, `</think>`, `<answer>`, `</answer>` as single
    tokens, so a tiny policy can learn the answer format. Returns the folder. Safe to call from
    several processes at once (a file lock; the folder appears complete or not at all).
    """
    out = Path(out_dir)
    if (out / "model.safetensors").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    import fcntl
    with open(out.with_name(out.name + ".lock"), "w") as lock:  # one builder at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "model.safetensors").exists():
            _build_tiny(out, seed, hidden, layers)
    return out


def _build_tiny(out: Path, seed: int, hidden: int, layers: int) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import (PreTrainedTokenizerFast, Qwen2_5_VLConfig,
                              Qwen2_5_VLForConditionalGeneration)

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", VISION_START, VISION_END,
                IMAGE_PAD, "<|video_pad|>"]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.add_tokens([AddedToken(s, special=False, normalized=False)
                    for s in ["<think>", "</think>", "<answer>", "</answer>"]])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.save_pretrained(tmp)

    head_dim = 32  # vLLM's CPU attention supports 32, 64, 80, ... but not 16
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in specials}
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=layers, num_attention_heads=hidden // head_dim,
            num_key_value_heads=max(1, hidden // head_dim // 2), max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [4, 6, 6]},  # sums to head_dim / 2
            tie_word_embeddings=False, bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
            spatial_merge_size=2, temporal_patch_size=2, window_size=56,
            fullatt_block_indexes=[1], out_hidden_size=hidden),  # out = text hidden size
        image_token_id=ids[IMAGE_PAD], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=False)
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    # transformers' default init (std 0.02) gives a nearly uniform policy; a larger init makes
    # the tiny random model's samples varied enough for GRPO groups to disagree.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 0.08)
    # Written directly: transformers' save_pretrained silently skips non-zero ranks once
    # torch.distributed is initialised, and any rank may be the one building.
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    _image_processor_cls()(min_pixels=56 * 56, max_pixels=112 * 112).save_pretrained(tmp)
    (tmp / "README.md").write_text("Random tiny Qwen2.5-VL built by model.build_tiny "
                                   f"(seed {seed}); for tests and the CPU demo only.\n")
    tmp.rename(out)  # atomic: a half-written folder is never seen as the model


def resolve_path(path: str, run_dir: Path, seed: int) -> str:
    """`"tiny"` -> build (once) the tiny random model under the run folder; else `path`."""
    if path == TINY:
        return str(build_tiny(run_dir / "tiny-model", seed=seed))
    return path


# ----------------------------------------------------------------------------- processors
def _image_processor_cls():
    # The one image processor class on every device, in the trainer and (forced and checked by
    # vllm_engine.checked_processor) in every vLLM process: the torchvision-backed one cannot
    # import beside the CPU torch build, and its pixels differ slightly from the PIL one's.
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import \
        Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def load_image_processor(path: str, min_pixels: int, max_pixels: int):
    """The model's image processor with the run's pixel bounds (shared with every engine)."""
    return _image_processor_cls().from_pretrained(path, min_pixels=min_pixels,
                                                  max_pixels=max_pixels)


@dataclass(frozen=True)
class Processors:
    """What the engines and the trainer must agree on: the tokenizer, the token ids and the image
    processor (with the run's pixel bounds)."""
    tokenizer: Any
    tokens: "Tokens"
    image_processor: Any


def load_processors(path: str, min_pixels: int, max_pixels: int) -> Processors:
    tokenizer = load_tokenizer(path)
    return Processors(tokenizer, Tokens.of(tokenizer, vocab_size(path)),
                      load_image_processor(path, min_pixels, max_pixels))


def load_model(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """The model at `path`, as loaded (transformers leaves it in eval mode: a policy that trains
    must call `.train()`, or activation checkpointing never runs)."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=dtype,
                                                               attn_implementation="sdpa")
    refuse_dropout(model.config, path)
    return model.to(device)


def refuse_dropout(config, path: str) -> None:
    """Train mode must compute what eval mode computes: the trainer's logprobs (train mode) are
    compared with the engines' (eval) and enter the GRPO ratio. Qwen2.5-VL's only mode-dependent
    op is the text attention's dropout (the vision tower hard-codes 0)."""
    p = getattr(getattr(config, "text_config", config), "attention_dropout", 0.0)
    if p:
        raise ValueError(f"model.path={path}: text_config.attention_dropout={p}; the policy must be "
                         "deterministic in train mode (GRPO ratio, engine/trainer logprob parity): "
                         "set it to 0.0 in the model's config.json")


@dataclass(frozen=True)
class Tokens:
    """Token ids both engines and the trainer agree on."""
    image_pad: int
    vision_start: int
    vision_end: int
    eos: int
    pad: int
    vocab_size: int                 # the model's output width (may exceed the tokenizer's)
    suppressed: tuple[int, ...]     # never sampled: special tokens other than eos, unused rows

    @staticmethod
    def of(tokenizer, vocab_size: int) -> "Tokens":
        conv = tokenizer.convert_tokens_to_ids
        eos = conv("<|im_end|>")
        special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        # A random model samples vision placeholders and chat markers; the trainer's re-encoding
        # would then see image tokens without images. Suppress them on both sides (TRL does).
        suppressed = sorted((special - {eos}) | set(range(len(tokenizer), vocab_size)))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        return Tokens(conv(IMAGE_PAD), conv(VISION_START), conv(VISION_END), eos, pad,
                      vocab_size, tuple(suppressed))


def prompt_ids(tokenizer, user_text: str, n_images: int, tokens: Tokens) -> list[int]:
    """Qwen2.5-VL chat prompt with ONE unexpanded image placeholder per image."""
    def enc(s: str) -> list[int]:
        return tokenizer.encode(s, add_special_tokens=False)
    image = [tokens.vision_start, tokens.image_pad, tokens.vision_end] * n_images
    return (enc(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n") + image
            + enc(f"{user_text}<|im_end|>\n<|im_start|>assistant\n"))


def image_inputs(image_processor, images: list, cache: dict | None = None) -> dict[str, torch.Tensor]:
    """pixel_values [sum patches, C*T*P*P] and image_grid_thw [n_images, 3] for PIL images.

    `cache` (keyed by `id(image)`, so it holds the images alive: keep it as long as the dataset):
    each image is processed once per run instead of once per step and micro-batch."""
    if cache is None:
        out = image_processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    for im in images:
        if id(im) not in cache:
            one = image_processor(images=[im], return_tensors="pt")
            cache[id(im)] = (im, one["pixel_values"], one["image_grid_thw"])
    return {"pixel_values": torch.cat([cache[id(im)][1] for im in images]),
            "image_grid_thw": torch.cat([cache[id(im)][2] for im in images])}


def n_image_tokens(grid_thw: torch.Tensor, merge_size: int = 2) -> list[int]:
    return [int(g.prod()) // merge_size ** 2 for g in grid_thw]


def n_image_tokens_of(image_processor, image) -> int:
    """Image tokens one PIL image becomes (without running the processor on its pixels)."""
    ip = image_processor
    return ip.get_number_of_image_patches(image.height, image.width, {}) // ip.merge_size ** 2


def prompt_len(procs: Processors, user_text: str, image) -> int:
    """Tokens of the chat prompt once its one image placeholder is expanded."""
    ids = prompt_ids(procs.tokenizer, user_text, 1, procs.tokens)
    return len(ids) - 1 + n_image_tokens_of(procs.image_processor, image)


def expand_images(ids: list[int], counts: list[int], image_pad: int) -> list[int]:
    """Repeat the i-th image placeholder counts[i] times (transformers' expanded form)."""
    if ids.count(image_pad) != len(counts):
        raise ValueError(f"{ids.count(image_pad)} image placeholders for {len(counts)} images")
    out: list[int] = []
    it = iter(counts)
    for t in ids:
        out.extend([t] * next(it) if t == image_pad else [t])
    return out


def vocab_size(path: str) -> int:
    """The model's output width, read from its config without loading weights."""
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(path)
    return getattr(cfg, "text_config", cfg).vocab_size


def collate(episodes, images: list, image_processor, tokens: Tokens, device: torch.device,
            share_prompt: bool = False, pixels: dict | None = None) -> dict[str, torch.Tensor]:
    """Trainer batch of `episodes` (one image each), for :func:`sequence_logprobs`.

    Both layouts give `response_mask` and `engine_logprobs` [B, T] in episode order (1 on response
    tokens; the engine's logprob of each), aligned with what :func:`sequence_logprobs` returns,
    plus input_ids, attention_mask [rows, W] (1 on real tokens), pixel_values, image_grid_thw,
    and episode_tokens (prompt + response tokens of every episode, however laid out).
    - one row per episode (`share_prompt=False`): prompt + response, right-padded; T = W.
    - one row per prompt (`share_prompt=True`, :func:`pack`): consecutive episodes with the same
      prompt share one copy of it, followed by each response; an attention mask lets every
      response see the prompt and itself only, so the result equals one row per episode while the
      prompt (and its image) is encoded once per group instead of G times. T = longest response.
    `pixels`: a cache of processed images by `id(image)` (the trainer keeps one per run).
    """
    if share_prompt:
        return pack(episodes, images, image_processor, tokens, device, pixels)
    mm = image_inputs(image_processor, images, pixels)
    counts = n_image_tokens(mm["image_grid_thw"])
    prompts = [expand_images(e.prompt_ids, [c], tokens.image_pad) for e, c in zip(episodes, counts)]
    width = max(len(p) + len(e.response_ids) for p, e in zip(prompts, episodes))
    B = len(episodes)
    ids = torch.full((B, width), tokens.pad, dtype=torch.long)
    attn = torch.zeros(B, width, dtype=torch.long)
    resp = torch.zeros(B, width, dtype=torch.long)
    engine_lp = torch.zeros(B, width, dtype=torch.float32)
    for i, (p, e) in enumerate(zip(prompts, episodes)):
        n, r = len(p), len(e.response_ids)
        ids[i, :n + r] = torch.tensor(p + e.response_ids)
        attn[i, :n + r] = 1
        resp[i, n:n + r] = 1
        engine_lp[i, n:n + r] = torch.tensor(e.logprobs, dtype=torch.float32)
    out = dict(input_ids=ids, attention_mask=attn, response_mask=resp, engine_logprobs=engine_lp,
               pixel_values=mm["pixel_values"], image_grid_thw=mm["image_grid_thw"],
               episode_tokens=attn.sum())
    return {k: v.to(device) for k, v in out.items()}


def pack(episodes, images: list, image_processor, tokens: Tokens, device: torch.device,
         pixels: dict | None = None) -> dict[str, torch.Tensor]:
    """One row per run of consecutive episodes with the same prompt (see :func:`collate`).

    Row layout: [prompt (image expanded) | response 1 | response 2 | ... | padding]. Extra keys:
    `attention_mask_4d` [rows, 1, W, W] (bool: a prompt token sees the prompt causally; a response
    token sees the prompt and its own response causally; padding sees itself), `prompt_len`
    [rows], and for every response token (episode-major) its row, the column whose hidden state
    predicts it, its own column and its index in its response: `pred_row`, `pred_col`,
    `target_col`, `offset` [N].
    """
    runs: list[list[int]] = []
    for i, e in enumerate(episodes):
        if runs and episodes[runs[-1][0]].prompt_ids == e.prompt_ids and images[runs[-1][0]] is images[i]:
            runs[-1].append(i)
        else:
            runs.append([i])
    mm = image_inputs(image_processor, [images[r[0]] for r in runs], pixels)
    counts = n_image_tokens(mm["image_grid_thw"])
    rows, starts = [], [0] * len(episodes)
    for r, c in zip(runs, counts):
        row = expand_images(episodes[r[0]].prompt_ids, [c], tokens.image_pad)
        plen = len(row)
        for i in r:
            starts[i] = len(row)
            row = row + episodes[i].response_ids
        rows.append((plen, row))
    W, R, B = max(len(row) for _, row in rows), len(rows), len(episodes)
    T = max(len(e.response_ids) for e in episodes)
    ids = torch.full((R, W), tokens.pad, dtype=torch.long)
    attn = torch.zeros(R, W, dtype=torch.long)
    mask4 = torch.zeros(R, 1, W, W, dtype=torch.bool)
    causal = torch.ones(W, W, dtype=torch.bool).tril()
    for k, (plen, row) in enumerate(rows):
        ids[k, :len(row)] = torch.tensor(row)
        attn[k, :len(row)] = 1
        mask4[k, 0, :len(row), :plen] = causal[:len(row), :plen]  # everyone sees the prompt (causally)
        mask4[k, 0, range(W), range(W)] = True                    # padding sees itself: no empty row
    resp = torch.zeros(B, T, dtype=torch.long)
    engine_lp = torch.zeros(B, T, dtype=torch.float32)
    pred_row, pred_col, target_col, offset = [], [], [], []
    for k, (r, (plen, _)) in enumerate(zip(runs, rows)):
        for i in r:
            s, n = starts[i], len(episodes[i].response_ids)
            mask4[k, 0, s:s + n, s:s + n] = causal[:n, :n]
            resp[i, :n] = 1
            engine_lp[i, :n] = torch.tensor(episodes[i].logprobs, dtype=torch.float32)
            pred_row += [k] * n
            pred_col += [plen - 1] + list(range(s, s + n - 1))    # the first token is predicted
            target_col += list(range(s, s + n))                    # by the prompt's last token
            offset += list(range(n))
    out = dict(input_ids=ids, attention_mask=attn, attention_mask_4d=mask4, response_mask=resp,
               engine_logprobs=engine_lp, pixel_values=mm["pixel_values"],
               image_grid_thw=mm["image_grid_thw"], prompt_len=torch.tensor([p for p, _ in rows]),
               pred_row=torch.tensor(pred_row), pred_col=torch.tensor(pred_col),
               target_col=torch.tensor(target_col), offset=torch.tensor(offset),
               episode_tokens=torch.tensor(sum(rows[k][0] + len(episodes[i].response_ids)
                                               for k, r in enumerate(runs) for i in r)))
    return {k: v.to(device) for k, v in out.items()}


# ----------------------------------------------------------------------------- logprobs
def masked_logits(logits: torch.Tensor, tokens: Tokens, temperature: float) -> torch.Tensor:
    """The policy's logits as the engines sample them: suppressed ids removed, tempered."""
    logits = logits.float()
    if tokens.suppressed:
        logits = logits.index_fill(-1, torch.tensor(tokens.suppressed, device=logits.device),
                                   float("-inf"))
    return logits / temperature


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, tokens: Tokens,
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each target token, entropy) under the convention in the module docstring."""
    lp = torch.log_softmax(masked_logits(logits, tokens, temperature), dim=-1)
    picked = lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    p = lp.exp()
    entropy = -(p * lp.nan_to_num(neginf=0.0)).sum(-1)
    return picked, entropy


def sequence_logprobs(model, batch: dict[str, torch.Tensor], tokens: Tokens,
                      temperature: float,
                      entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer forward: logprobs and entropies of the response tokens of a :func:`collate` batch,
    aligned with its `response_mask` (zero elsewhere). The entropies are detached unless
    `entropy_grad` (the entropy bonus, `loss.entropy_coef > 0`: its graph keeps a vocabulary-wide
    tensor per token alive until the backward).

    Only the positions that predict a response token go through the LM head (the fp32
    log-softmax over a 150k vocabulary is the largest activation of a step; prompt positions
    would only be masked out).
    """
    if "attention_mask_4d" in batch:
        return _packed_logprobs(model, batch, tokens, temperature, entropy_grad)
    ids = batch["input_ids"]
    mask = batch["response_mask"][:, 1:].bool()                  # [B, L-1]: predicts t+1
    keep = torch.zeros_like(ids, dtype=torch.bool)
    keep[:, :-1] = mask
    # mm_token_type_ids marks the image tokens; without it transformers silently falls back to
    # text-only positions and the logprobs no longer match generation (mRoPE).
    logits = _logits_at(model, keep, input_ids=ids, attention_mask=batch["attention_mask"],
                        pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                        mm_token_type_ids=(ids == tokens.image_pad).int(), use_cache=False)
    rows = mask.nonzero(as_tuple=True)                           # row-major, as `keep`
    lp_sel, ent_sel = token_logprobs(logits, ids[:, 1:][rows], tokens, temperature)
    lp = torch.zeros(ids.shape, dtype=lp_sel.dtype, device=lp_sel.device)
    ent = torch.zeros(ids.shape, dtype=ent_sel.dtype, device=ent_sel.device)
    shifted = (rows[0], rows[1] + 1)                             # column t holds token t
    ent_sel = ent_sel if entropy_grad else ent_sel.detach()
    return lp.index_put(shifted, lp_sel), ent.index_put(shifted, ent_sel)


def _packed_logprobs(model, batch: dict[str, torch.Tensor], tokens: Tokens,
                     temperature: float,
                     entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    ids, pr, pc = batch["input_ids"], batch["pred_row"], batch["pred_col"]
    keep = torch.zeros_like(ids, dtype=torch.bool)
    keep[pr, pc] = True
    logits = _logits_at(model, keep, input_ids=ids, attention_mask=batch["attention_mask_4d"],
                        position_ids=packed_positions(model, batch, tokens),
                        pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                        mm_token_type_ids=(ids == tokens.image_pad).int(), use_cache=False)
    where = torch.full(ids.shape, -1, dtype=torch.long, device=ids.device)
    where[keep] = torch.arange(int(keep.sum()), device=ids.device)  # row-major, as the logits
    lp_sel, ent_sel = token_logprobs(logits[where[pr, pc]], ids[pr, batch["target_col"]], tokens,
                                     temperature)
    resp = batch["response_mask"].bool()                         # [B, T], episode-major as pr
    lp = torch.zeros(resp.shape, dtype=lp_sel.dtype, device=lp_sel.device)
    ent = torch.zeros(resp.shape, dtype=ent_sel.dtype, device=ent_sel.device)
    ent_sel = ent_sel if entropy_grad else ent_sel.detach()
    return lp.masked_scatter(resp, lp_sel), ent.masked_scatter(resp, ent_sel)


def packed_positions(model, batch: dict[str, torch.Tensor], tokens: Tokens) -> torch.Tensor:
    """mRoPE position ids [3, rows, W] of a packed batch: the prompt's as the model computes them
    (its image's 3D grid), then every response continues from the prompt's largest position + 1,
    as generation does (so a response's positions do not depend on the responses before it)."""
    ids, plen = batch["input_ids"], batch["prompt_len"].tolist()
    R, P = ids.shape[0], max(plen)
    prompt = ids[:, :P].clone()
    am = (torch.arange(P, device=ids.device)[None, :] < torch.tensor(plen, device=ids.device)[:, None])
    prompt[~am] = tokens.pad
    base = model.model  # Qwen2_5_VLModel; a plain method, no parameters touched
    pos, _ = base.get_rope_index(prompt, (prompt == tokens.image_pad).int(),
                                 image_grid_thw=batch["image_grid_thw"], attention_mask=am.long())
    out = torch.zeros(3, R, ids.shape[1], dtype=torch.long, device=ids.device)
    out[:, :, :P] = pos
    nxt = (pos.amax(dim=(0, 2)) + 1).tolist()
    pr, tc = batch["pred_row"], batch["target_col"]
    # a response token j tokens into its response, in row r: position nxt[r] + j
    out[:, pr, tc] = (torch.tensor(nxt, device=ids.device)[pr] + batch["offset"]).expand(3, -1)
    return out


def _logits_at(model, keep: torch.Tensor, **inputs) -> torch.Tensor:
    """The model's logits at the `keep` positions [N, V] (row-major), the LM head applied to
    those hidden states only where transformers supports a boolean `logits_to_keep`."""
    if _BOOL_LOGITS_TO_KEEP:
        logits = model(**inputs, logits_to_keep=keep).logits
        return logits.reshape(-1, logits.shape[-1])
    return model(**inputs).logits[keep]


def _bool_logits_to_keep() -> bool:
    """transformers >= 5.x's `slice_logits_to_keep` takes a boolean [B, L] mask (5.24 does)."""
    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:
        return False
    import inspect
    return "boolean" in (inspect.getdoc(slice_logits_to_keep) or "")


_BOOL_LOGITS_TO_KEEP = _bool_logits_to_keep()


# ----------------------------------------------------------------------------- FSDP2
def apply_fsdp(model, mesh, *, mixed_precision: bool = False, checkpointing: bool = False):
    """Shard the policy with FSDP2 over `mesh` (the trainer-only mesh).

    Each decoder layer and vision block is its own unit so that only one layer's full weights
    live at a time; the root unit then takes the embeddings, norms and lm_head. Order matters:
    children first, root last (fully_shard on the root skips already-sharded children).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if checkpointing:  # acts only in train mode (transformers checks `self.training`)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kw = {"mesh": mesh}
    if mixed_precision:  # bf16 compute, fp32 master weights and gradient reduction
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    for block in list(model.model.visual.blocks) + list(model.model.language_model.layers):
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


class CheckpointCounter:
    """Activation checkpointing at work, counted: `calls` is the number of layer forwards that went
    through the checkpoint function, `recomputes` the number of those the backward ran again
    (what checkpointing is for). Both stay 0 when checkpointing is off or the model is in eval
    mode. Wraps each layer's `_gradient_checkpointing_func` (transformers 5.x, set by
    `gradient_checkpointing_enable`); for tests and bench/step.py."""

    def __init__(self, model):
        self.calls = self.runs = 0
        for m in model.modules():
            f = getattr(m, "_gradient_checkpointing_func", None)
            if f is not None:
                m._gradient_checkpointing_func = self._wrap(f)

    def _wrap(self, checkpoint):
        def counted(fn, *args, **kwargs):
            self.calls += 1

            def run(*a, **k):
                self.runs += 1
                return fn(*a, **k)
            return checkpoint(run, *args, **kwargs)
        return counted

    @property
    def recomputes(self) -> int:
        return self.runs - self.calls

    def reset(self) -> None:
        self.calls = self.runs = 0
