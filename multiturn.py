"""Generation as rows that grow: the one continuation loop above the engines (:func:`generate`),
and multi-turn rollouts, where an episode is a conversation (docs/multiturn.md).

A partial rollout (a new weight version arrives mid-batch: the engine's `check` ends its call)
and an inserted turn (a tool result, the environment's next message) are the same move: the row
grows and an engine continues it, as its prompt plus everything after it so far (both engines
take it as it is; vLLM's prefix cache reuses it).

Multi-turn (:class:`Turns`, `rollout.env` / `rollout.tools`): the first call samples sp.n
replies per prompt; after each reply the tool calls in it are run (envs.tools, at most
`rollout.max_tool_calls` of them) and otherwise the environment (envs.get) says the next user
message or stops; the inserted turn is rendered by the model's own chat template. A Completion
then holds every token after the prompt: the sampled ones (`loss_mask` 1, their engine logprobs
and weight versions) and the inserted ones (`loss_mask` 0, logprob 0), and the turns with their
roles. `rollout.max_turns` bounds the model's turns, `rollout.max_episode_tokens` the tokens after
the prompt, sampled and inserted (0: :func:`episode_budget`).

Rendering an inserted turn: the template is applied to a fixed base (a user turn, an assistant
turn) plus the new messages, with the next assistant header; what follows the base's assistant
content is the inserted text (the end-of-turn token the engine already sampled when it stopped on
it is not repeated), its messages' contents tokenized as text (:func:`encode_turn_text`). The
model's own tokens are never re-tokenized.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import envs
import inputs as I
from episode import Check, Completion, Engine, Prompt, Sampling

_REPLY = "<<reply>>"  # the base's assistant content, found again in the rendered text
SEED_STRIDE = 104_729  # call c of a batch samples with seed + c * SEED_STRIDE (generate)


@dataclass
class _Live:
    """One sample being generated: its prompt (ids, images) and what follows it."""
    prompt: Prompt
    problem: object
    state: object = None  # the environment's per-episode state (envs.Environment.reset)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # with a check; an inserted token: its reply's
    mask: list[int] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    routing: list = field(default_factory=list)
    truncated: bool = False
    done: bool = False
    reply: int = 0        # tokens of the reply being sampled, so far
    replies: int = 0      # the model's finished replies
    images: list = field(default_factory=list)  # pictures the inserted turns showed
    first: Completion | None = None  # the first call's Completion (its prompt routing)
    cut: bool = False     # the check ended its last call (a new weight version): prefilled again next
    reprefilled: int = 0  # row tokens prefilled again after weight arrivals (rollout/reprefill_tokens)


def generate(engine: Engine, prompts: list[Prompt], sp: Sampling, seed: int, check: Check | None = None,
             turns: Turns | None = None, problems: list | None = None,
             states: list | None = None) -> list[list[Completion]]:
    """sp.n samples of each prompt (1 when greedy), each continued until it ends: the one loop
    that grows rows, for partial rollouts and multi-turn episodes alike, on any engine.

    Call c = 0, 1, ... of the loop hands the engine its rows and `check` (episode.Engine) with
    the seed `seed + c * SEED_STRIDE`: call 0 every prompt with its sp.n samples, each later call
    every unfinished sample alone (n = 1) as its prompt plus its tokens so far, in sample order.
    A sample is unfinished when the check ended the call before its reply did (a new weight
    version) or when `turns` inserted a turn after its reply. Within a call an engine seeds as
    it always does (HF: the call's generator; vLLM: row r's samples seed + c * SEED_STRIDE +
    r * n + j), so a given schedule (which calls end where) reproduces its tokens on each engine.
    Each reply has at most sp.max_new_tokens tokens (and what the episode budget leaves).
    A row continued after the check ended its call is prefilled again whole (prompt + tokens so
    far, as the row holds them: an image one placeholder): `Completion.reprefilled` counts them.
    An engine that keeps its KV across weight loads (hf with `rollout.partial = "keep"`) never
    ends a call on a check, so none are. `states`: each sample's environment state, in sample
    order (Turns.start; None: none)."""
    per = 1 if sp.greedy else sp.n
    live = [_Live(p, problems[i] if problems else None) for i, p in enumerate(prompts) for _ in range(per)]
    for c, state in zip(live, states or [], strict=bool(states)):
        c.state = state
    call = 0
    while todo := [c for c in live if not c.done]:
        room = [sp.max_new_tokens - c.reply if turns is None else turns.room(c, sp) for c in todo]
        rows = (prompts if call == 0 else
                [(c.prompt[0] + c.ids, list(c.prompt[1]) + c.images) for c in todo])
        for c, (ids, _) in zip(todo, rows if call else ()):
            c.reprefilled += len(ids) if c.cut else 0
        out = engine.generate(rows, replace(sp, n=sp.n if call == 0 else 1, max_new_tokens=max(room)),
                              seed + call * SEED_STRIDE, check)
        for c, comp, r in zip(todo, [x for cs in out for x in cs], room, strict=True):
            if _add_tokens(c, comp, r):  # the reply is over: so is the sample, or turns says
                c.done = turns is None
                turns and turns.after_reply(c)
        call += 1
    done = [_completion(c, turns) for c in live]
    return [done[i * per:(i + 1) * per] for i in range(len(prompts))]


def _add_tokens(c: _Live, comp: Completion, room: int) -> bool:
    """A call's tokens for `c` (at most `room`); whether its reply is over (else the check
    ended the call first)."""
    n = min(len(comp.ids), room)
    c.first = c.first or comp
    c.ids += comp.ids[:n]
    c.logprobs += comp.logprobs[:n]
    c.versions += comp.versions[:n]  # [] without a check (episode.Engine.generate)
    c.mask += [1] * n
    c.routing.append((comp.routing[:n] if comp.routing is not None else None, n))
    c.reply += n
    c.cut = comp.truncated and n == len(comp.ids) and n < room
    if c.cut:
        return False  # ended by the check: the reply goes on in the next call
    c.truncated = comp.truncated or n < len(comp.ids)  # the last reply's: the episode's at its end
    return True


def _completion(c: _Live, turns: Turns | None) -> Completion:
    """The engine's first Completion record refilled with the whole sample (episode)."""
    many = turns is not None
    return replace(c.first, ids=c.ids, logprobs=c.logprobs, truncated=c.truncated,
                   versions=c.versions, routing=_routing(c.routing, many),
                   loss_mask=c.mask if many else [], turns=c.turns, images=c.images,
                   env_reward=turns.env_reward(c) if many else None, reprefilled=c.reprefilled)


