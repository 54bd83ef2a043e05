"""Tests import the project's flat modules from the repository root."""
import os
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GRPO_DEVICE", "cpu")


def pytest_sessionstart(session):
    # the warm train.py server (tests/warm.py) imports on the other core while tests collect;
    # under `-n 2` (pytest-xdist) the controller starts it before its workers (this hook runs
    # before xdist's) and they share it: one server's imports, not one per worker
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    from tests import warm
    warm.start_server(share=bool(getattr(session.config.option, "numprocesses", None)))


def pytest_configure(config):
    # `python -m pytest -q -m "not slow" tests` is the fast tier (measured times: docs/testing.md):
    # torchrun launches, the vLLM engine and anything long are marked slow.
    config.addinivalue_line("markers", "slow: torchrun launches, vLLM, long runs (skipped by -m 'not slow')")
    if getattr(config.option, "numprocesses", None):
        # `-n 2` (pytest-xdist): each module whole on one worker (its shared runs made once), the
        # modules handed out in collection order, which puts the longest first (below)
        if config.option.dist == "load":
            config.option.dist = "loadfile"
        config.option.loadscopereorder = False


# The longest modules of the full suite, longest first (their measured times: docs/testing.md);
# started first, they do not leave one worker running alone at the end.
LONGEST_FIRST = ["test_failures", "test_e2e", "test_family_runs", "test_checkpoint",
                 "test_bench_smoke", "test_async", "test_vllm_e2e", "test_vllm", "test_examples", "test_vllm_tp",
                 "test_researcher", "test_device_check", "test_presets_plan", "test_lora",
                 "test_channel", "test_packing", "test_vllm_async", "test_multiturn", "test_routing"]


def pytest_collection_modifyitems(config, items):
    if "PYTEST_XDIST_WORKER" in os.environ:  # a serial run keeps the files' order
        rank = {m: i for i, m in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(Path(str(item.fspath)).stem, len(rank)))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """`tiny_dir(model_type)`: the folder of that family's tiny random model, built once for the
    whole session (every test of every module shares it; build_tiny is deterministic)."""
    import families as F
    root = tmp_path_factory.mktemp("families")

    def get(model_type: str = "qwen2_5_vl") -> str:
        return str(F.build_tiny(root / model_type, model_type=model_type))
    return get


@pytest.fixture(scope="module")
def gloo_world():
    """A gloo world of one (rank 0 of 1) for the module's tests, as `python train.py` starts it:
    `dist.group.WORLD`, destroyed after the module's last test. A test that needs a group of its
    own (a fresh store, its own variables) starts one itself, in a module that does not use this."""
    import torch.distributed as dist

    from world import free_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_rank_world(gloo_world):
    """world.World of that world of one: one trainer that is also the generation rank (FSDP2 over
    one rank, its control and training groups the whole world)."""
    import world as W
    return W.World(0, 1, 0, (0,), (0,), gloo_world, gloo_world, None)


@pytest.fixture(scope="module")
def tiny_step(gloo_world, tiny_dir, tmp_path_factory):
    """One rollout step for update.train_step in a world of one trainer: the tiny Qwen2.5-VL model
    (`path`, `procs`), 4 synthetic prompts x 4 responses the HF engine sampled (`eps`: at most 10
    tokens, reward = length % 3; their `images`), the trainers' `world` and FSDP2 `mesh` over
    gloo_world, and a scratch folder `tmp`. tests/util.py's make_trainer and run_step take it."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    import data
    import episode as E
    import hf_engine as HF
    import inputs as I
    import synthetic
    path = tiny_dir("qwen2_5_vl")
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    engine = HF.HFEngine(path, torch.float32, procs, torch.device("cpu"))
    problems = synthetic.make_synthetic(4, seed=3)
    prompts = [(I.prompt_ids(procs, data.user_text(p), 1), p.images) for p in problems]
    out = engine.generate(prompts, E.Sampling(n=4, max_new_tokens=10), seed=1)
    eps = [E.Episode(p.index, g, prompts[g][0], c.ids, c.logprobs, float(len(c.ids) % 3), {}, 0,
                     c.truncated) for g, (p, cs) in enumerate(zip(problems, out)) for c in cs]
    world = SimpleNamespace(trainers=[0], trainer_index=0, train_group=gloo_world)
    return SimpleNamespace(path=path, procs=procs, eps=eps, images={p.index: p.images for p in problems},
                           world=world, mesh=DeviceMesh.from_group(gloo_world, "cpu"),
                           tmp=tmp_path_factory.mktemp("ck"))


@pytest.fixture(autouse=True, scope="module")
def _transformers_config_registry():
    """vLLM's ModelConfig registers its own config classes with transformers' AutoConfig for the
    whole process (its Qwen3.5 one lacks the vision config's attribute map, so a later load of a
    Qwen3.5 folder fails: the full suite did, once, with only the order of the modules to blame).
    Each test module gives back the registry it started with."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    saved = dict(CONFIG_MAPPING._extra_content)
    yield
    CONFIG_MAPPING._extra_content.clear()
    CONFIG_MAPPING._extra_content.update(saved)
