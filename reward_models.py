"""Reward models: `[[reward.models]]` entries, each loaded once at start on a generation rank
(beside its engine) and named in `reward.functions` / `eval.functions` / a source's
`reward_functions` like a reward function (docs/reward_models.md). A `judge` is a causal LM
asked a yes/no question (its `template` with the response, the gold answer and the problem
filled in); its reward is P(yes) / (P(yes) + P(no)) at the position after the prompt (each
word's first token), from
one forward, no sampling; or, with `parse` naming a rule of :data:`PARSE`, what that rule
reads in the text the judge generates (greedy, the HF engine). A `classifier` is a sequence-classification model; its reward is
the one logit of a one-label head, else the probability of the last label. Either scores
a batch of `batch_size` responses per forward (rewards.RewardRunner calls it).
"""
from __future__ import annotations

import re
import string
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import data
import device as D
import failures
import families as F
import rewards
from errors import ConfigError

KINDS = ("judge", "classifier")
ROLES = ("generation", "trainer")
DTYPES = ("float32", "bfloat16", "float16")
RESERVED = ("reward", "mean", "errors", "info", "env")  # the score is also the part reward/<name>
FIELDS = ("response", "gold", "problem")  # what a template may insert
KEYS = ("name", "path", "kind", "template", "role", "dtype", "batch_size", "chat", "yes", "no",
        "parse", "max_new_tokens")
DEFAULTS = {"role": "generation", "dtype": "float32", "batch_size": 8, "chat": True,
            "yes": "yes", "no": "no", "template": "", "parse": "", "max_new_tokens": 64}


def _yes_no(text: str, e: dict) -> float:
    """1.0 when the last of the entry's two verdict words in `text` (whole words, any case) is
    `yes`, 0.0 when it is `no`."""
    words = re.findall(r"\b(" + "|".join(re.escape(e[k]) for k in ("yes", "no")) + r")\b", text, re.I)
    if not words:
        raise ValueError(f"the judge's text has neither {e['yes']!r} nor {e['no']!r}: {text[:80]!r}")
    return float(words[-1].lower() == e["yes"].lower())


def _last_number(text: str, e: dict) -> float:
    """The last number in `text` (a grade such as "7" or "0.8"), as it is."""
    found = re.findall(r"-?\d+(?:\.\d+)?", text)
    if not found:
        raise ValueError(f"the judge's text has no number: {text[:80]!r}")
    return float(found[-1])


# a generating judge's rules (`parse`): its text -> the score; an error makes that sample fail
PARSE = {"yes_no": _yes_no, "last_number": _last_number}


def entry(e: dict) -> dict:
    """An entry with its defaults filled in (the keys: docs/reward_models.md)."""
    return DEFAULTS | e


def check(cfg, functions: list[str]) -> dict[str, str]:
    """`cfg`'s `[[reward.models]]` entries' names -> their roles; a ConfigError naming the entry's
    key for a bad one (`functions`: the registered reward functions' names, which an entry may
    not reuse), and for a `role = "trainer"` model in reward.functions under DAPO refills (the
    generation side decides a refill before the trainers' scores exist)."""
    entries = cfg.reward.models
    if not isinstance(entries, list):
        raise ConfigError(f"reward.models: expected a list of [[reward.models]] tables, got {entries!r}")
    names: dict[str, str] = {}
    for i, raw in enumerate(entries):
        key = f"reward.models[{i}]"
        if not isinstance(raw, dict):
            raise ConfigError(f"{key}: expected a table {{name, path, kind, ...}}, got {raw!r}")
        _check_entry(key, entry(raw), functions, list(names))
        names[raw["name"]] = entry(raw)["role"]
    late = [s["name"] for s in cfg.reward.functions if names.get(s["name"]) == "trainer"]
    if late and cfg.loss.drop_zero_variance and cfg.rollout.max_refill_rounds > 0:
        raise ConfigError(f"reward.functions: {late[0]!r} is scored on the trainer ranks (role = 'trainer'), "
                          "after the generation side decides DAPO refills (loss.drop_zero_variance with "
                          "rollout.max_refill_rounds > 0); give it role = 'generation' or set "
                          "--rollout.max_refill_rounds=0")
    return names