def turns(rc, procs: I.Processors, sources: dict | None = None) -> Turns | None:
    """The turn rule of a run with an environment or tools (`[rollout]` rc), else None;
    `sources`: data.sources' own env_args (source name -> keys over rc.env_args)."""
    return Turns(rc, procs, sources) if (rc.env or rc.tools) else None


class Turns:
    """What follows a reply in a multi-turn rollout (see the module docstring)."""

    def __init__(self, rc, procs: I.Processors, sources: dict | None = None):
        self.procs = procs
        self.env = envs.get(rc.env, rc.env_args) if rc.env else None
        # a source with env_args of its own: an instance of its own, for its problems
        self.envs = {name: envs.get(rc.env, {**rc.env_args, **args}) for name, args in (sources or {}).items()}
        self.env_name = rc.env
        self.runner = None
        if rc.tools:
            from envs import tools as T
            self.parse, self.runner = T.parse_calls, T.ToolRunner(list(rc.tools), rc.tool_timeout_s)
        self.max_turns, self.budget, self.max_calls = rc.max_turns, episode_budget(rc), rc.max_tool_calls

    def start(self, problems: list, per: int, seed: int) -> tuple[list, list]:
        """(each problem's first user text, None for its own; each of its `per` episodes' state,
        in sample order) from the environment's reset, with the group's seed
        :func:`episode_seed` (None and None without an environment)."""
        if self.env is None:
            return None, None
        starts = [[self._env(p).reset(p, episode_seed(seed, g)) for _ in range(per)] for g, p in enumerate(problems)]
        return [group[0][1] for group in starts], [state for group in starts for state, _ in group]

    def room(self, c: _Live, sp: Sampling) -> int:
        """The tokens the conversation's reply in progress may still take."""
        return max(1, min(sp.max_new_tokens - c.reply, self.budget - len(c.ids)))

    def after_reply(self, c: _Live) -> None:
        """The reply just ended: record it, then insert the next turn or end the conversation
        (the environment grades the reply even when the turn limits end the episode)."""
        reply, c.reply, c.replies = c.ids[len(c.ids) - c.reply:], 0, c.replies + 1
        c.turns.append({"role": "assistant",
                        "content": self.procs.tokenizer.decode(reply, skip_special_tokens=True)})
        c.done = len(c.ids) >= self.budget or c.replies >= self.max_turns
        # tool calls are read with special tokens kept (a tokenizer may mark <tool_call> special)
        messages = self._respond(c, self.procs.tokenizer.decode(reply, skip_special_tokens=False))
        if not c.done:
            self._insert(c, messages)

    def _insert(self, c: _Live, messages: list[dict]) -> None:
        """The tool results or the environment's next message, inserted after the reply; none:
        the conversation ends."""
        if not messages:
            c.done = True
            return
        stop = c.ids[-1] if c.ids and c.ids[-1] in self.procs.tokens.stops else None
        ids = inserted_ids(self.procs, messages, stop)
        if len(c.ids) + len(ids) >= self.budget:  # no room left for a reply
            c.done, c.truncated = True, True
            return
        c.ids += ids
        c.logprobs += [0.0] * len(ids)
        c.versions += c.versions[-1:] * len(ids)  # after a reply of at least its stop token
        c.mask += [0] * len(ids)
        c.routing.append((None, len(ids)))
        c.images += [im for m in messages for im in m.get("images", [])]
        c.turns += [{k: v for k, v in m.items() if k != "images"} for m in messages]

    def _respond(self, c: _Live, raw: str) -> list[dict]:
        """The tool turns of the reply `raw` (its calls, while the episode goes on), else the
        environment's step: its message, its reward kept on the reply's turn."""
        if self.runner is not None and not c.done:
            calls = self.parse(raw)[:self.max_calls]  # rollout.max_tool_calls per reply
            if calls:  # each call's (content, ok) from the runner, in order
                return [{"role": "tool", "content": content, "name": call.name, **({} if ok else {"error": True})}
                        for call in calls for content, ok in [self.runner.run(call)]]
        if self.env is None:
            return []
        msg, reward = self._env(c.problem).step(c.state, c.turns)
        if reward is not None:
            c.turns[-1]["reward"] = envs.turn_reward(self.env_name, reward)
        if msg is None:
            return []
        return [msg if isinstance(msg, dict) else {"role": "user", "content": str(msg)}]

    def env_reward(self, c: _Live) -> float | None:
        """The episode's environment reward from its replies' (envs.episode_reward), if any."""
        if self.env is None:
            return None
        return envs.episode_reward([t["reward"] for t in c.turns if "reward" in t],
                                   self._env(c.problem).args.turn_rewards)

    def _env(self, problem) -> envs.Environment:
        """The environment of `problem`'s source (its own env_args), else the run's."""
        return self.envs.get(getattr(problem, "source", None), self.env)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


