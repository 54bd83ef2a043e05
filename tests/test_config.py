"""Config: TOML + overrides, one-line errors naming the key, resolved config round trip."""
from __future__ import annotations

import re
import tomllib

import pytest

import config as C
from loss import OBJECTIVES
from train import load_config  # config.load + the checks of the modules config.py does not import
import world as W
from tests.util import ROOT

TINY = str(ROOT / "configs" / "tiny.toml")


def test_defaults_toml_and_overrides_precedence(tmp_path):
    cfg = load_config(TINY)
    assert cfg.rollout.group_size == 4 and cfg.run.out_dir == "runs/tiny"
    cfg = load_config(TINY, ["--rollout.group_size=8", "--run.out_dir=/x/y", "--train.lr=1",
                        "--sync.enabled=false", "--model.path=tiny"])
    assert cfg.rollout.group_size == 8 and cfg.run.out_dir == "/x/y"
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)  # int accepted for float
    assert cfg.sync.enabled is False
    assert load_config(None).loss.clip_high == 0.28  # dataclass defaults without a file


def test_list_of_tables_override():
    cfg = load_config(TINY, ['--reward.functions=[{name="target_fraction", weight=2.0}]'])
    assert cfg.reward.functions == [{"name": "target_fraction", "weight": 2.0}]


@pytest.mark.parametrize("override, key", [
    (["--rollout.nope=1"], "rollout.nope"),
    (["--nosection.x=1"], "[nosection]"),
    (["--rollout.group_size=abc"], "rollout.group_size"),
    (["--rollout.group_size=1.5"], "rollout.group_size"),
    (["--sync.enabled=3"], "sync.enabled"),
    (["--rollout.group_size=1"], "rollout.group_size"),
    (["--sync.bucket_mb=0"], "sync.bucket_mb"),
    (["--rollout.engine=sglang"], "rollout.engine"),
    (["--loss.aggregation=mean"], "loss.aggregation"),
    (["--model.min_pixels=20000", "--model.max_pixels=10000"], "model.min_pixels"),
    (["--model.dtype=fp8"], "model.dtype"),
    (["--model.path=/no/such/model"], "model.path"),
    (["--data.source=/no/such/data"], "data.source"),
    (['--reward.functions=[{name="nope"}]'], "reward.functions[0].name"),
    (["--data.template=no placeholder"], "data.template"),
    (["rollout.group_size=3"], "--section.key=value"),
])
def test_bad_values_are_one_line_errors_naming_the_key(override, key):
    with pytest.raises(C.ConfigError) as e:
        load_config(TINY, override)
    msg = str(e.value)
    assert key in msg and "\n" not in msg