def _check_entry(key: str, e: dict, functions: list[str], seen: list[str]) -> None:
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(f"{key}.{msg}")
    for k in e:
        need(k in KEYS, f"{k}: unknown key (known: {', '.join(KEYS)})")
    name = e.get("name")
    need(isinstance(name, str) and name.isidentifier(), f"name: expected a name (letters, digits, _), got {name!r}")
    need(name not in functions, f"name: {name!r} is a registered reward function; name the model otherwise")
    need(name not in seen, f"name: {name!r} names an earlier entry too")
    need(name not in RESERVED, f"name: {name!r} is a metric's or the runner's own key (reward/{name}); name the model otherwise")
    need(isinstance(e.get("path"), str) and e["path"] != "", "path: expected a model folder, hub id or tiny name")
    F.check_model_path(e["path"], f"{key}.path")
    need(e.get("kind") in KINDS, f"kind: expected one of {', '.join(KINDS)}, got {e.get('kind')!r}")
    need(e["role"] in ROLES, f"role: expected one of {', '.join(ROLES)}, got {e['role']!r}")
    need(e["dtype"] in DTYPES, f"dtype: expected one of {', '.join(DTYPES)}, got {e['dtype']!r}")
    need(type(e["batch_size"]) is int and e["batch_size"] >= 1, f"batch_size: expected an int >= 1, got {e['batch_size']!r}")
    need(isinstance(e["chat"], bool), f"chat: expected true or false, got {e['chat']!r}")
    for k in ("yes", "no"):
        need(isinstance(e[k], str) and e[k] != "", f"{k}: expected a non-empty string, got {e[k]!r}")
    need(e["parse"] in ("", *PARSE), f"parse: expected one of {', '.join(PARSE)} (or \"\": "
         f"no generation), got {e['parse']!r}")
    need(not e["parse"] or e["kind"] == "judge", "parse: only a judge generates (kind = 'judge')")
    need(type(e["max_new_tokens"]) is int and e["max_new_tokens"] >= 1,
         f"max_new_tokens: expected an int >= 1, got {e['max_new_tokens']!r}")
    t = e["template"]
    need(isinstance(t, str), f"template: expected a string, got {t!r}")
    try:
        used = {f for _, f, _, _ in string.Formatter().parse(t) if f is not None}
    except ValueError as err:
        raise ConfigError(f"{key}.template: {err} (write a literal brace as {{{{ or }}}})") from None
    need(used <= set(FIELDS), f"template: unknown field(s) {sorted(used - set(FIELDS))} (known: "
         f"{', '.join('{' + f + '}' for f in FIELDS)})")
    if e["kind"] == "judge":
        need("response" in used, "template: a judge's template must contain {response}")
    else:
        need(not (e["chat"] and t), "template: a classifier with chat = true scores the conversation "
             "(the problem, then the response): set chat = false to score the template's text")


