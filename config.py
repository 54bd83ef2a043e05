"""The configuration: one dataclass tree, defaults < TOML file < `--section.key=value`; every
field is documented where it is defined. A bad key or value is a one-line `ConfigError`;
`validate()` checks the cross-field rules before any process group exists.
"""
from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cli import USAGE, split_argv  # noqa: F401 - train.py's command line, read with the config
from errors import ConfigError

# train.packing's row layouts by name (inputs.pack builds them, model.attention_for runs them)
PACKED_LAYOUTS = ("segments", "varlen")
LR_SCHEDULES = ("constant", "linear", "cosine")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")  # loss.aggregate
KL_ESTIMATORS = ("k1", "k2", "k3")   # loss.kl_penalty
ADVANTAGES = ("grpo", "rloo")        # loss.group_advantages
ADVANTAGE_NORMS = ("group", "batch")  # loss.advantage_norm
DEFAULT_TEMPLATE = (
    "{problem}\n\nFirst output the thinking process in <think> </think> tags and then output "
    "the final answer in <answer> </answer> tags."
)
PREFIX_CACHING = ("auto", "on", "off")
STALE = ("wait", "drop")
TRACKERS = ("tensorboard", "wandb", "swanlab")  # run.report_to; tracking.py implements each


def num(default: int | float, rule: str) -> Any:
    """A numeric field with its allowed range, checked at load (:func:`check_ranges`): "> 0",
    ">= 1", "(0, 1]", "[0, 1)", ... Every int and float field has one (a test checks)."""
    return field(default=default, metadata={"range": rule})


def in_range(x: float, rule: str) -> bool:
    """`x` satisfies `rule` (see :func:`num`); nan and inf never do."""
    if not math.isfinite(x):
        return False
    if rule[0] in "<>":
        op, bound = rule.split()
        b = float(bound)
        return {">": x > b, ">=": x >= b, "<": x < b, "<=": x <= b}[op]
    lo, hi = (float(v) for v in rule[1:-1].split(","))
    return ((x >= lo) if rule[0] == "[" else (x > lo)) and ((x <= hi) if rule[-1] == "]" else (x < hi))


def one_of(default: Any, choices: tuple) -> Any:
    """A field whose value is one of `choices`, checked at load (:func:`check_ranges`)."""
    return field(default=default, metadata={"choices": choices})


def check_ranges(cfg: "Config") -> None:
    """Every numeric key against its declared range and every key with choices (:func:`one_of`)
    against them: one line naming the key and what it may be."""
    for sec in dataclasses.fields(cfg):
        sub = getattr(cfg, sec.name)
        for f in dataclasses.fields(sub):
            rule, choices = f.metadata.get("range"), f.metadata.get("choices")
            value = getattr(sub, f.name)
            if rule is not None and value is not None and not in_range(value, rule):  # None: unset
                raise ConfigError(f"{sec.name}.{f.name} must be {_describe(rule)}, got {value!r}")
            if choices is not None and (isinstance(value, list) or value not in choices
                                        or type(value) is int):  # 1 == True: never a choice
                raise ConfigError(f"{sec.name}.{f.name}: unknown {value!r} (known: "
                                  f"{', '.join(c if isinstance(c, str) else _toml_value(c) for c in choices)})")


def check_value(key: str, value: Any, default: Any, rule: str | None = None) -> Any:
    """A key declared outside this tree (an objective's or filter's, registry.Key): `value` of
    the type of `default` and within `rule`, or a one-line ConfigError naming `key`."""
    value = _check_type(key, value, type(default))
    if rule is not None and not in_range(value, rule):
        raise ConfigError(f"{key} must be {_describe(rule)}, got {value!r}")
    return value


def _describe(rule: str) -> str:
    return rule if rule[0] in "<>" else f"in {rule}"