def test_unknown_key_in_toml(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[train]\nlearning_rate = 0.1\n")
    with pytest.raises(C.ConfigError, match="train.learning_rate"):
        load_config(str(p))
    p.write_text("[train\n")
    with pytest.raises(C.ConfigError, match="invalid TOML"):
        load_config(str(p))


@pytest.mark.parametrize("world, over, key", [
    (3, ["--cluster.gen_ranks=3"], "cluster.gen_ranks"),
    (4, ["--cluster.gen_ranks=3"], "rollout.prompts_per_step"),  # 4 prompts over 3 engines
    (4, ["--cluster.gen_ranks=1"], "rollout.prompts_per_step * rollout.group_size"),  # 16 over 3
])
def test_world_rules(world, over, key):
    cfg = load_config(TINY, over)
    with pytest.raises(C.ConfigError, match=key.replace("*", r"\*")):
        W.validate_world(cfg, world)


def test_world_of_one_is_valid_whatever_gen_ranks():
    W.validate_world(load_config(TINY, ["--cluster.gen_ranks=5"]), 1)


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = load_config(TINY, ["--run.steps=7", '--data.template=Q: {problem} "quoted" \\boxed{}'])
    text = C.dump_toml(cfg)
    tomllib.loads(text)  # valid TOML
    p = tmp_path / "resolved.toml"
    p.write_text(text)
    assert C.to_dict(load_config(str(p))) == C.to_dict(cfg)


def test_every_numeric_key_declares_its_range():
    import dataclasses
    for sec in dataclasses.fields(C.Config()):
        for f in dataclasses.fields(getattr(C.Config(), sec.name)):
            if f.type in ("int", "float", int, float):
                assert "range" in f.metadata, f"{sec.name}.{f.name} has no range (config.num)"


@pytest.mark.parametrize("override, msg", [
    ("--train.grad_clip=-1", "train.grad_clip must be > 0, got -1.0"),      # reversed the gradient
    ("--train.warmup_steps=-5", "train.warmup_steps must be >= 0, got -5"),  # negative learning rate
    ("--train.beta1=1.5", "train.beta1 must be in [0, 1), got 1.5"),
    ("--data.image_size=0", "data.image_size must be >= 28, got 0"),
    ("--data.n_synthetic=0", "data.n_synthetic must be >= 1, got 0"),
    ("--train.lr=nan", "train.lr must be > 0, got nan"),
    ("--train.lr=inf", "train.lr must be > 0, got inf"),
    ("--rollout.top_p=0", "rollout.top_p must be in (0, 1], got 0.0"),
    ("--cluster.timeout_s=0", "cluster.timeout_s must be > 0"),
    ("--train.weight_decay=-0.1", "train.weight_decay must be >= 0"),
])
def test_numeric_ranges_are_checked_at_load(override, msg):
    with pytest.raises(C.ConfigError) as e:
        load_config(TINY, [override])
    assert str(e.value) == msg or str(e.value).startswith(msg)


def test_in_range_rules():
    assert C.in_range(1, "[0, 1]") and not C.in_range(1, "[0, 1)") and not C.in_range(0, "(0, 1]")
    assert C.in_range(-1, ">= -1") and not C.in_range(-2, ">= -1")
    assert not C.in_range(float("nan"), ">= 0") and not C.in_range(float("inf"), "> 0")


def test_device_aware_world_rules(monkeypatch):
    vllm = load_config(TINY, ["--rollout.engine=vllm"])
    for kind in ("cuda", "npu", "cuda|npu"):
        with pytest.raises(C.ConfigError, match=f"rollout.engine='vllm' in a world of 1 on {kind}"):
            W.validate_world(vllm, 1, kind)
    W.validate_world(vllm, 1, "cpu")   # CPU keeps it (tests, the demo)
    W.validate_world(vllm, 3, "cuda")
    W.validate_world(load_config(TINY), 1, "cuda")  # the hf engine shares the device in-process
    with pytest.raises(C.ConfigError, match="rollout.tensor_parallel_size > 1 needs"):
        load_config(TINY, ["--rollout.tensor_parallel_size=2"])
    load_config(TINY, ["--rollout.tensor_parallel_size=2", "--rollout.engine=vllm"])
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "3600")  # NPU: checked against cluster.timeout_s
    with pytest.raises(C.ConfigError, match="HCCL_EXEC_TIMEOUT=3600 must be in"):
        W.validate_world(vllm, 3, "npu")
    W.validate_world(vllm, 3, "cuda")
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "100")  # tiny.toml: cluster.timeout_s = 120
    W.validate_world(vllm, 3, "npu")