class ModelReward:
    """One loaded entry: ``self(responses, samples) -> [{"reward": x, <name>: x}, ...]`` with one
    forward (a generating judge: one generate call) per call (``batch_size`` responses at most:
    rewards.RewardRunner batches)."""

    def __init__(self, e: dict, folder: str, device: torch.device, seed: int) -> None:
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
        from model import DTYPES as TORCH_DTYPES
        t0 = time.perf_counter()
        self.e, self.name, self.batch_size = e, e["name"], e["batch_size"]
        self.device, self.forwards = device, 0
        self.tok = AutoTokenizer.from_pretrained(folder)
        self.tok.padding_side = "right"  # the last real token of each row is read at mask.sum() - 1
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token
        if e["parse"]:  # a judge that generates: the HF engine, with its own copy of the weights
            import hf_engine
            import inputs as I
            self.engine = hf_engine.HFEngine(folder, TORCH_DTYPES[e["dtype"]],
                                             I.load_processors(folder, 56 * 56, 112 * 112), device)
            self.load_s = time.perf_counter() - t0
            return
        config = AutoConfig.from_pretrained(folder)
        cls = F.auto_class(config) if e["kind"] == "judge" else AutoModelForSequenceClassification
        torch.manual_seed(seed)  # a head the folder lacks (a tiny test model's) starts the same everywhere
        try:
            self.model = cls.from_pretrained(folder, dtype=TORCH_DTYPES[e["dtype"]]).to(device).eval()
        except ValueError as err:  # e.g. no sequence-classification class for this config
            raise ConfigError(f"reward.models {self.name!r}: cannot load {e['path']} as a {e['kind']} "
                              f"({str(err).splitlines()[0][:200]})") from None
        if e["kind"] == "classifier" and self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tok.pad_token_id  # the head reads the last real token
        if e["kind"] == "judge":  # each word's first token (a byte tokenizer's first letter)
            self.ids = [self.tok.encode(e[k], add_special_tokens=False)[0] for k in ("yes", "no")]
            if self.ids[0] == self.ids[1]:
                raise ConfigError(f"reward.models {self.name!r}: yes = {e['yes']!r} and no = {e['no']!r} "
                                  f"start with the same token for {e['path']}'s tokenizer")
        self.load_s = time.perf_counter() - t0

    def text(self, response: str, sample: dict) -> str:
        """What the model reads for one response (docs/reward_models.md)."""
        e = self.e
        fill = {"response": response, "gold": str(sample.get("answer", "")),
                "problem": str(sample.get("problem", ""))}
        if e["kind"] == "classifier":
            if not e["chat"]:
                return (e["template"] or "{problem}\n{response}").format(**fill)
            return self.tok.apply_chat_template(
                [{"role": "user", "content": fill["problem"]},
                 {"role": "assistant", "content": response}], tokenize=False)
        body = e["template"].format(**fill)
        if not e["chat"]:
            return body
        return self.tok.apply_chat_template([{"role": "user", "content": body}], tokenize=False,
                                            add_generation_prompt=True)

    @torch.no_grad()
    def __call__(self, responses: list[str], samples: list[dict]) -> list[dict[str, float]]:
        texts = [self.text(r, s) for r, s in zip(responses, samples)]
        if self.e["parse"]:
            return self.generated(texts)
        enc = self.tok(texts, return_tensors="pt", padding=True,
                       add_special_tokens=not self.e["chat"]).to(self.device)
        logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
        self.forwards += 1
        if self.e["kind"] == "judge":
            last = enc["attention_mask"].sum(1) - 1
            pair = logits[torch.arange(len(texts), device=logits.device), last][:, self.ids].float()
            scores = pair.softmax(-1)[:, 0]
        else:
            scores = logits[:, 0].float() if logits.shape[-1] == 1 else logits.float().softmax(-1)[:, -1]
        return [{"reward": x, self.name: x} for x in scores.tolist()]


    def generated(self, texts: list[str]) -> list:
        """A generating judge's results: one greedy generate call over `texts` (up to
        `max_new_tokens`), each text parsed by the entry's rule (its text kept in `info` under
        the entry's name); a text the rule cannot read is that sample's failure (an exception
        in its place: it scores 0 and counts in reward/errors)."""
        from episode import Sampling
        e = self.e
        prompts = [(self.tok(t, add_special_tokens=not e["chat"])["input_ids"], []) for t in texts]
        out = self.engine.generate(prompts, Sampling(n=1, greedy=True, max_new_tokens=e["max_new_tokens"]), seed=0)
        self.forwards += 1
        results: list = []
        for cs in out:
            verdict = self.tok.decode(cs[0].ids, skip_special_tokens=True)
            try:
                x = PARSE[e["parse"]](verdict, e)
            except ValueError as err:
                results.append(err)
                continue
            results.append({"reward": x, self.name: x, "info": {self.name: verdict}})
        return results


def load(entries: list[dict], run_dir, device: torch.device, seed: int, say=None) -> dict[str, ModelReward]:
    """Every entry loaded (a tiny name built under `run_dir`, as model.path's), timed: entry name
    -> ModelReward. `say`: where the load line goes (one generation rank's console)."""
    from model import resolve_path
    out = {}
    for raw in entries:
        e = entry(raw)
        m = out[e["name"]] = ModelReward(e, resolve_path(e["path"], run_dir, seed), device, seed)
        if say:
            say(f"reward model {e['name']!r} ({e['kind']}, {e['path']}, {e['dtype']}) loaded on "
                f"{device} in {m.load_s:.2f} s (before step 1; not counted in reward.timeout_s)")
    return out