@dataclass
class RunConfig:
    out_dir: str = "runs/tiny"               # run folder: config.toml, metrics.jsonl, samples.jsonl, checkpoints
    seed: int = num(0, ">= 0")               # seeds data order, sampling and the tiny model
    steps: int = num(20, ">= 0")             # rollout steps (= weight versions) to run; each makes
                                             # train.mini_batches x ppo_epochs optimizer steps
    log_samples: int = num(2, ">= -1")       # decoded responses per step appended to samples.jsonl (-1: every episode)
    save_every: int = num(0, ">= 0")         # checkpoint every N rollout steps (0: only at the end if keep_last > 0)
    # > 0: a checkpoint's HF export (hf/) at a multiple of this many steps is kept as
    # exports/step_N when keep_last rotates its training state away (e.g. one per epoch); 0: none
    export_every: int = num(0, ">= 0")
    keep_last: int = num(2, ">= 0")          # complete checkpoints kept; 0 disables checkpointing
    eval_every: int = num(0, ">= 0")         # evaluation every N rollout steps and at the end (0: off); see [eval]
    eval_size: int = num(16, ">= 1")         # evaluation problems (the first of [eval] split)
    report_to: list = field(default_factory=list)  # trackers: any of "tensorboard", "wandb", "swanlab"
    allow_config_change: bool = False        # resume although keys that change what the run means differ
    allow_new_base: bool = False             # resume although model.path's weights differ from the checkpoint's base
    verbose: bool = False                    # also vLLM's INFO lines and W&B's end-of-run summary


@dataclass
class ClusterConfig:
    gen_ranks: int = num(1, ">= 1")          # ranks that generate (one engine each); the others train
    # where they sit (world.split_roles): "by_node" = the LAST gen_ranks ranks of the world (vl3b); "per_node"
    # = each node's last gen_ranks / nodes ranks (ROLL's trainers on NPUs 0-3, engines on 4-7; even spread)
    layout: str = one_of("by_node", ("by_node", "per_node"))
    colocate: bool = False  # every rank trains and owns an engine on its device, time-shared (docs/colocate.md)
    timeout_s: float = num(300.0, "> 0")     # every collective and the engine: a dead peer ends the job after this
    nnodes: int = num(1, ">= 1")             # for --dry-run only: the nodes the rank plan is drawn for
    nproc_per_node: int = num(3, ">= 1")     # for --dry-run only: processes per node
    devices_per_node: int = num(8, ">= 1")   # for --dry-run only: GPUs/NPUs per node (a run counts the node's own)
    device_memory_gib: float = num(0.0, ">= 0")  # the memory plan's device memory (docs/memory.md; 0: not judged)


@dataclass
class ModelConfig:
    # HF folder or hub id of any family in families.py (config.json's model_type); "tiny" builds a
    # random tiny model of families.DEFAULT_TINY in the run folder, "tiny-<model_type>" one of that family
    path: str = "tiny"
    dtype: str = one_of("float32", ("float32", "bfloat16"))  # the engines' weights and the sync transport: float32 | bfloat16
    min_pixels: int = num(56 * 56, ">= 1")   # image pixel bounds, shared by the trainer's processor and every engine
    max_pixels: int = num(112 * 112, ">= 1")
    mixed_precision: bool = False            # trainer: FSDP2 bf16 compute with fp32 master weights
    # trainer: recompute the decoder layers' activations in backward: "full" (= true: every op of
    # every layer), "selective" (all but the matmuls' and attention's outputs, which stay saved),
    # "off" (= false); "auto": the first of off, selective, full whose train phase fits the memory
    # plan's cluster.device_memory_gib ("full" when that or the model's shape is not known; decided
    # once at start, said on the console: memplan.checkpointing, docs/memory.md); the vision tower
    # is never recomputed (sharding.checkpointing_options)
    activation_checkpointing: bool | str = one_of(False, (False, True, "full", "selective", "off", "auto"))
    # trainer: torch.compile each decoder layer (fewer launches per layer; the first step compiles);
    # with checkpointing, each layer's checkpoint inside its compiled region (sharding.apply_fsdp)
    compile: bool = False
    # LoRA (the peft library): 0 = off, every parameter trains. > 0: the base model is frozen and
    # low-rank adapters of this rank train (optimizer state for them only); the reference for
    # loss.kl_coef is the same model with its adapters disabled (no second copy); the engines get
    # the merged weights (W + lora_alpha / lora_rank * B A); checkpoints hold the adapters, the
    # HF export the merged model, with the adapters beside it in PEFT's format (README: LoRA).
    lora_rank: int = num(0, ">= 0")
    lora_alpha: float = num(16.0, "> 0")     # the adapters' scale is lora_alpha / lora_rank
    # which linear layers get adapters: "all-linear" (every linear layer of the language model,
    # its output head excluded, as peft's "all-linear"), or a list of names, each matching every
    # linear layer whose name is it or ends with "." + it (e.g. ["q_proj", "v_proj"])
    lora_target_modules: list | str = "all-linear"
    lora_vision: bool = False                # also adapt the vision tower's linear layers (else it stays frozen)
    # adapter dropout: only 0 (dropout makes the trainer's train-mode logprobs differ from the
    # engines', which the GRPO ratio and logprob_diff/max compare); the key exists to say so
    lora_dropout: float = num(0.0, "[0, 1)")
    # MoE families: the trainer routes each response token's predictor to the experts the engine
    # chose (routing.py, docs/families.md); train/routing_agreement is logged either way
    moe_routing_replay: bool = False
    # ... and the KL reference's forward too (false: the reference routes its own way, as slime and
    # verl; true: the engine's experts, this project's behaviour before 2026-12-05; docs/families.md)
    moe_routing_replay_ref: bool = False
    # On-policy distillation's teacher (loss.distill_coef; docs/loss.md): a folder or hub id with the
    # policy's tokenizer; model.path's value: the initial weights; "base" (LoRA): the frozen base
    teacher_path: str = ""


