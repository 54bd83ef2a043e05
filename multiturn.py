"""Multi-turn rollouts: an episode is a conversation (docs/multiturn.md).

:class:`Conversations` wraps an engine (rollout.Engine) and keeps its `generate` signature: the
first turn samples sp.n replies per prompt as a single-turn rollout does; after each reply the
tool calls in it are run (`rollout.tools`, envs.tools) and otherwise the environment
(`rollout.env`, envs.get) says the next user message or stops; the inserted turn is rendered by
the model's own chat template and the unfinished conversations continue, n = 1 each, with the
conversation so far as their prompt (both engines take it as it is; vLLM's prefix cache reuses
it). A Completion then holds every token after the prompt: the sampled ones (`loss_mask` 1, their
engine logprobs and weight versions) and the inserted ones (`loss_mask` 0, logprob 0), and the
turns with their roles. `rollout.max_turns` bounds the model's turns, `rollout.max_episode_tokens`
(0 = no bound) the tokens after the prompt, sampled and inserted.

Rendering an inserted turn: the template is applied to a fixed base (a user turn, an assistant
turn) plus the new messages, with the next assistant header; what follows the base's assistant
content is the inserted text (the end-of-turn token the engine already sampled when it stopped on
it is not repeated). The model's own tokens are never re-tokenized.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import envs
import inputs as I

_REPLY = "<<reply>>"  # the base's assistant content, found again in the rendered text


@dataclass
class _Live:
    """One conversation being generated: its prompt (ids, images) and what follows it."""
    prompt: tuple
    problem: object
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    routing: list = field(default_factory=list)
    truncated: bool = False
    done: bool = False
    raw: str = ""  # the last reply decoded with its special tokens
    images: list = field(default_factory=list)  # pictures the inserted turns showed
    first: object = None  # the first turn's Completion


class Conversations:
    """A multi-turn engine around `engine` (see the module docstring)."""

    def __init__(self, engine, rc, procs: I.Processors):
        self.engine, self.procs = engine, procs
        self.env = envs.get(rc.env) if rc.env else None
        self.runner = None
        if rc.tools:
            from envs import tools as T
            self.parse, self.runner = T.parse_calls, T.ToolRunner(list(rc.tools), rc.tool_timeout_s)
        self.max_turns, self.budget = rc.max_turns, rc.max_episode_tokens

    takes_problems = True  # rollout() passes each prompt's problem (the environment's first argument)

    def __getattr__(self, name):  # everything else is the engine's (receive_weights, shutdown, ...)
        return getattr(self.engine, name)

    def __setattr__(self, name, value):
        if name in ("between", "interrupt", "chunk"):  # pipeline.Producer's hooks: the engine's
            setattr(self.engine, name, value)
        else:
            object.__setattr__(self, name, value)

    def generate(self, prompts: list, sp, seed: int, problems: list | None = None) -> list[list]:
        per = 1 if sp.greedy else sp.n
        problems = problems if problems is not None else [None] * len(prompts)
        convs = [_Live(p, problems[i]) for i, p in enumerate(prompts) for _ in range(per)]
        for turn in range(self.max_turns):
            live = [c for c in convs if not c.done]
            if not live:
                break
            room = [self._room(c, sp) for c in live]
            rows = (prompts if turn == 0 else
                    [(c.prompt[0] + c.ids, list(c.prompt[1]) + c.images) for c in live])
            step_sp = replace(sp, n=sp.n if turn == 0 else 1, max_new_tokens=max(room))
            out = self.engine.generate(rows, step_sp, seed + turn * 104_729)
            for c, comp, r in zip(live, [x for cs in out for x in cs], room):
                self._add_reply(c, comp, r)
                if turn + 1 < self.max_turns and not c.done:
                    self._next_turn(c, sp)
            for c in live:  # the last allowed turn: the conversation ends with this reply
                c.done = c.done or turn + 1 == self.max_turns
        # the engine's own Completion records (rollout.Completion), refilled with the whole episode
        graded = getattr(self.env, "reward", None)  # an environment's own final reward, if it has one
        done = [replace(c.first, ids=c.ids, logprobs=c.logprobs, truncated=c.truncated,
                        versions=_versions(c.versions), routing=_routing(c.routing), loss_mask=c.mask,
                        turns=c.turns, images=c.images,
                        env_reward=None if graded is None else float(graded(c.problem, c.turns)))
                for c in convs]
        return [done[i * per:(i + 1) * per] for i in range(len(prompts))]

    def _room(self, c: _Live, sp) -> int:
        """The tokens this conversation's next reply may take."""
        return sp.max_new_tokens if not self.budget else max(1, min(sp.max_new_tokens, self.budget - len(c.ids)))

    def _add_reply(self, c: _Live, comp, room: int) -> None:
        n = min(len(comp.ids), room)
        c.first = c.first or comp
        c.ids += comp.ids[:n]
        c.logprobs += comp.logprobs[:n]
        c.versions += comp.versions[:n] if comp.versions else [None] * n
        c.mask += [1] * n
        c.routing.append((comp.routing[:n] if comp.routing is not None else None, n))
        c.truncated = comp.truncated or n < len(comp.ids)  # the last reply's: the episode's at its end
        text = self.procs.tokenizer.decode(comp.ids[:n], skip_special_tokens=True)
        c.turns.append({"role": "assistant", "content": text})
        # tool calls are read with special tokens kept (a tokenizer may mark <tool_call> special)
        c.raw = self.procs.tokenizer.decode(comp.ids[:n], skip_special_tokens=False)
        c.done = bool(self.budget and len(c.ids) >= self.budget)

    def _next_turn(self, c: _Live, sp) -> None:
        """The tool results of the last reply, else the environment's next message; inserted
        after it, or the conversation ends."""
        messages = self._respond(c)
        if not messages:
            c.done = True
            return
        stop = c.ids[-1] if c.ids and c.ids[-1] in self.procs.tokens.stops else None
        ids = inserted_ids(self.procs, messages, stop)
        if self.budget and len(c.ids) + len(ids) >= self.budget:  # no room left for a reply
            c.done, c.truncated = True, True
            return
        c.ids += ids
        c.logprobs += [0.0] * len(ids)
        c.versions += [None] * len(ids)
        c.mask += [0] * len(ids)
        c.routing.append((None, len(ids)))
        c.images += [im for m in messages for im in m.get("images", [])]
        c.turns += [{k: v for k, v in m.items() if k != "images"} for m in messages]

    def _respond(self, c: _Live) -> list[dict]:
        if self.runner is not None:
            calls = self.parse(c.raw)
            if calls:
                out = []
                for call in calls:
                    content, ok = self.runner.run(call)
                    out.append({"role": "tool", "content": content, "name": call.name,
                                **({} if ok else {"error": True})})
                return out
        if self.env is None:
            return []
        msg = self.env.step(c.problem, c.turns)
        if msg is None:
            return []
        return [msg if isinstance(msg, dict) else {"role": "user", "content": str(msg)}]

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.close()
        self.engine.shutdown()