# --------------------------------------------------------------------------- the algorithms' keys
def test_objectives_registry_and_config_rules():
    assert {"ppo", "gspo", "cispo"} <= set(OBJECTIVES)   # the built-ins (plugins add more)
    cfg = load_config(TINY, ["--loss.objective=gspo", "--loss.advantage=rloo", "--loss.kl_clamp=10",
                            "--train.mini_batches=2", "--train.ppo_epochs=3",
                            "--rollout.max_refill_rounds=0"])
    assert (cfg.loss.objective, cfg.loss.advantage, cfg.loss.kl_clamp) == ("gspo", "rloo", 10.0)
    assert (cfg.train.mini_batches, cfg.train.ppo_epochs, cfg.rollout.max_refill_rounds) == (2, 3, 0)
    for over, msg in [("--loss.objective=dpo", "loss.objective: unknown 'dpo'"),
                      ("--loss.advantage=gae", "loss.advantage: unknown 'gae'"),
                      ("--loss.kl_clamp=-1", "loss.kl_clamp must be >= 0"),
                      ("--train.mini_batches=0", "train.mini_batches must be >= 1"),
                      ("--train.ppo_epochs=0", "train.ppo_epochs must be >= 1"),
                      ("--rollout.max_refill_rounds=-1", "rollout.max_refill_rounds must be >= 0")]:
        with pytest.raises(C.ConfigError, match=msg.replace("(", r"\(")):
            load_config(TINY, [over])
    # tiny: 4 prompts x 4 samples = 16 episodes over 2 trainers: 8 mini-batches of 1 per rank
    # work, 3 do not (16 % 6), 16 do not (16 % 32)
    W.validate_world(load_config(TINY, ["--train.mini_batches=8"]), 3)
    for m in (3, 16):
        with pytest.raises(C.ConfigError, match=f"train.mini_batches={m}"):
            W.validate_world(load_config(TINY, [f"--train.mini_batches={m}"]), 3)


def test_kl_and_dual_clip_config_rules():
    for over, msg in [("--loss.clip_dual=1.0", "loss.clip_dual must be > 1"),
                      ("--loss.objective=gspo --loss.clip_dual=3",
                       "loss.clip_dual: a key of objective 'ppo', not of the selected objective 'gspo'"),
                      ("--loss.clip_duall=3", "unknown config key loss.clip_duall"),
                      ("--loss.clip_dual=x", "loss.clip_dual: expected float, got 'x'"),
                      ("--loss.kl_in_reward=true", "loss.kl_in_reward needs loss.kl_coef > 0"),
                      ("--loss.kl_target=0.1", "loss.kl_target needs loss.kl_coef > 0"),
                      ("--train.ref_update_every=4", "train.ref_update_every needs loss.kl_coef"),
                      ("--train.ref_mix_alpha=0", "train.ref_mix_alpha must be in (0, 1]"),
                      ("--loss.entropy_coef=-1", "loss.entropy_coef must be >= 0")]:
        with pytest.raises(C.ConfigError, match=re.escape(msg)):
            load_config(TINY, over.split())
    cfg = load_config(TINY, ["--loss.kl_coef=0.01", "--loss.kl_in_reward=true", "--loss.kl_target=0.1",
                            "--train.ref_update_every=8", "--loss.clip_dual=3",
                            "--loss.entropy_coef=0.001"])
    assert (cfg.loss.kl_horizon, cfg.train.ref_mix_alpha) == (10000, 0.6)


@pytest.mark.parametrize("override, match", [
    ("--cluster.layout=ring", r"cluster.layout: unknown 'ring' \(known: by_node, per_node\)"),
    ("--train.packing=yes", r"train.packing: unknown .yes. \(known: true, false, auto, segments, varlen\)"),
    ("--model.dtype=float16", r"model.dtype: unknown 'float16'"),
    ("--rollout.stale=skip", r"rollout.stale: unknown 'skip' \(known: wait, drop\)"),
])
def test_a_key_with_choices_is_one_line_naming_them(override, match):
    """Keys declared with config.one_of: the value is one of the declared choices, checked at load
    with the others (config.check_ranges)."""
    with pytest.raises(C.ConfigError, match=match):
        C.load(None, [override])
    fields = {f.name: f for sec in __import__("dataclasses").fields(C.Config)
              for f in __import__("dataclasses").fields(sec.type if isinstance(sec.type, type) else getattr(C, sec.type))}
    assert fields["layout"].metadata["choices"] == ("by_node", "per_node")