@dataclass
class DataConfig:
    source: str = "synthetic"                # "synthetic" (diagrams), "synthetic-text", a local folder, or a hub id
    n_synthetic: int = num(256, ">= 1")      # problems per synthetic split
    image_size: int = num(112, ">= 28")      # synthetic diagrams are image_size x image_size
    template: str = DEFAULT_TEMPLATE         # user-turn text; must contain {problem} (and may hold <image> markers, and {options}: docs/data.md)
    # The prompt is rendered by the model's own chat template (tokenizer / processor): an empty
    # system_prompt keeps the template's own behaviour (some families' templates add a default
    # system turn, others none); enable_thinking is passed to templates that read it, unset =
    # the template's default.
    system_prompt: str = ""
    enable_thinking: bool | None = None
    max_prompt_len: int = num(1024, ">= 1")  # prompts longer than this (image tokens counted) are skipped
    problem_column: str = "problem"          # the dataset's own column names (local JSONL/parquet and hub ids)
    answer_column: str = "answer"
    # one image per row or a list (several, in order; "<image>" in the problem marks where each
    # goes, else they come first); "" = a text-only set (required for a text-only model)
    images_column: str = "images"
    # > 0: every image centre-cropped or padded (black) to a square of this side, then JPEG
    # re-encoded, as AReaL's convert_image (torchvision's CenterCrop: data.crop_image); 0: off
    image_crop: int = num(0, ">= 0")
    # strings deleted from every problem, in order (str.replace(s, ""): AReaL deletes "different")
    delete_text: list = field(default_factory=list)
    # Several datasets mixed: [[data.sources]] tables (their keys: data.SOURCE_KEYS, docs/data.md);
    # given, they take data.source's place, and a data.source given later theirs
    sources: list = field(default_factory=list)


