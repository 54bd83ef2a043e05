"""train.master_dtype: "bfloat16" keeps the policy's parameters and AdamW's state in bf16 (as
AReaL's FSDP engine, areal/engine/fsdp_engine.py:671-754 and areal/utils/fsdp/parallel.py:438-441
at 524d1d90f: the model loaded in actor.dtype, torch AdamW over those parameters, FSDP's
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)); the meaningless combinations are one
config error at load."""
from __future__ import annotations

import pytest
import torch

import trainer as T
from errors import ConfigError
from tests.util import layout_of, run_step
from train import load_config

CPU = torch.device("cpu")
BF16 = ["--train.master_dtype=bfloat16", "--model.dtype=bfloat16", "--rollout.max_new_tokens=10",
        "--train.lr=1e-2"]


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def test_bfloat16_masters_keep_parameters_and_adamw_state_in_bf16(one_rank_world, tiny_step):
    cfg = load_config(None, BF16)
    tr = T.build(tiny_step.path, one_rank_world, CPU, cfg, layout_of(cfg.train, tiny_step.procs))
    before = {n: _local(p).detach().clone() for n, p in tr.policy.named_parameters()}
    assert before and all(t.dtype == torch.bfloat16 for t in before.values())
    # buffers (rotary tables) stay float32, as transformers' own bf16 loading keeps them
    assert any(b.dtype == torch.float32 for b in tr.policy.buffers())
    metrics, _ = run_step(tiny_step, tr, cfg)
    assert metrics["train/skipped"] == 0 and metrics["grad_norm"] > 0
    params = dict(tr.policy.named_parameters())
    assert all(_local(p).dtype == torch.bfloat16 for p in params.values())
    moved = sum(not torch.equal(_local(params[n]).detach(), t) for n, t in before.items())
    assert moved > len(before) // 2   # the update landed in the bf16 parameters
    state = [s for s in tr.opt.state.values() if s]
    assert state and all(_local(s[k]).dtype == torch.bfloat16 for s in state for k in ("exp_avg", "exp_avg_sq"))
    assert T.parameter_counts(tr)["optimizer_bytes"] == sum(2 * 2 * p.numel() for p in params.values())


def test_float32_masters_are_the_default(one_rank_world, tiny_step):
    cfg = load_config(None, ["--rollout.max_new_tokens=10"])
    assert cfg.train.master_dtype == "float32"
    tr = T.build(tiny_step.path, one_rank_world, CPU, cfg, layout_of(cfg.train, tiny_step.procs))
    run_step(tiny_step, tr, cfg)
    assert all(_local(p).dtype == torch.float32 for p in tr.policy.parameters())
    assert all(_local(s["exp_avg"]).dtype == torch.float32 for s in tr.opt.state.values() if s)


@pytest.mark.parametrize("over, msg", [
    (["--train.master_dtype=bf16"], "train.master_dtype: unknown 'bf16'"),
    (["--train.master_dtype=bfloat16"], "needs model.dtype = \"bfloat16\""),
    (BF16[:2] + ["--model.mixed_precision=true"], "with model.mixed_precision = true"),
    (BF16[:2] + ["--model.lora_rank=4"], "with LoRA"),
])
def test_meaningless_combinations_are_refused_at_load(over, msg):
    with pytest.raises(ConfigError, match=msg.replace(".", r"\.")) as e:
        load_config(None, over)
    assert "\n" not in str(e.value)


def test_the_reference_copy_follows_the_master_dtype(one_rank_world, tiny_step):
    cfg = load_config(None, [*BF16, "--loss.kl_coef=0.1"])
    tr = T.build(tiny_step.path, one_rank_world, CPU, cfg, layout_of(cfg.train, tiny_step.procs))
    assert tr.ref is not None and all(_local(p).dtype == torch.bfloat16 for p in tr.ref.parameters())
    metrics, _ = run_step(tiny_step, tr, cfg)
    assert metrics["train/skipped"] == 0 and metrics["kl"] >= 0