def episode_seed(seed: int, group: int) -> int:
    """The environment's reset seed of a call's group `group` (its prompt's G samples share it)."""
    return seed * 100_003 + group


INSERTED_TOKENS = 1024  # an inserted turn's allowance in the derived episode budget


def episode_budget(rc) -> int:
    """`rollout.max_episode_tokens`, or when 0 the bound the turn limits give: max_turns
    replies of max_new_tokens and an inserted turn of INSERTED_TOKENS between each two (a
    longer one ends the episode, truncated)."""
    return rc.max_episode_tokens or rc.max_turns * rc.max_new_tokens + (rc.max_turns - 1) * INSERTED_TOKENS


def _routing(parts: list, many: bool):
    """The calls' routing as one [R, L, k] tensor (`many` turns: int16, -1 rows for inserted
    tokens), or None."""
    ref = next((r for r, _ in parts if r is not None), None)
    if ref is None:
        return None
    import torch
    if not many:
        return parts[0][0] if len(parts) == 1 else torch.cat([r for r, _ in parts])
    return torch.cat([r.to(torch.int16) if r is not None else
                      torch.full((n, *ref.shape[1:]), -1, dtype=torch.int16) for r, n in parts])


def inserted_ids(procs: I.Processors, messages: list[dict], stop: int | None) -> list[int]:
    """The tokens that follow a sampled reply when `messages` (user or tool turns, no images)
    come next: the reply's closing (without the stop token `stop` the reply already ended on),
    the messages, and the next assistant header: what the template renders after an assistant
    turn's content when they follow it (the part before may differ, e.g. a template that drops earlier
    turns' thinking: the model's own tokens are kept as sampled). The template's own text is
    tokenized with its special tokens, each message's content by :func:`encode_turn_text` (as
    text). ValueError when the template loses the reply's content or a message's."""
    texts: list[str] = []  # every message's text, in order, each rendered as a placeholder
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _REPLY}]
    after = procs.tokenizer.apply_chat_template(base + [_held(m, texts) for m in messages],
                                                chat_template=procs.chat.template, tokenize=False,
                                                add_generation_prompt=True, **I.template_kwargs(procs.chat))
    if _REPLY not in after:
        raise ValueError("the chat template drops an earlier assistant turn's content: multi-turn "
                         "rollouts cannot insert turns with it")
    rest, ids, tok = after[after.rindex(_REPLY) + len(_REPLY):], [], procs.tokenizer
    for i, text in enumerate(texts):
        if rest.count(_HELD % i) != 1:
            raise ValueError("the chat template does not render an inserted turn's text as it is")
        before, rest = rest.split(_HELD % i)
        ids += tok.encode(before, add_special_tokens=False) + encode_turn_text(tok, text)
    ids += tok.encode(rest, add_special_tokens=False)
    return ids[1:] if stop is not None and ids and ids[0] == stop else ids