@dataclass
class RolloutConfig:
    engine: str = "hf"                       # "hf" (transformers, any device) or "vllm"
    prompts_per_step: int = num(4, ">= 1")   # prompts per step, split evenly over the generation ranks
    group_size: int = num(4, ">= 2")         # G: samples per prompt
    temperature: float = num(1.0, "> 0")
    top_p: float = num(1.0, "(0, 1]")        # 1.0 = off; see model.py for why off is the on-policy choice
    top_k: int = num(0, ">= 0")              # 0 = off
    max_new_tokens: int = num(16, ">= 1")
    # k >= 1: the engines generate up to k weight versions ahead of the trainers, into a queue
    # (pipeline.py, docs/async.md); 0: synchronous. Needs a loss.correction (or loss.tis_cap).
    max_staleness: int = num(0, ">= 0")
    # k >= 1: "wait" (no batch starts that could not be delivered within k versions) or "drop"
    stale: str = one_of("wait", STALE)  # (it never waits; groups older than k are dropped and counted)
    # k >= 1, new weights between decode steps (docs/async.md): "recompute" (true) prefills again, "keep" not
    partial: bool | str = one_of(False, (False, True, "recompute", "keep"))
    # with partial: batches generated at once, the next one starting while earlier ones decode
    # (an engine that shares its decode steps among them: vllm; docs/async.md); <= max_staleness + 1
    batches_in_flight: int = num(1, ">= 1")
    gpu_memory_utilization: float = num(0.85, "(0, 1]")  # vllm: fraction of device memory for the engine
    max_model_len: int = num(4096, ">= 1")   # vllm: prompt + response tokens
    enforce_eager: bool = True               # vllm: no graph capture (start here on NPU)
    tensor_parallel_size: int = num(1, ">= 1")  # vllm: devices per engine (README, GPU and NPU: Launch)
    # vllm: share a prompt's KV among its G samples; "auto": off for linear attention (docs/families.md)
    prefix_caching: str = one_of("auto", PREFIX_CACHING)  # auto | on | off
    # Every rank waits this long for the engines to start and run their warm-up request (vLLM: load,
    # profiling, compile; also its own VLLM_ENGINE_READY_TIMEOUT_S unless set), not cluster.timeout_s.
    start_timeout_s: float = num(900.0, "> 0")
    # DAPO dynamic sampling (loss.drop_zero_variance): at most this many extra rounds of prompts
    # per step for groups whose rewards differ (docs/loss.md); 0: no refill (they stay masked)
    max_refill_rounds: int = num(4, ">= 0")
    # Multi-turn (multiturn.py, docs/multiturn.md): an environment of envs/ that answers each
    # reply ("" = single-turn), tools the model may call (envs.tools: Qwen's <tool_call> JSON,
    # each run under tool_timeout_s, at most max_tool_calls of one reply's, the rest ignored),
    # the most model turns, and the most tokens after the prompt (sampled and inserted; 0 =
    # max_turns replies of max_new_tokens with an inserted turn of at most 1,024 tokens between
    # each two: multiturn.episode_budget). Inserted tokens never train.
    env: str = ""
    env_args: dict = field(default_factory=dict)  # [rollout.env_args]: the environment's own keys (envs/)
    tools: list = field(default_factory=list)
    tool_timeout_s: float = num(5.0, "> 0")
    max_tool_calls: int = num(4, ">= 1")
    max_turns: int = num(4, ">= 1")
    max_episode_tokens: int = num(0, ">= 0")


