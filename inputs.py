"""What goes into the model: `Processors` (what the engines and the trainer must agree on), the
prompt ids (`prompt_ids`: ONE placeholder per image, as vLLM takes them; `expand_images`: one
per image token, as transformers does) and the trainer's batches (`collate`).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

import attention
import families as F
import routing
from config import DataConfig, ModelConfig, RolloutConfig
from errors import ModelError, one_line
from model import HOST_SCOPE, MicroBatch, Packed, RowLayout, load_config, packs_exactly, text_config
from synthetic import IMAGE_MARKER


# ----------------------------------------------------------------------------- processors
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def load_tokenizer(path: str):
    """The folder's tokenizer; ModelError naming the files looked for when a local folder has
    none (transformers would otherwise go on with a wrong or empty one)."""
    from transformers import AutoTokenizer
    folder = Path(path)
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ModelError(f"model.path={path}: no tokenizer (looked for {', '.join(TOKENIZER_FILES)})")
    return AutoTokenizer.from_pretrained(path)


def load_image_processor(path: str, min_pixels: int, max_pixels: int):
    """The model's image processor with the run's pixel bounds (shared with every engine)."""
    return F.image_processor_cls().from_pretrained(path, min_pixels=min_pixels, max_pixels=max_pixels)


@dataclass(frozen=True)
class Chat:
    """How a prompt is rendered: the model's own chat template, the system turn
    (`data.system_prompt`, "" = the template's own behaviour) and `data.enable_thinking` (None =
    the template's default; passed only to a template that reads it)."""
    template: str
    system_prompt: str = ""
    enable_thinking: bool | None = None
    tools: tuple = ()  # `rollout.tools`' schemas (envs.tools.schemas), for the template's `tools`

    @property
    def takes_thinking(self) -> bool:
        return "enable_thinking" in self.template


@dataclass(frozen=True)
class Processors:
    """What the engines and the trainer must agree on: the tokenizer, the token ids, the image
    processor with the run's pixel bounds (None for a text-only model) and the chat template."""
    tokenizer: Any
    tokens: "Tokens"
    image_processor: Any
    chat: Chat
    packs_exactly: bool = True    # see model.packs_exactly

    @property
    def vision(self) -> bool:
        return self.image_processor is not None


def chat_template(path: str, tokenizer) -> str:
    """The model's chat template: the tokenizer's, else the processor's file in the folder
    (`chat_template.jinja` / `chat_template.json`, where the VLM releases keep it)."""
    if tokenizer.chat_template:
        return tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else \
            tokenizer.chat_template.get("default", "")
    folder = Path(path)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():
        return json.loads((folder / "chat_template.json").read_text()).get("chat_template", "")
    return ""


def load_processors(path: str, min_pixels: int, max_pixels: int, system_prompt: str = "",
                    enable_thinking: bool | None = None, tools: tuple = ()) -> Processors:
    """Everything prompts and batches need, from the model folder; ModelError (one line naming
    `model.path`) for an unsupported family, a missing chat template or one that fails to
    render."""
    config = load_config(path)
    tokenizer = load_tokenizer(path)
    template = chat_template(path, tokenizer)
    if not template:
        raise ModelError(f"model.path={path}: no chat template (tokenizer_config.json, "
                         "chat_template.jinja or chat_template.json); prompts are rendered with "
                         "the model's own template")
    ip = load_image_processor(path, min_pixels, max_pixels) if F.is_vlm(config) else None
    procs = Processors(tokenizer, Tokens.of(tokenizer, config, _stops(path, tokenizer)), ip,
                       Chat(template, system_prompt, enable_thinking, tuple(tools)), packs_exactly(config))
    if enable_thinking is not None and not procs.chat.takes_thinking:
        raise ModelError(f"data.enable_thinking={str(enable_thinking).lower()}: the chat template of "
                         f"model.path={path} takes no enable_thinking (it would be ignored); unset it")
    try:  # fail now, naming the model, rather than at the first row
        probe = prompt_ids(procs, "1 + 1 = ?", 1 if procs.vision else 0)
        bare = prompt_ids(procs, "1 + 1 = ?", 1 if procs.vision else 0, generation_prompt=False)
    except Exception as e:  # noqa: BLE001 - Jinja raises many types
        raise ModelError(f"model.path={path}: its chat template fails to render a prompt "
                         f"({one_line(e, 240, typed=False)}); check data.system_prompt / data.enable_thinking") from None
    if tools and probe == prompt_ids(replace(procs, chat=replace(procs.chat, tools=())), "1 + 1 = ?",
                                     1 if procs.vision else 0):
        raise ModelError(f"model.path={path}: its chat template ({template_source(path, tokenizer)}) "
                         "ignores `tools`: the model would never see rollout.tools; use a template "
                         "that renders them (Qwen's do)")
    if probe == bare:
        raise ModelError(f"model.path={path}: its chat template ({template_source(path, tokenizer)}) "
                         "ignores add_generation_prompt: every prompt would lack the assistant "
                         "header; use a template that opens the assistant turn")
    return procs


def template_source(path: str, tokenizer) -> str:
    """Which file of the folder the template comes from (for messages)."""
    return next((f for f in ("chat_template.jinja", "chat_template.json")
                 if (Path(path) / f).is_file()), "tokenizer_config.json")


def processors(path: str, mc: ModelConfig, dc: DataConfig, rc: RolloutConfig | None = None) -> Processors:
    """:func:`load_processors` with the run's pixel bounds (`[model]` mc) and prompt settings
    (`[data]` dc; `[rollout]` rc: the schemas of its tools); whether the dataset fits the model
    is data.refuse_images."""
    import envs  # its tools' modules are imported only for a run that names some
    return load_processors(path, mc.min_pixels, mc.max_pixels, dc.system_prompt,
                           dc.enable_thinking, envs.schemas(rc.tools) if rc is not None else ())


def _stops(path: str, tokenizer) -> list[int]:
    """The ids that end a response: the generation config's eos ids, else the tokenizer's eos."""
    from transformers import GenerationConfig
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except (OSError, ValueError):
        eos = None
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return eos or [tokenizer.eos_token_id]


@dataclass(frozen=True)
class Tokens:
    """Token ids both engines and the trainer agree on (image ids: -1 on a text-only model)."""
    image_pad: int
    vision_start: int
    vision_end: int
    eos: int                        # the primary stop id (also the pad fallback)
    pad: int
    vocab_size: int                 # the model's output width (may exceed the tokenizer's)
    suppressed: tuple[int, ...]     # never sampled: special tokens other than the stops, unused rows
    stops: tuple[int, ...] = ()     # every id that ends a response (eos first)

    @staticmethod
    def of(tokenizer, config, stops: list[int] | None = None) -> "Tokens":
        stops = list(dict.fromkeys(stops or [tokenizer.eos_token_id]))
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id in stops else stops[0]
        stops = [eos] + [s for s in stops if s != eos]
        vocab = text_config(config).vocab_size
        special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        # A random model samples vision placeholders and chat markers; the trainer's re-encoding
        # would then see image tokens without images. Suppress them on both sides (TRL does).
        suppressed = sorted((special - set(stops)) | set(range(len(tokenizer), vocab)))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        ids = [getattr(config, k, None) for k in ("image_token_id", "vision_start_token_id",
                                                  "vision_end_token_id")]
        ids = [-1 if i is None else int(i) for i in ids]
        return Tokens(*ids, eos, pad, vocab, tuple(suppressed), tuple(stops))


# ----------------------------------------------------------------------------- prompts
def chat_messages(user_text: str, n_images: int, system_prompt: str = "",
                  vision: bool = True) -> list[dict]:
    """The chat messages of one prompt: an optional system turn, then the user turn with
    `n_images` image items where `user_text` has `<image>` markers (in order), else first; a
    ValueError when markers and images differ in number."""
    parts = user_text.split(IMAGE_MARKER)
    markers = len(parts) - 1
    if markers and markers != n_images:
        raise ValueError(f"{n_images} image(s) for {markers} {IMAGE_MARKER} placeholder(s)")
    if not vision:
        if n_images:
            raise ValueError(f"{n_images} image(s) for a text-only model")
        content: Any = user_text
    elif markers:
        content = [item for i, text in enumerate(parts)
                   for item in ([{"type": "image"}] if i else []) + ([{"type": "text", "text": text}]
                                                                     if text else [])]
    else:
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": user_text}]
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return system + [{"role": "user", "content": content}]


def prompt_ids(procs: Processors, user_text: str, n_images: int,
               generation_prompt: bool = True) -> list[int]:
    """The prompt's token ids, rendered by the model's chat template (with the generation
    prompt, unless `generation_prompt` is off), with ONE unexpanded image placeholder per image."""
    chat = procs.chat
    kw = template_kwargs(chat)
    text = procs.tokenizer.apply_chat_template(
        chat_messages(user_text, n_images, chat.system_prompt, procs.vision),
        chat_template=chat.template, tokenize=False, add_generation_prompt=generation_prompt, **kw)
    ids = procs.tokenizer.encode(text, add_special_tokens=False)
    if procs.vision and ids.count(procs.tokens.image_pad) != n_images:
        raise ValueError(f"the chat template rendered {ids.count(procs.tokens.image_pad)} image "
                         f"placeholder(s) for {n_images} image(s)")
    return ids


def template_kwargs(chat: Chat) -> dict:
    """What apply_chat_template gets beside the messages: enable_thinking (a template that reads
    it), the tools (`rollout.tools`)."""
    return (({"enable_thinking": chat.enable_thinking}
             if chat.enable_thinking is not None and chat.takes_thinking else {})
            | ({"tools": list(chat.tools)} if chat.tools else {}))


def image_inputs(image_processor, images: list, cache: dict | None = None) -> dict[str, torch.Tensor]:
    """pixel_values [sum patches, C*T*P*P] and image_grid_thw [n_images, 3] for PIL images ({}
    for none). `cache` (by `id(image)`, holding the images alive): each image processed once."""
    if not images:
        return {}
    if cache is None:
        out = image_processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    for im in images:
        if id(im) not in cache:
            one = image_processor(images=[im], return_tensors="pt")
            cache[id(im)] = (im, one["pixel_values"], one["image_grid_thw"])
    return {"pixel_values": torch.cat([cache[id(im)][1] for im in images]),
            "image_grid_thw": torch.cat([cache[id(im)][2] for im in images])}


def n_image_tokens(grid_thw: torch.Tensor | None, merge_size: int = 2) -> list[int]:
    """Image tokens each image of `grid_thw` becomes once its patches are merged."""
    return [] if grid_thw is None else [int(g.prod()) // merge_size ** 2 for g in grid_thw]


def image_tokens(procs: Processors, images: list) -> int:
    """Tokens `images` take in a prompt once expanded (0 for none), without running the
    processor on their pixels."""
    ip = procs.image_processor
    return sum(ip.get_number_of_image_patches(im.height, im.width, {}) // ip.merge_size ** 2
               for im in images)


def sequence_tokens(procs: Processors, episodes: list, images: list) -> int:
    """Tokens of one sequence: `episodes` (one prompt, whose images are `images`) after one copy
    of their prompt, images expanded."""
    return (len(episodes[0].prompt_ids) - len(images) + image_tokens(procs, images)
            + sum(len(e.response_ids) + image_tokens(procs, getattr(e, "images", None) or [])
                  - len(getattr(e, "images", None) or []) for e in episodes))


def prompt_len(procs: Processors, user_text: str, images: list) -> int:
    """Tokens of the chat prompt once its image placeholders are expanded."""
    return len(prompt_ids(procs, user_text, len(images))) - len(images) + image_tokens(procs, images)


def expand_images(ids: list[int], counts: list[int], image_pad: int) -> list[int]:
    """Repeat the i-th image placeholder counts[i] times (transformers' expanded form)."""
    if ids.count(image_pad) != len(counts):
        raise ValueError(f"{ids.count(image_pad)} image placeholders for {len(counts)} images")
    return [ids[j] for j in _expanded_index(ids, counts, image_pad)]


def _vision_inputs(procs: Processors, images: list, pixels: dict | None) -> tuple[tuple, list[int]]:
    """((pixel_values, image_grid_thw), each image's token count) of `images` ((None, None) and []
    for none)."""
    if not images:
        return (None, None), []
    mm = image_inputs(procs.image_processor, images, pixels)
    return ((mm["pixel_values"], mm["image_grid_thw"]),
            n_image_tokens(mm["image_grid_thw"], procs.image_processor.merge_size))


def episode_images(images, e) -> list:
    """Episode `e`'s images in the order its tokens show them: its problem's (`images[e.index]`),
    then those its inserted turns showed (multi-turn)."""
    return list(images[e.index]) + list(getattr(e, "images", None) or [])


def loss_mask(e) -> list[int]:
    """1 on each response token the engine sampled, 0 on inserted ones (multi-turn: user and tool
    turns); a single-turn episode's are all 1."""
    return list(getattr(e, "loss_mask", None) or [1] * len(e.response_ids))


def sampled_tokens(e) -> int:
    """The response tokens the engine sampled (the length metrics count these), of an Episode
    or an episode.Completion (its `ids`)."""
    if getattr(e, "loss_mask", None):
        return sum(e.loss_mask)
    return len(e.response_ids if hasattr(e, "response_ids") else e.ids)


def token_versions(e) -> list[int]:
    """The weight version of each of an episode's response tokens: its `versions` (partial
    rollouts), else its `version` for all (-1 for an episode record that carries neither)."""
    return list(getattr(e, "versions", None) or [getattr(e, "version", -1)] * len(e.response_ids))


def compared_versions(e) -> list[int]:
    """What a micro-batch's `token_versions` holds, for logprob_diff (update.py: a token counts
    where it equals the trainers' version): each token's version, or with the KV kept across a
    weight load (`rollout.partial = "keep"`, Episode.kv_kept) the episode's oldest on every
    token, since a later token's logprob also depends on the older weights' KV before it."""
    if getattr(e, "kv_kept", False):
        return [min(token_versions(e), default=-1)] * len(e.response_ids)
    return token_versions(e)


def collate(episodes, images: list[list], procs: Processors, device: torch.device,
            layout: RowLayout = RowLayout(), pixels: dict | None = None,
            vision: bool = False) -> MicroBatch:
    """Trainer batch of `episodes` (`images[i]`: episode i's images, in prompt order, maybe none),
    for model.sequence_logprobs, laid out as `layout` says (model.MicroBatch: what every layout
    has, `packed` what packed rows add):
    - one row per episode (the default): prompt + response, right-padded; T = W.
    - one row per prompt (`layout.share_prompt`, :func:`pack`): consecutive episodes with the same
      prompt share one copy of it, followed by each response; an attention mask lets every
      response see the prompt and itself only, so the result equals one row per episode while the
      prompt (and its images) is encoded once per group instead of G times. T = longest response.
      Only for models whose layers all take the mask (model.packs_exactly).
    - packed rows (`layout.packed`, :func:`pack`; device.Device.packed_attention): every sequence
      of the micro-batch in one row, each attending only within itself, positions restarted;
      "segments": the units (a prompt run, or one episode each without `share_prompt`), laid out
      for attention.py's kernel (its plan built here: no mask); "varlen": every episode (its
      prompt copied: a varlen kernel cannot share one), no mask.
    `pixels`: a cache of processed images by `id(image)` (the trainer keeps one per run).
    `vision`: another trainer rank's micro-batch may show an image (the step's episodes do): one
    without an image of its own carries a blank one (`blank_image`) for the vision tower to run
    on, its output counting zero (model.sequence_logprobs), so that every rank makes the tower's
    FSDP collectives.
    """
    with torch.profiler.record_function(HOST_SCOPE):  # built on the host: no device sync
        batch = (pack(episodes, images, procs, device, layout, pixels) if layout.share_prompt or layout.packed
                 else _padded(episodes, images, procs, pixels))
        if vision and procs.vision and batch.pixel_values is None:
            batch = replace(batch, blank_image=_vision_inputs(procs, [_blank()], pixels)[0])
    return batch.to(device)


@functools.cache
def _blank():
    """A black image, processed at the smallest size the processor makes (model.min_pixels); one
    object, so `pixels` processes it once."""
    from PIL import Image
    return Image.new("RGB", (28, 28))


def _padded(episodes, images: list[list], procs: Processors, pixels: dict | None) -> MicroBatch:
    """One row per episode, right-padded (:func:`collate`)."""
    tokens = procs.tokens
    mm, counts = _vision_inputs(procs, [im for ims in images for im in ims], pixels)
    it = iter(counts)
    prompts, where = [], []  # expanded prompts; each response token's source index (turn images)
    for e, ims in zip(episodes, images):
        cs, k = [next(it) for _ in ims], e.prompt_ids.count(tokens.image_pad)
        prompts.append(expand_images(e.prompt_ids, cs[:k], tokens.image_pad))
        where.append(_expanded_index(e.response_ids, cs[k:], tokens.image_pad))
    width = max(len(p) + len(w) for p, w in zip(prompts, where))
    B = len(episodes)
    ids = torch.full((B, width), tokens.pad, dtype=torch.long)
    attn = torch.zeros(B, width, dtype=torch.long)
    resp = torch.zeros(B, width, dtype=torch.long)
    slots = torch.zeros(B, width, dtype=torch.long)                 # every response token
    engine_lp = torch.zeros(B, width, dtype=torch.float32)
    versions = torch.full((B, width), -1, dtype=torch.long)
    for i, (p, e, w) in enumerate(zip(prompts, episodes, where)):
        n, r, w = len(p), len(w), torch.tensor(w, dtype=torch.long)
        ids[i, :n + r] = torch.tensor(p + [e.response_ids[j] for j in w])
        attn[i, :n + r] = 1
        slots[i, n:n + r] = 1
        resp[i, n:n + r] = torch.tensor(loss_mask(e))[w]
        engine_lp[i, n:n + r] = torch.tensor(e.logprobs, dtype=torch.float32)[w]
        versions[i, n:n + r] = torch.tensor(compared_versions(e))[w]
    pred = slots[:, 1:].nonzero(as_tuple=True)                   # row-major; column t - 1 predicts t
    routed = _routing(ids.shape, [(getattr(e, "routing", None), w) for e, w in zip(episodes, where)],
                      pred, [(e, i, 0, len(p)) for i, (e, p) in enumerate(zip(episodes, prompts))])
    return MicroBatch(ids, attn, resp, engine_lp, versions, torch.tensor(B * width * width),
                      attn.sum(), (attn.sum(-1) ** 2).sum(), *mm, *routed)


def _expanded_index(ids: list[int], counts: list[int], image_pad: int) -> list[int]:
    """For each token of `ids` once its image placeholders are expanded (`counts`: a multi-turn
    response's turn images), the index of the token it comes from."""
    it = iter(counts)
    return [j for j, t in enumerate(ids) for _ in range(next(it) if t == image_pad and counts else 1)]


def _routing(shape, parts: list, pred: tuple, prompts: list) -> tuple:
    """MoE episodes carrying the engine's routing (`parts`: each episode's routing or None, and
    its expanded index, predicted at `pred` (rows, cols); `prompts`: each prompt copy's episode
    (its prompt_routing), row, first column, length): (`routing` [rows, W, L, k],
    `routing_counted` [rows, W]) (routing.batch_routing), or (None, None)."""
    prompts = [(getattr(e, "prompt_routing", None), r, c, n) for e, r, c, n in prompts]
    return routing.batch_routing(tuple(shape), *pred, parts, prompts) or (None, None)


def units(episodes, images: list[list], share_prompt: bool) -> list[list[int]]:
    """The sequences of a packed batch: runs of consecutive episodes with the same prompt (and
    images) with `share_prompt`, else one episode each."""
    out: list[list[int]] = []
    for i, e in enumerate(episodes):
        if (share_prompt and out and episodes[out[-1][0]].prompt_ids == e.prompt_ids
                and list(map(id, images[out[-1][0]])) == list(map(id, images[i]))):  # the same objects
            out[-1].append(i)
        else:
            out.append([i])
    return out


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: indices into rows of at most `capacity` tokens (a longer one alone)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = next((k for k, r in enumerate(room) if r >= lengths[i]), None)
        if k is None:
            rows.append([i])
            room.append(capacity - lengths[i])
        else:
            rows[k].append(i)
            room[k] -= lengths[i]
    return rows


def pack(episodes, images: list[list], procs: Processors, device: torch.device,
         layout: RowLayout = RowLayout(share_prompt=True), pixels: dict | None = None) -> MicroBatch:
    """Packed rows (see :func:`collate`): each row holds whole sequences ([prompt | response 1 |
    response 2 | ...], :func:`units`), one per row unless `layout.packed` (then all in one row),
    then padding. model.Packed says where everything sits; without `packed` its `mask_4d` [rows,
    1, W, W] (bool: a prompt token sees its prompt causally; a response token its prompt and itself
    causally; padding sees itself), with "segments" the kernel's `plan` (attention.plan over
    :func:`_segments`' layout, on `device`; the rest on the host)."""
    packing = layout.packed
    if any(getattr(e, "images", None) for e in episodes):
        raise ValueError("an episode whose inserted turns show images needs one row per episode "
                         "(train.share_prompt = false, train.packing = false)")
    seqs = units(episodes, images, layout.share_prompt and packing != "varlen")
    rows, built, mm = _place(episodes, images, procs, seqs, packing, pixels)
    W = max(sum(len(built[k][1]) for k in row) for row in rows)
    ids = torch.full((len(rows), W), procs.tokens.pad, dtype=torch.long)     # [R, W]
    attn = torch.zeros(len(rows), W, dtype=torch.long)
    seq_row, seq_col = [0] * len(seqs), [0] * len(seqs)
    for r, row in enumerate(rows):
        col = 0
        for k in row:
            toks = built[k][1]
            seq_row[k], seq_col[k] = r, col
            ids[r, col:col + len(toks)] = torch.tensor(toks)
            attn[r, col:col + len(toks)] = 1
            col += len(toks)
    resp, engine_lp, versions, p = _response_index(episodes, seqs, built, seq_row, seq_col)
    lengths = [built[k][0] + len(episodes[i].response_ids) for k, u in enumerate(seqs) for i in u]
    pairs = torch.tensor(len(rows) * W * W)  # a dense kernel: every pair of every row
    if packing == "segments":  # the calls the kernel will make on `device` (model._packed_logprobs)
        p = replace(p, plan=attention.plan(attention.layout(_segments(p)), W, device))
        pairs = torch.tensor(attention.pairs(p.plan))
    elif packing is None:
        p = replace(p, mask_4d=_block_mask(p, len(rows), W))
    p = replace(p, **_bounds([len(built[k][1]) for k in range(len(seqs))], seq_row, seq_col, W,
                             packing == "varlen"))
    routed = _routing(ids.shape, [(getattr(episodes[i], "routing", None),
                                   range(len(episodes[i].response_ids))) for u in seqs for i in u],
                      (p.pred_row, p.pred_col),
                      [(episodes[u[0]], seq_row[k], seq_col[k], built[k][0])  # a shared prompt: the first's
                       for k, u in enumerate(seqs)])
    return MicroBatch(ids, attn, resp, engine_lp, versions, pairs, torch.tensor(sum(lengths)),
                      torch.tensor(sum(n * n for n in lengths)), *mm, *routed, packed=p)


def _place(episodes, images, procs: Processors, seqs: list[list[int]], packing: str | None,
           pixels: dict | None) -> tuple[list[list[int]], dict, tuple]:
    """Which sequences share a row (all of them with `packing`, else one each), every
    sequence's (prompt length, tokens), and the image inputs in row-major order (the order the
    model meets the image tokens in)."""
    rows = [list(range(len(seqs)))] if packing else [[k] for k in range(len(seqs))]
    order = [k for row in rows for k in row]
    mm, counts = _vision_inputs(procs, [im for k in order for im in images[seqs[k][0]]], pixels)
    it = iter(counts)
    built = {}
    for k in order:
        u = seqs[k]
        row = expand_images(episodes[u[0]].prompt_ids, [next(it) for _ in images[u[0]]],
                            procs.tokens.image_pad)
        built[k] = (len(row), row + [t for i in u for t in episodes[i].response_ids])
    return rows, built, mm


def _response_index(episodes, seqs, built, seq_row, seq_col) -> tuple:
    """The episode-major response mask, engine logprobs and versions [B, T], and model.Packed:
    per response token (episode-major) its sequence, predicting column, own column, offset."""
    B, T = len(episodes), max(len(e.response_ids) for e in episodes)
    resp = torch.zeros(B, T, dtype=torch.long)
    slots = torch.zeros(B, T, dtype=torch.long)                 # every response token, inserted too
    engine_lp = torch.zeros(B, T, dtype=torch.float32)
    versions = torch.full((B, T), -1, dtype=torch.long)
    pred_seq, pred_col, target_col, offset = [], [], [], []
    for k, u in enumerate(seqs):
        s = seq_col[k] + built[k][0]                                # the first response's column
        for i in u:
            n = len(episodes[i].response_ids)
            resp[i, :n] = torch.tensor(loss_mask(episodes[i]))
            slots[i, :n] = 1
            engine_lp[i, :n] = torch.tensor(episodes[i].logprobs, dtype=torch.float32)
            versions[i, :n] = torch.tensor(compared_versions(episodes[i]))
            pred_seq += [k] * n
            pred_col += [seq_col[k] + built[k][0] - 1] + list(range(s, s + n - 1))  # the first
            target_col += list(range(s, s + n))            # is predicted by the prompt's last
            offset += list(range(n))
            s += n
    seq_row_t, pred_seq_t = torch.tensor(seq_row), torch.tensor(pred_seq)
    return resp, engine_lp, versions, Packed(
        slots, seq_row_t, torch.tensor(seq_col), torch.tensor([built[k][0] for k in range(len(seqs))]),
        pred_seq_t, seq_row_t[pred_seq_t], torch.tensor(pred_col), torch.tensor(target_col),
        torch.tensor(offset))


def _bounds(lengths: list[int], seq_row: list[int], seq_col: list[int], W: int,
            varlen: bool) -> dict:
    """model.Packed's sequence boundaries: `seq_index` [S, longest], each sequence's columns in
    the rows flattened (row * W + column), -1 past its end; with `varlen` (one row, sequences
    side by side from column 0) flash-attention's kwargs: cu_seq_lens_q/k [S + 1] int32 and
    max_length_q/k (ints: no host sync where flash-attention wants them)."""
    L = max(lengths)
    start = torch.tensor([r * W + c for r, c in zip(seq_row, seq_col)])
    steps = torch.arange(L)
    index = torch.where(steps[None] < torch.tensor(lengths)[:, None], start[:, None] + steps[None], -1)
    if not varlen:
        return dict(seq_index=index)
    order = sorted(range(len(lengths)), key=lambda k: (seq_row[k], seq_col[k]))
    cu = torch.tensor([0] + [seq_col[k] + lengths[k] for k in order], dtype=torch.int32)
    return dict(seq_index=index, fa_kwargs=dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                                max_length_q=L, max_length_k=L))


def _segments(p: Packed) -> torch.Tensor:
    """[responses, 5]: each response's row, its prompt's column and length, its own column and
    length, in row-major order (attention.layout's input)."""
    first = (p.offset == 0).nonzero().flatten()                     # each response's first token
    lengths = torch.diff(torch.cat([first, torch.tensor([len(p.offset)])]))
    k = p.pred_seq[first]
    rows = torch.stack([p.seq_row[k], p.seq_col[k], p.prompt_len[k], p.target_col[first], lengths], 1)
    return rows[torch.argsort(rows[:, 0] * (rows[:, 3].max() + 1) + rows[:, 3])]


def _block_mask(p: Packed, R: int, W: int) -> torch.Tensor:
    """[rows, 1, W, W] bool: each prompt causally to itself, each response to its prompt and
    itself causally, nothing across sequences; padding sees itself (no empty row)."""
    mask = torch.zeros(R, 1, W, W, dtype=torch.bool)
    mask[:, 0, range(W), range(W)] = True
    causal = torch.ones(W, W, dtype=torch.bool).tril()
    for k, (r, c, plen) in enumerate(zip(p.seq_row.tolist(), p.seq_col.tolist(), p.prompt_len.tolist())):
        end = c + plen + int((p.pred_seq == k).sum())               # the sequence's last column + 1
        mask[r, 0, c:end, c:c + plen] = causal[:end - c, :plen]
    cols, rows = p.target_col, p.pred_row
    bounds = (p.offset == 0).nonzero().flatten().tolist() + [len(cols)]  # responses' first tokens
    for a, z in zip(bounds, bounds[1:]):
        r, s, n = int(rows[a]), int(cols[a]), z - a
        mask[r, 0, s:s + n, s:s + n] = causal[:n, :n]
    return mask
