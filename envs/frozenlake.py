"""`frozenlake`: a FrozenLake-like grid walk, the example of an environment with keys, a
per-episode state and per-turn rewards (docs/multiturn.md, "Environments").

The board is ``size`` x ``size`` (``[rollout.env_args] size``): the agent starts at the top left
(S), the goal is the bottom right (G), and about ``holes`` of the other cells are holes (H),
drawn from the episode's seed so that a path always exists (a prompt's G samples share a board).
The first user message shows the board; each reply names one move (the last of ``left``,
``right``, ``up``, ``down`` in it counts; a move off the board stays put). Rewards per reply:
``goal_reward`` on reaching G (the episode ends), ``hole_reward`` on falling into a hole (it
ends), ``invalid_reward`` for a reply that names no move, ``step_reward`` otherwise; the
episode's reward is their sum (or the last, ``turn_rewards = "last"``). The state is the board
and the agent's position.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from envs import Environment, register
from registry import Key

MOVES = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
_MOVE = re.compile(r"\b(left|right|up|down)\b", re.IGNORECASE)
RULES = ("Walk on the frozen lake from S to G without falling into a hole (H). You are at A. "
         "Answer with one move: left, right, up or down.")


@dataclass
class Board:
    """One episode's state: the board's holes and the agent's position (row, column)."""
    size: int
    holes: frozenset
    pos: tuple = (0, 0)

    def show(self) -> str:
        goal = (self.size - 1, self.size - 1)
        return "\n".join("".join("A" if (r, c) == self.pos else "G" if (r, c) == goal else
                                 "H" if (r, c) in self.holes else "S" if (r, c) == (0, 0) else "."
                                 for c in range(self.size)) for r in range(self.size))


@register("frozenlake")
class FrozenLake(Environment):
    keys = {"size": Key(4, "[2, 16]"),              # the board's side
            "holes": Key(0.2, "[0, 0.3]"),          # the share of cells (not S or G) that are holes
            "goal_reward": Key(1.0),                # reaching G
            "hole_reward": Key(0.0),                # falling into a hole
            "step_reward": Key(0.0),                # any other move
            "invalid_reward": Key(-0.1)}            # a reply that names no move
    grades = True

    def reset(self, problem, seed: int) -> tuple[Board, str]:
        board = Board(self.args.size, _holes(self.args.size, self.args.holes, random.Random(seed)))
        return board, f"{RULES}\n{board.show()}"

    def step(self, state: Board, conversation: list[dict]) -> tuple[str | None, float]:
        moves = _MOVE.findall(conversation[-1]["content"])
        if not moves:
            return f"No move found: answer left, right, up or down.\n{state.show()}", self.args.invalid_reward
        dr, dc = MOVES[moves[-1].lower()]
        n = state.size
        state.pos = (min(max(state.pos[0] + dr, 0), n - 1), min(max(state.pos[1] + dc, 0), n - 1))
        if state.pos == (n - 1, n - 1):
            return None, self.args.goal_reward
        if state.pos in state.holes:
            return None, self.args.hole_reward
        return state.show(), self.args.step_reward


def _holes(size: int, share: float, rng: random.Random) -> frozenset:
    """round(share x the cells other than S and G) holes, redrawn until G can be reached."""
    cells = [(r, c) for r in range(size) for c in range(size) if (r, c) not in ((0, 0), (size - 1, size - 1))]
    k = round(share * len(cells))
    while True:
        holes = frozenset(rng.sample(cells, k))
        if _reachable(size, holes):
            return holes


def _reachable(size: int, holes: frozenset) -> bool:
    seen, todo = {(0, 0)}, [(0, 0)]
    while todo:
        r, c = todo.pop()
        for dr, dc in MOVES.values():
            nxt = (r + dr, c + dc)
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in holes and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return (size - 1, size - 1) in seen