@dataclass
class TrainConfig:
    lr: float = num(2e-3, "> 0")
    weight_decay: float = num(0.0, ">= 0")
    beta1: float = num(0.9, "[0, 1)")
    beta2: float = num(0.999, "[0, 1)")
    warmup_steps: int = num(0, ">= 0")       # linear warm-up over this many rollout steps, then lr_schedule
    lr_schedule: str = one_of("constant", LR_SCHEDULES)  # constant | linear | cosine (decay to min_lr_ratio x lr by the last step)
    min_lr_ratio: float = num(0.0, "[0, 1]")  # linear / cosine: the final LR as a fraction of lr
    grad_clip: float = num(1.0, "> 0")       # max global gradient norm
    micro_batch_size: int = num(8, ">= 1")   # sequences per trainer forward/backward (when micro_batch_tokens = 0)
    # > 0: group sequences by length, at most this many padded tokens each; packed rows: at most
    # this many tokens a micro-batch (0: micro_batch_size x the longest sequence, the slots of a
    # padded micro-batch of micro_batch_size rows)
    micro_batch_tokens: int = num(0, ">= 0")
    share_prompt: bool = True                # one row per prompt: its G responses share one encoding of the prompt and image
    # Packed rows: a micro-batch's sequences (a prompt with its G responses under share_prompt,
    # else one episode each) side by side in one row, no padding, each attending only within
    # itself (positions restarted); the step's episodes go to the trainer ranks balanced by token
    # count. A model with linear-attention layers packs one sequence per episode, each run
    # from a zero state (model.bind_sequences); "auto": on where the device's layout was
    # measured faster than the padded micro-batches this config asks for
    # (device.Device.auto_packing), else off (said at start). true uses the device's layout (device.Device.packed_attention); "segments"
    # (attention.py's kernel: SDPA per piece, prompts shared) or "varlen" (flash_attention_2:
    # the flash-attn package on CUDA, torch_npu's fused op on NPU) names one.
    packing: bool | str = one_of("auto", (True, False, "auto", *PACKED_LAYOUTS))
    max_skipped_steps: int = num(3, ">= 1")  # consecutive non-finite steps before the run stops
    # Several updates per rollout batch (peers' names: docs/loss.md): the step's episodes split into
    # mini_batches (each its own loss denominator), ppo_epochs seeded shuffled passes over them,
    # mini_batches x ppo_epochs optimizer steps against logprobs computed once. 1 x 1 = one step.
    mini_batches: int = num(1, ">= 1")
    ppo_epochs: int = num(1, ">= 1")
    # A reference that moves (TRL's sync_ref_model; docs/loss.md): every ref_update_every rollout
    # steps ref <- ref_mix_alpha * policy + (1 - ref_mix_alpha) * ref. Needs loss.kl_coef > 0; 0: frozen.
    ref_update_every: int = num(0, ">= 0")
    ref_mix_alpha: float = num(0.6, "(0, 1]")  # TRL's ref_model_mixup_alpha (its default 0.6)
    # the policy's parameters and AdamW state: "float32" or "bfloat16" (as AReaL's FSDP engine;
    # updates under bf16's resolution round away); the rules with model.*: trainer.check
    master_dtype: str = "float32"


@dataclass
class LossConfig:
    # The objective's and the response filters' own keys (clip_low, clip_high, clip_dual, ...)
    # are declared beside their functions (loss.py, or a module of loss.plugins) and written in
    # [loss] like these; they are kept in `params`, read as attributes, and checked against their
    # owner once (registry.check, from train.py).
    aggregation: str = one_of("token-mean", AGGREGATIONS)  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
    scale_by_std: bool = True                # False: Dr. GRPO advantages r - mean (advantage = "grpo" only)
    advantage: str = one_of("grpo", ADVANTAGES)  # grpo | rloo (r_i - mean of the other G-1; never std-scaled)
    objective: str = "ppo"                   # ppo (token clip) | gspo (sequence ratio) | cispo (clipped IS weight) | a plugin's
    kl_coef: float = num(0.0, ">= 0")        # > 0 builds a frozen reference policy
    kl_estimator: str = one_of("k3", KL_ESTIMATORS)  # k1 | k2 | k3 (loss.KL_ESTIMATORS)
    kl_clamp: float = num(0.0, ">= 0")       # > 0: clamp the KL estimate to [-c, c], zero gradient outside (verl: 10); 0 off
    # KL in the reward (verl's use_kl_in_reward) instead of a loss term: r - kl_coef x summed KL
    kl_in_reward: bool = False
    # Adaptive coefficient (verl's / OpenRLHF's AdaptiveKLController), from kl_coef towards this
    # KL per token, over a horizon counted in responses; kl_target 0: fixed coefficient.
    kl_target: float = num(0.0, ">= 0")
    kl_horizon: int = num(10000, ">= 1")     # verl and OpenRLHF default 10000
    entropy_coef: float = num(0.0, ">= 0")   # entropy bonus: loss -= coef x aggregated entropy (verl entropy_coeff)
    tis_cap: float = num(0.0, ">= 0")        # > 0: correction "token_clamp" with this cap (the older key)
    # Correction between the trainers' proximal and the engines' (behaviour) logprobs
    # (loss.CORRECTIONS, docs/async.md): none | token_clamp | token_mask | sequence_mask |
    # geometric_mask | icepop; low/high unset: the mode's peer bounds (0 is a bound); the keys'
    # rules at load: correction.check
    correction: str = "none"
    correction_low: float | None = num(None, ">= 0")
    correction_high: float | None = num(None, "> 0")
    # "group": the advantage of the group step; "batch": then again over every response token of
    # the step (token-weighted mean and std), AReaL's adv_norm at batch level (loss.batch_normalize)
    advantage_norm: str = one_of("group", ADVANTAGE_NORMS)
    # On-policy distillation to model.teacher_path (slime's OPD): each sampled token's advantage is
    # A - distill_coef x (log pi_old - log pi_teacher); reward.functions = []: the teacher alone
    distill_coef: float = num(0.0, ">= 0")
    drop_zero_variance: bool = False         # DAPO dynamic sampling: drop groups whose rewards are all equal
    exclude_truncated: bool = False          # leave responses cut at max_new_tokens out of the loss
    filters: list = field(default_factory=list)  # response filters by name, in order (registry.response_filter)
    plugins: list = field(default_factory=list)  # modules (names or .py paths) with more objectives / filters
    params: dict = field(default_factory=dict)   # the parts' own keys, as [loss] keys (see above)

    def __getattr__(self, key: str) -> Any:  # only for names that are not fields: a part's key
        params = self.__dict__.get("params", {})
        if key in params:
            return params[key]
        raise AttributeError(f"[loss] has no key {key!r}")