def encode_turn_text(tokenizer, text: str) -> list[int]:
    """Tool or environment text as token ids of plain TEXT: a special token's string in it (a
    forged end of turn in a tool result) is split like any other text, never parsed as the
    special token, so inserted text cannot open or close chat turns."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


_HELD = "<<text %d>>"  # an inserted message's text while the template renders around it


def _held(m: dict, texts: list[str]) -> dict:
    """`m` as the template takes it (its role, content, a tool's name) with its text (the
    content, or each text part of it) as placeholders, the text appended to `texts`."""
    def hold(text: str) -> str:
        texts.append(str(text))
        return _HELD % (len(texts) - 1)
    c = m["content"]
    content = ([{**part, "text": hold(part["text"])} if part.get("type") == "text" else part for part in c]
               if isinstance(c, list) else hold(c))
    return {k: content if k == "content" else v for k, v in m.items() if k in ("role", "content", "name")}


def max_sampled_tokens(rc) -> int:
    """The most tokens an episode's engine samples: max_new_tokens per turn, or with an
    environment or tools up to max_turns turns within max_episode_tokens ("seq-mean-token-sum-norm"'s
    constant)."""
    if not (rc.env or rc.tools):
        return rc.max_new_tokens
    return min(rc.max_turns * rc.max_new_tokens, episode_budget(rc))


def turn_metrics(episodes: list) -> dict[str, float]:
    """rollout/turns_mean (the model's turns), rollout/tool_calls_mean and rollout/tool_errors
    (a count) of a step's episodes, and rollout/turn_reward_mean (the mean of the replies'
    environment rewards, where the environment gave any): {} for single-turn ones."""
    if not any(getattr(e, "turns", None) for e in episodes):
        return {}
    roles = [[t["role"] for t in e.turns] for e in episodes]
    out = {"rollout/turns_mean": sum(r.count("assistant") for r in roles) / len(roles),
           "rollout/tool_calls_mean": sum(r.count("tool") for r in roles) / len(roles),
           "rollout/tool_errors": float(sum(bool(t.get("error")) for e in episodes for t in e.turns))}
    graded = [t["reward"] for e in episodes for t in e.turns if "reward" in t]
    if graded:
        out["rollout/turn_reward_mean"] = sum(graded) / len(graded)
    return out