def _versions(vs: list) -> list[int]:
    """Per-token versions ([] when no turn recorded any: all the episode's version); an inserted
    token takes the version of the reply before it."""
    if all(v is None for v in vs):
        return []
    last, out = next(v for v in vs if v is not None), []
    for v in vs:
        last = last if v is None else v
        out.append(last)
    return out


def _routing(parts: list):
    """The turns' routing as one [R, L, k] tensor (-1 rows for inserted tokens), or None."""
    ref = next((r for r, _ in parts if r is not None), None)
    if ref is None:
        return None
    import torch
    return torch.cat([r.to(torch.int16) if r is not None else
                      torch.full((n, *ref.shape[1:]), -1, dtype=torch.int16) for r, n in parts])


def _render(procs: I.Processors, messages: list[dict], generation_prompt: bool) -> str:
    chat = procs.chat
    kw = I.template_kwargs(chat)
    return procs.tokenizer.apply_chat_template(messages, chat_template=chat.template, tokenize=False,
                                               add_generation_prompt=generation_prompt, **kw)


def inserted_ids(procs: I.Processors, messages: list[dict], stop: int | None) -> list[int]:
    """The tokens that follow a sampled reply when `messages` (user or tool turns, no images)
    come next: the reply's closing (without the stop token `stop` the reply already ended on),
    the messages, and the next assistant header: what the template renders after an assistant
    turn's content when they follow it (the part before may differ, e.g. a template that drops earlier
    turns' thinking: the model's own tokens are kept as sampled). ValueError when the template
    loses the reply's content."""
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _REPLY}]
    after = _render(procs, base + [_plain(m) for m in messages], True)
    if _REPLY not in after:
        raise ValueError("the chat template drops an earlier assistant turn's content: multi-turn "
                         "rollouts cannot insert turns with it")
    ids = procs.tokenizer.encode(after[after.rindex(_REPLY) + len(_REPLY):], add_special_tokens=False)
    return ids[1:] if stop is not None and ids and ids[0] == stop else ids


def _plain(m: dict) -> dict:
    """A message as the template takes it (roles, content, a tool's name)."""
    return {k: v for k, v in m.items() if k in ("role", "content", "name")}


def wrap(engine, rc, procs: I.Processors):
    """`engine` itself for a single-turn run, else its :class:`Conversations`."""
    return Conversations(engine, rc, procs) if (rc.env or rc.tools) else engine


def max_sampled_tokens(rc) -> int:
    """The most tokens an episode's engine samples: max_new_tokens per turn, or with an
    environment or tools up to max_turns turns within max_episode_tokens ("seq-mean-token-sum-norm"'s
    constant)."""
    if not (rc.env or rc.tools):
        return rc.max_new_tokens
    most = rc.max_turns * rc.max_new_tokens
    return min(most, rc.max_episode_tokens) if rc.max_episode_tokens else most


def turn_metrics(episodes: list) -> dict[str, float]:
    """rollout/turns_mean (the model's turns), rollout/tool_calls_mean and rollout/tool_errors
    (a count) of a step's episodes: {} for single-turn ones."""
    if not any(getattr(e, "turns", None) for e in episodes):
        return {}
    n = max(1, len(episodes))
    roles = [[t["role"] for t in e.turns] for e in episodes]
    return {"rollout/turns_mean": sum(r.count("assistant") for r in roles) / n,
            "rollout/tool_calls_mean": sum(r.count("tool") for r in roles) / n,
            "rollout/tool_errors": float(sum(bool(t.get("error")) for e in episodes for t in e.turns))}
