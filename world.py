"""The world: which rank trains, which generates, and the process groups between them.

One torchrun world; :func:`split_roles` is the only place that decides roles (`cluster.layout`):

    "by_node":   [ trainer ranks ............ | generation ranks ........ ]   the LAST gen_ranks generate
    "per_node":  node 0 [ trainers | engines ]  node 1 [ trainers | engines ] ...   (ROLL's second layout)
                  FSDP2 over a trainer-only mesh, one inference engine per generation rank

Every other module asks the World (`trainers`, `gens`, `is_trainer`, ...) which rank does what;
trainer rank 0 is world rank 0 in both layouts.

A world of one plays both roles in one process. Every process group is created on every rank,
in the same order (a group created on some ranks only makes the next `new_group` hang on gloo).
"""
from __future__ import annotations

import datetime
import json
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

import config as C
import device as D
import memplan
from errors import ConfigError, NodeConfigError


LAYOUTS = ("by_node", "per_node")


def split_roles(world_size: int, gen_ranks: int, layout: str = "by_node",
                nnodes: int = 1, colocate: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(trainer ranks, generation ranks); a world of one, and every rank with `colocate`
    (`cluster.colocate`), does both. "by_node": the LAST
    `gen_ranks` ranks generate. "per_node": `gen_ranks` spread evenly over the `nnodes` nodes
    (equal nodes of world_size / nnodes ranks), each node's last ones generating. Raises
    ValueError (one line naming the key) when no trainer rank would be left or the spread is
    uneven."""
    if world_size == 1 or colocate:
        return tuple(range(world_size)), tuple(range(world_size))
    if not 1 <= gen_ranks < world_size:
        raise ValueError(f"cluster.gen_ranks={gen_ranks} leaves no trainer rank in a world of "
                         f"{world_size}" if gen_ranks >= world_size else
                         f"cluster.gen_ranks must be >= 1, got {gen_ranks}")
    if layout == "by_node":
        n_train = world_size - gen_ranks
        return tuple(range(n_train)), tuple(range(n_train, world_size))
    if layout != "per_node":
        raise ValueError(f"cluster.layout must be one of {LAYOUTS}, got {layout!r}")
    if world_size % nnodes or gen_ranks % nnodes:
        raise ValueError(f"cluster.layout = \"per_node\": cluster.gen_ranks={gen_ranks} over {nnodes} "
                         f"nodes of a world of {world_size} is not an even spread (every node "
                         "needs the same ranks and the same engines)")
    per, g = world_size // nnodes, gen_ranks // nnodes  # g < per: gen_ranks < world_size
    nodes = [range(n * per, (n + 1) * per) for n in range(nnodes)]
    return (tuple(r for node in nodes for r in node[:per - g]),
            tuple(r for node in nodes for r in node[per - g:]))


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
    sync_group: Any = None   # trainer rank 0 + every generation rank (None in a world of one, colocated)
    own_channel: bool = False  # the engines receive weights over a channel of their own (vLLM)
    colocated: bool = False  # cluster.colocate: every rank trains and owns an engine, time-shared

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


def _trainer_set(trainers) -> range | frozenset:
    """An int n means the first n ranks (the "by_node" split); else the trainer ranks."""
    return range(trainers) if isinstance(trainers, int) else frozenset(trainers)


def local_devices(rank: int, local_rank: int, local_world_size: int, trainers,
                  engine_devices: int = 1) -> list[int]:
    """The devices of this node (indices among those visible to the launcher) that `rank` uses:
    trainers first, one each (device = local rank), then each generation rank's
    `engine_devices` consecutive ones (docs/gpu-npu.md, "Devices"). `trainers`: the trainer
    ranks (an int n: the first n). Both layouts put a node's trainers before its engines."""
    trainers = _trainer_set(trainers)
    if rank in trainers:
        return [local_rank]
    first_rank_here = rank - local_rank
    trainers_here = sum(r in trainers for r in range(first_rank_here, first_rank_here + local_world_size))
    first = trainers_here + (local_rank - trainers_here) * engine_devices
    return list(range(first, first + engine_devices))


def node_devices(first_rank: int, n_local: int, trainers, engine_devices: int = 1) -> int:
    """Devices the node running ranks first_rank .. first_rank + n_local - 1 uses
    (:func:`local_devices`: trainers one each, then engines of `engine_devices`)."""
    return max(local_devices(first_rank + i, i, n_local, trainers, engine_devices)[-1]
               for i in range(n_local)) + 1


def check_node_devices(node: int, first_rank: int, n_local: int, trainers,
                       engine_devices: int, have: int, have_what: str) -> None:
    """ValueError naming the keys when that node's ranks need more devices than it has."""
    need = node_devices(first_rank, n_local, trainers, engine_devices)
    if need <= have:
        return
    ranks = range(first_rank, first_rank + n_local)
    t = sum(r in _trainer_set(trainers) for r in ranks)
    raise ValueError(
        f"node {node} (ranks {ranks[0]}-{ranks[-1]}) needs {need} devices ({t} trainer(s) + "
        f"{n_local - t} engine(s) x rollout.tensor_parallel_size={engine_devices}) but has {have} "
        f"({have_what}); lower cluster.gen_ranks or rollout.tensor_parallel_size, or run fewer "
        f"processes per node (torchrun --nproc_per_node; cluster.nproc_per_node in a dry run)")


def setup(gen_ranks: int, timeout_s: float, backend: str, dev=None,
          engine_devices: int | None = None, claim_engine_devices: bool = False,
          layout: str = "by_node", colocate: bool = False) -> World:
    """Initialise the one process group and every subgroup, on every rank, in the same order.

    With an accelerator `dev`, each rank first checks its node's device count
    (config.NodeConfigError) and claims its devices before any NCCL/HCCL state exists: a rank
    that computes here makes its device current; a generation rank whose engine runs in
    processes of its own (`engine_devices` each; None: an in-process engine) only narrows the
    visible devices and joins with gloo alone (device.world_backend). `claim_engine_devices`
    (`--check-channel`): such a rank claims its engine's first device itself. `layout`:
    `cluster.layout` (:func:`split_roles`). `colocate` (`cluster.colocate`): every rank trains
    and owns an in-process engine on its own device; no sync group (the weights never leave
    the rank) and no engine channel."""
    if "RANK" not in os.environ:  # plain `python train.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, n_local = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", size))
    if layout == "per_node" and size != launched_nodes() * n_local:  # this node differs from the others
        raise NodeConfigError(f"cluster.layout = \"per_node\" needs the same processes on every node: this "
                              f"node runs {n_local} of a world of {size} over {launched_nodes()} nodes")
    trainers, gens = split_roles(size, gen_ranks, layout, launched_nodes(), colocate)
    engine_devices = None if colocate else engine_devices  # the engine is in this process's hands
    kind = dev.kind if dev is not None else "cpu"
    timeout_s, note = D.group_timeout(kind, timeout_s)
    if note and rank == 0:
        print(note, flush=True)
    if kind == "npu":  # HCCL_EXEC_TIMEOUT below the watchdog (timeout_s)
        os.environ.update(D.hccl_env(timeout_s))
    own = engine_devices is not None and rank not in trainers and not claim_engine_devices
    if kind != "cpu":
        try:
            check_node_devices(int(os.environ.get("GROUP_RANK", rank // n_local)),
                               rank - local_rank, n_local, trainers,
                               engine_devices if engine_devices and size > 1 else 1,
                               D.device_count(dev), f"{kind} devices visible here")
        except ValueError as e:
            raise NodeConfigError(str(e)) from None
        mine = local_devices(rank, local_rank, n_local, trainers, engine_devices or 1)
        if own:
            D.narrow_visible(dev, mine)
            backend = D.world_backend(dev, uses_device=False)  # gloo alone: no HCCL/NCCL here
        else:
            D.torch_device(dev, mine[0])
    if one_node():  # nothing of the job needs to be reachable from another machine
        for k, v in D.loopback_env().items():
            os.environ.setdefault(k, v)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, timeout=timeout, **_own_store(size, timeout))
    # Object exchange (episodes, metrics, checksums) always on gloo: CPU objects.
    ctrl = dist.new_group(backend="gloo", timeout=timeout)
    train_group = dist.new_group(list(trainers), timeout=timeout) if size > 1 else dist.group.WORLD
    # An engine with a channel of its own gets only control messages (CPU) over the sync group.
    sync_group = (dist.new_group([0, *gens], timeout=timeout,
                                 backend="gloo" if engine_devices is not None else None)
                  if size > 1 and not colocate else None)
    return World(dist.get_rank(), size, local_rank, trainers, gens, ctrl, train_group, sync_group,
                 own_channel=engine_devices is not None, colocated=colocate)


def rank_plan(world_size: int, gen_ranks: int, nproc_per_node: int,
              engine_devices: int = 1, layout: str = "by_node", colocate: bool = False) -> list[dict]:
    """Every rank's role, node and devices (the dry run prints it; nothing is initialised).
    `engine_devices`: devices each generation rank's engine spans (see :func:`local_devices`);
    `layout`: `cluster.layout` over nodes of `nproc_per_node` ranks; `colocate`: every rank both."""
    trainers, gens = split_roles(world_size, gen_ranks, layout, max(1, world_size // nproc_per_node),
                                 colocate)
    rows = []
    for r in range(world_size):
        local = r % nproc_per_node
        devs = local_devices(r, local, nproc_per_node, trainers,
                             engine_devices if world_size > 1 else 1)
        rows.append({"rank": r, "node": r // nproc_per_node, "local_rank": local,
                     "role": role_of(r, trainers, gens) if world_size > 1 or colocate else "trainer",
                     "device": "{dev}:" + ",".join(map(str, devs))})
    return rows


def plan_rows(world_size: int, gen_ranks: int, nproc_per_node: int, device_kind: str,
              engine_devices: int, own_channel: bool, layout: str = "by_node",
              colocate: bool = False) -> list[dict]:
    """The dry run's lines: one per rank, then one with every group's members (`own_channel`:
    the engines' workers, `engine_devices` each, join their own weight channel; `colocate`:
    every rank trains and generates, its weights going to its own engine in-process)."""
    plan = rank_plan(world_size, gen_ranks, nproc_per_node, engine_devices, layout, colocate)
    for row in plan:
        row["device"] = row["device"].format(dev=device_kind)
    trainers = [r["rank"] for r in plan if "trainer" in r["role"]]  # colocated: "trainer+generation"
    gens = [r["rank"] for r in plan if r["role"] == "generation"]
    groups = {"world (gloo objects, control)": [r["rank"] for r in plan],
              "trainers (FSDP2 mesh)": trainers, "sync (trainer 0 + engines)": [0] + gens}
    if colocate:
        del groups["sync (trainer 0 + engines)"]
        groups["sync"] = "none: each rank loads its own engine in-process (colocated)"
    elif own_channel:
        groups["vLLM weight channel (outside torch's world)"] = (
            ["trainer rank 0"] + [f"rank {g} worker {w}" for g in gens for w in range(engine_devices)])
    return plan + [{"groups": groups}]


def _own_store(size: int, timeout: datetime.timedelta) -> dict:
    """A world of one outside torchrun serves its own store: on the loopback, as torch's would
    not be (its TCPStore binds every interface whatever host it is given; docs/gpu-npu.md,
    "Ports"). Under torchrun the agent serves it ({}: the env:// rendezvous)."""
    if size != 1 or "TORCHELASTIC_RUN_ID" in os.environ:
        return {}
    sock = socket.socket()
    sock.bind(("127.0.0.1", int(os.environ.get("MASTER_PORT", 0))))
    sock.listen()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], 1, True, timeout,
                          master_listen_fd=sock.detach())  # the store owns it from here
    return {"store": store, "rank": 0, "world_size": 1}


def one_node() -> bool:
    """Every rank of the job runs on this node (torchrun's LOCAL_WORLD_SIZE is the WORLD_SIZE;
    a plain `python train.py` is a world of one)."""
    return os.environ.get("LOCAL_WORLD_SIZE", "1") == os.environ.get("WORLD_SIZE", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_size() -> int:
    """The world size torchrun launched (1 for a plain `python train.py`)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_nodes() -> int:
    """The nodes torchrun launched (its GROUP_WORLD_SIZE; else world size / LOCAL_WORLD_SIZE)."""
    if "GROUP_WORLD_SIZE" in os.environ:
        return int(os.environ["GROUP_WORLD_SIZE"])
    return max(1, launched_size() // int(os.environ.get("LOCAL_WORLD_SIZE", launched_size())))


def validate_world(cfg: C.Config, world_size: int, device: str | None = None,
                   dry_run: bool = False) -> None:
    """ConfigError for rules that depend on the launch: the rank split (over cluster.nnodes
    nodes in a dry run, else the nodes torchrun launched), and the device kind (`device`: "cpu",
    "cuda", "npu", "cuda|npu" for a dry run without GRPO_DEVICE; None: not checked). `dry_run`:
    every node of the plan must fit in cluster.devices_per_node devices."""
    c, ro = cfg.cluster, cfg.rollout
    try:
        trainers, gens = split_roles(world_size, c.gen_ranks, c.layout,
                                     c.nnodes if dry_run else launched_nodes(), c.colocate)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for kind in (device or "").split("|"):
        refusal = D.packing_refusal(kind, cfg.train.packing, cfg.model.mixed_precision) if kind else ""
        if refusal:
            raise ConfigError(refusal)
    n_train, n_gen = len(trainers), len(gens)
    if ro.max_staleness and c.colocate:
        raise ConfigError(f"rollout.max_staleness={ro.max_staleness} with cluster.colocate: engines "
                          "cannot run ahead on devices they time-share with the trainers; set 0")
    if ro.max_staleness and world_size == 1:
        raise ConfigError(f"rollout.max_staleness={ro.max_staleness} needs separate generation "
                          "ranks (a world of 1 cannot overlap generation with training)")
    if device not in (None, "cpu") and ro.engine == "vllm" and world_size == 1 and not c.colocate:
        raise ConfigError(f"rollout.engine='vllm' in a world of 1 on {device}: trainer and engine "
                          "would share one device (NCCL/HCCL refuse that; vLLM takes "
                          "rollout.gpu_memory_utilization of it); set cluster.colocate = true, launch "
                          "2+ ranks or use engine 'hf'")
    if dry_run and device not in (None, "cpu") and world_size > 1:
        per = c.nproc_per_node
        for node in range(world_size // per):
            try:  # tensor_parallel_size > 1 is vLLM's alone (validate), so it is the engine's span
                check_node_devices(node, node * per, per, trainers,
                                   1 if c.colocate else ro.tensor_parallel_size,
                                   c.devices_per_node, "cluster.devices_per_node")
            except ValueError as e:
                raise ConfigError(str(e)) from None
    if device == "npu":
        try:
            D.hccl_env(c.timeout_s)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if ro.prompts_per_step % n_gen:
        raise ConfigError(f"rollout.prompts_per_step={ro.prompts_per_step} must divide evenly over "
                          f"{n_gen} generation ranks")
    n = ro.prompts_per_step * ro.group_size
    if n % n_train:
        raise ConfigError(f"rollout.prompts_per_step * rollout.group_size = {n} must divide evenly "
                          f"over {n_train} trainer ranks")
    mb = cfg.train.mini_batches
    if n % (n_train * mb):
        raise ConfigError(f"train.mini_batches={mb}: the {n} episodes of a step must split into "
                          f"{mb} mini-batches of equal shares over {n_train} trainer ranks "
                          f"({n} % ({n_train} x {mb}) != 0)")


def dry_run(cfg: C.Config, own_channel: bool, config=None) -> int:
    """`train.py --dry-run`: the resolved config, one JSON line per rank, one with every
    group's members (`own_channel`: the engine's, episode.Engine.OWN_CHANNEL), then the memory
    plan (memplan.py; `config`: the model's, None where not read yet; a plan that cannot fit:
    ConfigError); nothing is initialised."""
    print(C.dump_toml(cfg))
    c, n = cfg.cluster, cfg.cluster.nnodes * cfg.cluster.nproc_per_node
    validate_world(cfg, n, D.planned_kind(), dry_run=True)
    for row in plan_rows(n, c.gen_ranks, c.nproc_per_node, D.planned_kind(),
                         cfg.rollout.tensor_parallel_size, own_channel and not c.colocate,
                         c.layout, c.colocate):
        print(json.dumps(row))
    trainers, _ = split_roles(n, c.gen_ranks, c.layout, c.nnodes, c.colocate)
    for line in memplan.plan_lines(cfg, len(trainers), config):
        print(line)
    return 0