@dataclass
class RewardConfig:
    # Reward functions summed with their weights: [{name, weight, **params}]; names in rewards/.
    functions: list = field(default_factory=lambda: [{"name": "geometry", "weight": 1.0}])
    # More functions added to `functions` once every file and override is read (so a preset
    # fragment, e.g. configs/presets/overlong.toml, adds its reward without replacing the base's)
    extra_functions: list = field(default_factory=list)
    timeout_s: float = num(5.0, "> 0")       # a reward call running longer (from its own start) scores 0, counts an error
    max_consecutive_timeouts: int = num(3, ">= 0")  # a function timing out this often in a row is switched off (0: never)
    models: list = field(default_factory=list)  # [[reward.models]]: judges, classifiers; each a reward by its name (docs/reward_models.md)


@dataclass
class EvalConfig:
    # Reward functions that grade evaluation, as [reward] functions: the mean of each part
    # (e.g. `accuracy`, `format` for the geometry verifier) is logged as eval/<part>.
    functions: list = field(default_factory=lambda: [{"name": "geometry", "weight": 1.0}])
    split: str = "validation"                # validation | test (a folder or hub set: any split it has, e.g. testmini)
    n: int = num(1, ">= 1")                  # samples per problem: 1 = greedy (Geometry3K-style); > 1 at temperature: pass@1 and pass@n
    temperature: float = num(1.0, "> 0")     # sampling temperature when n > 1
    max_new_tokens: int = num(0, ">= 0")     # evaluation's own generation limit (0: rollout.max_new_tokens)
    top_p: float = num(0.0, "[0, 1]")        # evaluation's own top_p when n > 1 (0: rollout.top_p)
    before_start: bool = False               # also evaluate the initial weights before the first step


@dataclass
class SyncConfig:
    enabled: bool = True                     # False: engines keep the initial weights (the control experiment)
    bucket_mb: float = num(256.0, "> 0")     # bucket size of the broadcast
    verify: bool = False                     # after every sync compare engine and trainer weights bitwise (tests)
    channel_port: int = num(0, "[0, 65535]")  # vllm: the weight channel's TCP port on MASTER_ADDR (0: any free); engine nodes must reach it


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)


# ----------------------------------------------------------------------------- loading
def _check_type(key: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp) or tp
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is list and isinstance(value, list):
        return value
    if isinstance(tp, type) and isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    if isinstance(tp, types.UnionType):
        for t in typing.get_args(tp):
            try:
                return _check_type(key, value, t)
            except ConfigError:
                pass
    name = getattr(tp, "__name__", str(tp))
    raise ConfigError(f"{key}: expected {name}, got {value!r}")


