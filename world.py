"""The world: which rank trains, which generates, and the process groups between them.

One torchrun world; ranks are split statically by :func:`split_roles` (the only place that
decides roles: setup, the dry-run plan, config validation and the failure messages all ask it):

    world ranks:  [ trainer ranks ............ | generation ranks ........ ]
                    FSDP2 over a trainer-only mesh   one inference engine each

A world of one plays both roles in one process. Every process group is created on every rank,
in the same order (a group created on some ranks only makes the next `new_group` hang on gloo).
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any


def split_roles(world_size: int, gen_ranks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(trainer ranks, generation ranks): the LAST `gen_ranks` ranks generate, the others train;
    a world of one does both. Raises ValueError when no trainer rank would be left."""
    if world_size == 1:
        return (0,), (0,)
    if not 1 <= gen_ranks < world_size:
        raise ValueError(f"cluster.gen_ranks={gen_ranks} leaves no trainer rank in a world of "
                         f"{world_size}" if gen_ranks >= world_size else
                         f"cluster.gen_ranks must be >= 1, got {gen_ranks}")
    n_train = world_size - gen_ranks
    return tuple(range(n_train)), tuple(range(n_train, world_size))


def role_of(rank: int, trainers: tuple[int, ...], gens: tuple[int, ...]) -> str:
    both = rank in trainers and rank in gens
    return "trainer+generation" if both else "trainer" if rank in trainers else "generation"


@dataclass(frozen=True)
class World:
    """This rank's place in the world; built once by :func:`setup`, then passed explicitly."""
    rank: int
    size: int
    local_rank: int
    trainers: tuple[int, ...]
    gens: tuple[int, ...]
    ctrl: Any = None         # gloo group of every rank: episodes, metrics, control objects
    train_group: Any = None  # the trainer ranks: the FSDP2 mesh and the loss reductions
    sync_group: Any = None   # trainer rank 0 + every generation rank (None in a world of one)

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def is_trainer(self) -> bool:
        return self.rank in self.trainers

    @property
    def is_gen(self) -> bool:
        return self.rank in self.gens

    @property
    def gen_index(self) -> int:
        """This rank's position among the generation ranks (-1 if it does not generate)."""
        return self.gens.index(self.rank) if self.is_gen else -1

    @property
    def trainer_index(self) -> int:
        return self.trainers.index(self.rank) if self.is_trainer else -1

    def role(self, rank: int | None = None) -> str:
        return role_of(self.rank if rank is None else rank, self.trainers, self.gens)


def setup(gen_ranks: int, timeout_s: float, backend: str) -> World:
    """Initialise the one process group and every subgroup, on every rank, in the same order."""
    import torch.distributed as dist

    if "RANK" not in os.environ:  # plain `python train.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, timeout=timeout)
    size = dist.get_world_size()
    trainers, gens = split_roles(size, gen_ranks)
    # Object exchange (episodes, metrics, checksums) always on gloo: CPU objects.
    ctrl = dist.new_group(backend="gloo", timeout=timeout)
    train_group = dist.new_group(list(trainers), timeout=timeout) if size > 1 else dist.group.WORLD
    sync_group = dist.new_group([0, *gens], timeout=timeout) if size > 1 else None
    return World(dist.get_rank(), size, int(os.environ.get("LOCAL_RANK", 0)), trainers, gens,
                 ctrl, train_group, sync_group)


def rank_plan(world_size: int, gen_ranks: int, nproc_per_node: int) -> list[dict]:
    """Every rank's role, node and device (the dry run prints it; nothing is initialised)."""
    trainers, gens = split_roles(world_size, gen_ranks)
    return [{"rank": r, "node": r // nproc_per_node, "local_rank": r % nproc_per_node,
             "role": role_of(r, trainers, gens) if world_size > 1 else "trainer",
             "device": f"{{dev}}:{r % nproc_per_node}"} for r in range(world_size)]


def plan_rows(world_size: int, gen_ranks: int, nproc_per_node: int, device_kind: str,
              channel_members: int) -> list[dict]:
    """The dry run's lines: one per rank, then one with every group's members
    (`channel_members` > 0: workers per engine on the engines' own weight channel)."""
    plan = rank_plan(world_size, gen_ranks, nproc_per_node)
    for row in plan:
        row["device"] = row["device"].format(dev=device_kind)
    trainers = [r["rank"] for r in plan if r["role"] == "trainer"]
    gens = [r["rank"] for r in plan if r["role"] == "generation"]
    groups = {"world (gloo objects, control)": [r["rank"] for r in plan],
              "trainers (FSDP2 mesh)": trainers, "sync (trainer 0 + engines)": [0] + gens}
    if channel_members:
        groups["vLLM weight channel (outside torch's world)"] = (
            ["trainer rank 0"] + [f"rank {g} worker {w}" for g in gens for w in range(channel_members)])
    return plan + [{"groups": groups}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_size() -> int:
    """The world size torchrun launched (1 for a plain `python train.py`)."""
    return int(os.environ.get("WORLD_SIZE", "1"))