def runners(cfg, world, dev, live, lists: tuple, tr=None) -> list:
    """A generation rank's reward runner for each of `lists` (None elsewhere), sharing the
    `role = "generation"` [[reward.models]], loaded here once (before step 1, timed apart from
    reward.timeout_s) on the rank's accelerator, beside its engine. On a trainer rank (`tr`, its
    trainer.Trainer) the `role = "trainer"` entries that `lists` name load here too, on the rank's
    device, as `tr.rewards`, and score each step's responses in update.train_step
    (:func:`score_on_trainers`)."""
    rc = cfg.reward
    named = {s["name"] for fns in lists for s in fns}
    there = [e for e in map(entry, rc.models) if e["role"] == "trainer" and e["name"] in named]
    if tr is not None and there:
        models = _load_here(cfg, world, dev, live, there, world.is_root)
        tr.rewards = TrainerScorer(rewards.RewardRunner(
            [s for s in rc.functions if s["name"] in models], rc.timeout_s, rc.max_consecutive_timeouts,
            models=models), _problems(cfg), cfg.rollout.max_new_tokens)
    if not world.is_gen:
        return [None] * len(lists)
    here = [e for e in map(entry, rc.models) if e["role"] == "generation"]
    models = _load_here(cfg, world, dev, live, here, world.gen_index == 0) if here else {}
    skip = {e["name"] for e in there}  # scored on the trainer ranks, added there
    return [rewards.RewardRunner([s for s in fns if s["name"] not in skip], rc.timeout_s,
                                 rc.max_consecutive_timeouts, sources=data.own_functions(cfg.data),
                                 models=models) for fns in lists]


def _load_here(cfg, world, dev, live, entries: list[dict], say: bool) -> dict:
    """`entries` loaded on this rank's device (`say`: this rank prints each load line)."""
    live.phase(None, "start: loading the reward models")
    try:
        return load(entries, Path(cfg.run.out_dir), D.torch_device(dev, world.local_rank),
                    cfg.run.seed, say=(lambda m: print(m, flush=True)) if say else None)
    except ConfigError as e:  # found by the ranks that load: each says it (exit 4), not rank 0
        raise failures.Fatal(str(e)) from None


def _problems(cfg) -> dict[int, Any]:
    """The training split's problems by index, as train.py loads them (the same skips, so the
    same indices), without their images: what a trainer-side model reads of an episode's."""
    import dataclasses
    import inputs as I
    from model import resolve_path
    procs = I.processors(resolve_path(cfg.model.path, Path(cfg.run.out_dir), cfg.run.seed),
                         cfg.model, cfg.data, cfg.rollout)
    problems, _ = data.load_sources(cfg.data, "train", seed=cfg.run.seed, prompt_len=lambda p:
                                    I.prompt_len(procs, data.user_text(p, cfg.data.template), p.images))
    return {p.index: dataclasses.replace(p, images=[]) for p in problems}


class TrainerScorer:
    """The `role = "trainer"` reward models of a trainer rank: `runner` (a rewards.RewardRunner
    over reward.functions' trainer-side entries), `problems` (index -> data.Problem) and the
    rollout's max_new_tokens (what a sample says, as the generation side's)."""

    def __init__(self, runner, problems: dict, max_new_tokens: int) -> None:
        self.runner, self.problems, self.max_new_tokens = runner, problems, max_new_tokens

    def score(self, episodes: list, world) -> dict[str, float]:
        """Every episode scored (this rank its share, i = trainer_index mod the trainer count,
        gathered over the trainer group: every trainer ends with the same rewards) and added to
        its reward, parts and info as the generation side's functions are; the step's reward
        metrics (rollout.episode_metrics' reward/ keys) recomputed over the new rewards."""
        import rollout
        mine = list(range(world.trainer_index, len(episodes), len(world.trainers)))
        got = self.runner.score([episodes[i].text for i in mine], [rollout.reward_sample(
            self.problems[episodes[i].index], episodes[i], self.max_new_tokens) for i in mine])
        every = [None] * len(world.trainers)
        dist.all_gather_object(every, dict(zip(mine, got)), group=world.train_group)
        for part in every:
            for i, d in part.items():
                e, d = episodes[i], dict(d)
                e.reward += d.pop("reward")
                e.info.update(d.pop("info", {}))
                for k, v in d.items():
                    e.parts[k] = e.parts.get(k, 0.0) + v
        sources = sorted({e.source for e in episodes if e.source})
        return {k: v for k, v in rollout.episode_metrics(episodes, [], 0, sources).items()
                if k.startswith("reward/")}


def score_on_trainers(tr, episodes: list, world) -> dict[str, float]:
    """update.train_step's first phase: trainer `tr`'s `role = "trainer"` models' rewards added
    to the step's episodes before anything reads them (TrainerScorer.score); {} without such
    models."""
    return tr.rewards.score(episodes, world) if tr.rewards is not None and episodes else {}