def _apply(cfg: Config, section: str, key: str, value: Any) -> None:
    sub = getattr(cfg, section, None)
    if sub is None or not dataclasses.is_dataclass(sub):
        raise ConfigError(f"unknown config section [{section}] (known: "
                          f"{', '.join(f.name for f in dataclasses.fields(Config))})")
    hints = typing.get_type_hints(type(sub))
    hints.pop("params", None)
    if key not in hints and isinstance(sub, LossConfig):  # a part's key: registry.check owns it
        sub.params[key] = value
        return
    if key not in hints:
        raise ConfigError(f"unknown config key {section}.{key}")
    setattr(sub, key, _check_type(f"{section}.{key}", value, hints[key]))
    if isinstance(sub, DataConfig) and key in ("source", "sources") and value:  # the later one wins
        sub.sources, sub.source = ([], sub.source) if key == "source" else (sub.sources, "")


def load(paths: str | list[str] | None, overrides: list[str] = ()) -> Config:
    """Defaults < TOML file(s) in order (a preset after the base) < `--section.key=value`
    overrides; then `validate`."""
    cfg = Config()
    for path in [paths] if isinstance(paths, str) else (paths or []):
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"--config: no such file {path}") from None
        except IsADirectoryError:
            raise ConfigError(f"--config: {path} is a folder, not a TOML file") from None
        except (OSError, UnicodeDecodeError) as e:  # unreadable, or not text at all
            raise ConfigError(f"--config: cannot read {path} "
                              f"({getattr(e, 'strerror', None) or type(e).__name__})") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{section}: expected a [section] table, got {table!r}")
            for key, value in table.items():
                _apply(cfg, section, key, value)
        if data.get("data", {}).get("source") and data["data"].get("sources"):
            raise ConfigError(f"{path}: sets both data.source and data.sources (an entry names its own dataset)")
    for item in overrides:
        if not item.startswith("--") or "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"override {item!r}: expected --section.key=value")
        dotted, text = item[2:].split("=", 1)
        section, key = dotted.split(".", 1)
        try:  # a TOML value if it parses as one, else the bare string
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        _apply(cfg, section, key, value)
    if cfg.reward.extra_functions and cfg.data.sources and all(
            isinstance(e, dict) and "reward_functions" in e for e in cfg.data.sources):
        raise ConfigError("reward.extra_functions join [reward] functions, which no source uses: every "
                          "data.sources entry has its own reward_functions; list the extra functions there")
    cfg.reward.functions = cfg.reward.functions + cfg.reward.extra_functions  # lists: _apply checked
    cfg.reward.extra_functions = []
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Cross-field rules; each failure is a one-line ConfigError naming the key."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    check_ranges(cfg)
    lo = cfg.loss
    need(cfg.model.min_pixels <= cfg.model.max_pixels,
         f"model.min_pixels ({cfg.model.min_pixels}) must be <= model.max_pixels "
         f"({cfg.model.max_pixels})")
    check_lora(cfg.model)
    need(all(isinstance(t, str) and t for t in cfg.data.delete_text),
         f"data.delete_text: expected a list of non-empty strings, got {cfg.data.delete_text!r}")
    need(not (cfg.model.lora_rank and cfg.train.ref_update_every),
         "train.ref_update_every: with LoRA (model.lora_rank > 0) the reference is the frozen base "
         "(the policy with its adapters off), which cannot move; use 0 or train every parameter")
    for key, on in (("loss.kl_in_reward", lo.kl_in_reward), ("loss.kl_target", lo.kl_target > 0),
                    ("train.ref_update_every", cfg.train.ref_update_every > 0)):
        need(not on or lo.kl_coef > 0, f"{key} needs loss.kl_coef > 0 (the KL coefficient; "
             "with 0 there is no reference policy)")
    need("{problem}" in cfg.data.template, "data.template must contain {problem}")
    need(not cfg.run.export_every or cfg.run.keep_last > 0, "run.export_every needs run.keep_last > 0")
    from synthetic import SYNTHETIC  # a leaf (PIL, no config)
    synthetic = [s for s in [cfg.data.source] + [e.get("source") for e in cfg.data.sources
                                                 if isinstance(e, dict)] if s in SYNTHETIC]
    need(cfg.eval.split.replace("-", "").replace(".", "").replace("_", "").isalnum() and (
        cfg.eval.split in ("validation", "test") or not synthetic),
         f"eval.split must be 'validation' or 'test' (or, for a folder or hub set, the name of one "
         f"of its splits, e.g. 'testmini'), got {cfg.eval.split!r}")
    for i, name in enumerate(cfg.run.report_to):
        need(name in TRACKERS, f"run.report_to: unknown tracker {name!r} "
             f"(known: {', '.join(TRACKERS)})")
        need(name not in cfg.run.report_to[:i], f"run.report_to: {name} is listed twice")
    for key in ("problem_column", "answer_column"):
        need(bool(getattr(cfg.data, key)), f"data.{key} must name a column")
    need((lo.distill_coef > 0) == bool(cfg.model.teacher_path),
         "loss.distill_coef > 0 and model.teacher_path go together (on-policy distillation: the "
         f"coefficient and the teacher), got distill_coef={lo.distill_coef}, teacher_path="
         f"{cfg.model.teacher_path!r}")
    need(cfg.model.teacher_path != "base" or cfg.model.lora_rank > 0,
         "model.teacher_path = \"base\" is the frozen base of a LoRA run (model.lora_rank > 0)")
    _check_functions(cfg, need)


