"""The records that cross from generation to training (:class:`Episode`, :class:`Completion`,
:class:`Sampling`) and the contract of an inference engine (:class:`Engine`, :class:`AheadEngine`).

A leaf: it imports nothing of the project, so an engine, the rollout and the trainer all read
the contract here. An engine offers one thing: `generate` continuations of given rows until the
`check` it is handed says stop. What grows a row (a new weight version mid-batch, an inserted
turn) and the seeds of each continuation are the one loop above the engines (multiturn.generate).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import torch


@dataclass
class Episode:
    index: int                  # dataset index of the problem; its images are looked up by it
    group: int                  # prompt number within the step; the G samples of a prompt share it
    prompt_ids: list[int]       # chat prompt, ONE unexpanded placeholder per image (maybe none)
    response_ids: list[int]     # sampled tokens, eos included when sampled
    logprobs: list[float]       # engine's logprob of each response token
    reward: float               # weighted total of the reward functions
    parts: dict[str, float]     # each reward part (accuracy, format, errors, ...)
    version: int                # weight version the engine generated with (partial: its oldest token's)
    truncated: bool             # stopped by max_new_tokens, not by eos
    text: str = ""              # decoded response, for samples.jsonl and debugging
    versions: list[int] = field(default_factory=list)  # partial rollouts: each token's; [] = all `version`
    info: dict = field(default_factory=dict)  # what reward functions returned beside the score (samples only)
    source: str = ""            # its problem's data.sources name ("" for the one data.source)
    routing: torch.Tensor | None = None  # MoE: [R, L, k] experts of the input predicting each token (routing.py)
    prompt_routing: torch.Tensor | None = None  # MoE: [P - 1, L, k] the other prompt tokens' (expanded prompt)
    # multi-turn (multiturn.py): response_ids are every token after the prompt; 1 on the sampled
    # ones, 0 on inserted user / tool turns ([] = all sampled); the turns with their roles
    loss_mask: list[int] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    images: list = field(default_factory=list)  # pictures inserted turns showed (after the problem's)
    kv_kept: bool = False       # its KV kept across weight loads ("keep"): logprob_diff skips it unless all fresh


@dataclass(frozen=True)
class Sampling:
    """Sampling knobs, always passed explicitly (transformers otherwise defaults top_k to 50)."""
    n: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    greedy: bool = False


@dataclass
class Completion:
    ids: list[int]
    logprobs: list[float]
    truncated: bool             # not ended by a stop token (the budget, or the check ended the call)
    versions: list[int] = field(default_factory=list)  # with a check: each token's weight version
    routing: torch.Tensor | None = None  # MoE: [len(ids), L, k] (routing.py)
    prompt_routing: torch.Tensor | None = None  # MoE: the prompt's tokens but the last (routing.py)
    loss_mask: list[int] = field(default_factory=list)  # multi-turn (multiturn.py); [] = all sampled
    turns: list[dict] = field(default_factory=list)
    images: list = field(default_factory=list)  # multi-turn: pictures the inserted turns showed
    env_reward: float | None = None  # multi-turn: the environment's reward (its turns', envs.episode_reward), if any
    reprefilled: int = 0        # multiturn.generate: row tokens prefilled again after a weight arrival
    kv_kept: bool = False       # rollout.partial = "keep": later tokens decoded over older weights' KV


Prompt = tuple[list[int], list]  # (unexpanded token ids, PIL images)
Named = list[tuple[str, torch.Tensor]]  # (HF parameter name, tensor) pairs of one bucket
# The weight version the next tokens are sampled with; raises to stop generating (the exception
# goes through `generate` to its caller). pipeline.Producer hands one to an engine it drives.
Check = Callable[[], int]


class WeightSource(Protocol):
    """Where one weight sync comes from (sync.Receiver on a generation rank; in a world of one,
    sync.LocalControl): the version and bucket plan, then the buckets in plan order. `partial`
    (set by `control()`): the plan holds only the tensors that change (LoRA), the engine keeps
    the others."""
    partial: bool

    def control(self) -> tuple[int, list]: ...
    def buckets(self) -> Iterable[Named]: ...


class Engine(Protocol):
    """What the rollout, the producer and the sync code need from an inference engine (hf_engine,
    vllm_engine); nothing else of an engine is called outside it."""
    OWN_CHANNEL: bool  # True: buckets go over channel.open_channel (`join_weight_channel`) and
    #                    the engine is an AheadEngine; False: over the torch sync group, plus
    #                    `load_weights` for a world of one and for pipeline.Producer's staging
    STEPS_SHARED: bool  # True: `generate` calls from several threads at once decode together,
    #                     each step advancing every call's samples (continuous batching across
    #                     batches, `rollout.batches_in_flight`); False: one call at a time

    def generate(self, rows: list[Prompt], sp: Sampling, seed: int,
                 check: Check | None = None) -> list[list[Completion]]:
        """sp.n sampled continuations of each row (1 when greedy), with per-token logprobs; the
        call's samples are seeded from `seed` (multiturn.generate says how a batch's calls are).

        `check` (None: one uninterrupted call): called before the first token (its version is
        the call's) and after every decode step; once it returns another version the call ends
        there, each unfinished sample coming back with its tokens so far (`truncated`, fewer
        than sp.max_new_tokens); with a check every token's version is in `versions`. What
        `check` raises ends the call (nothing in flight is left in the engine) and propagates."""

    def receive_weights(self, source: WeightSource) -> int:
        """Load one sync's weights from `source`; returns the version received."""

    def shutdown(self) -> None:
        """Release the engine's processes and memory."""

    @classmethod
    def start_note(cls, rc, config) -> str:
        """What the engine decided from `[rollout]` (rc) and the model's config (None: not known
        yet, a dry run), said once at start and in the dry run; "" for nothing."""

    @classmethod
    def from_config(cls, cfg, path: str, procs, *, dev, device, seed: int, max_images: int = 1) -> "Engine":
        """The engine of a generation rank from the run's config (engines.build_engine);
        `max_images`: the most images one prompt holds."""


class LocalEngine(Engine, Protocol):
    """An engine whose weights live in this process (OWN_CHANNEL False: hf_engine.HFEngine)."""

    def load_weights(self, named: Named, adopt: bool = False) -> None:
        """Copy (or with `adopt`, take as storage) HF-named tensors into the model: a world of
        one's sync, pipeline.Producer's staged weights."""

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The weights by HF name (sync.verify)."""

    def sleep(self) -> None:
        """cluster.colocate: give the device up for the train phase (weights to host memory,
        KV cache freed); the engine generates nothing until :meth:`wake_up`."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """cluster.colocate: back on the device; tags "weights" (before a sync loads them) and
        "kv_cache" (after), None for both; on an awake engine a no-op."""


class AheadEngine(Engine, Protocol):
    """An engine with its own weight channel (OWN_CHANNEL) driven from pipeline.Producer's worker
    thread while the rank's main thread receives the syncs: a receive runs inside the engine, at
    the worker's next decode step."""
    weight_version: int  # the version of the weights generating now

    def join_weight_channel(self, host: str, port: int, rank_offset: int, world_size: int) -> None:
        """Join, once, the weight channel trainer rank 0 opens (channel.open_engine_channel)."""

    def receive_ahead(self, source: WeightSource, stage: bool) -> int:
        """One sync from the main thread while the worker may be generating. `stage`: kept
        aside, loaded by `load_staged` (a batch's weights never change); else loaded at once,
        ending the worker's call in flight (partial rollouts). Returns the version received."""

    def load_staged(self) -> int | None:
        """Load what `receive_ahead(stage=True)` kept (a batch's start): its version, or None."""

    def weights_waiting(self) -> bool:
        """A receive waits for the worker's next decode step."""