def _check_functions(cfg: Config, need) -> None:
    """:func:`validate`'s rules for the reward-function lists (training, evaluation, a source's own)."""
    own = [(f"data.sources[{i}].reward_functions", e["reward_functions"])  # a source's own
           for i, e in enumerate(cfg.data.sources) if isinstance(e, dict) and "reward_functions" in e]
    for key, specs in (("reward.functions", cfg.reward.functions), ("eval.functions", cfg.eval.functions), *own):
        # an empty list: engines.check (allowed for reward-free distillation, an environment that grades)
        need(isinstance(specs, list), f"{key}: expected a list of reward-function tables, got {specs!r}")
        for i, spec in enumerate(specs):
            need(isinstance(spec, dict) and isinstance(spec.get("name"), str),
                 f"{key}[{i}]: expected a table with a 'name', got {spec!r}")
            w = spec.get("weight", 1.0)  # a nan or inf weight would make every reward non-finite
            need(type(w) in (int, float) and math.isfinite(w),
                 f"{key}[{i}].weight must be a finite number, got {w!r}")


def check_lora(mc: ModelConfig) -> None:
    """The LoRA keys that need no model (the target names are checked against the model's
    linear layers when it is loaded: model.lora_targets)."""
    t = mc.lora_target_modules
    if isinstance(t, list) and (not t or not all(isinstance(x, str) and x for x in t)):
        raise ConfigError(f"model.lora_target_modules: expected \"all-linear\" or a non-empty list "
                          f"of module names, got {t!r}")
    if isinstance(t, str) and not t:
        raise ConfigError("model.lora_target_modules: expected \"all-linear\" or a list of module names, got ''")
    if mc.lora_dropout > 0:
        raise ConfigError(f"model.lora_dropout={mc.lora_dropout}: adapter dropout is refused: the "
                          "trainer's train-mode logprobs would differ from the engines' (the GRPO "
                          "ratio and logprob_diff/max compare them); keep it 0")


def to_dict(cfg: Config) -> dict:
    """The tree as plain data, a part's `[loss]` keys beside the section's own."""
    out = dataclasses.asdict(cfg)
    out["loss"].update(out["loss"].pop("params"))
    return out


def dump_toml(cfg: Config) -> str:
    """The resolved config as TOML (written into the run folder)."""
    lines = []
    for section, table in to_dict(cfg).items():
        lines.append(f"[{section}]")
        for key, value in table.items():
            if value is not None:  # None: unset (TOML has no null; the default is None again)
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")
