"""On-policy distillation (loss.distill_coef, model.teacher_path): the config's rules, the teacher
checked against the policy at start, the per-token advantages and train/distill_kl through
update.train_step, and the 3-rank demo learning from a teacher alone. (loss.distill_advantages
against slime's rule on the same tensors: tests/test_loss.py.)"""
from __future__ import annotations

import shutil

import pytest
import torch

import families as F
import loss as L
import trainer as T
from errors import ConfigError
from tests.util import TINY_TEXT, make_trainer, metrics, run_inline, run_step, step_config, torchrun
from train import load_config


@pytest.mark.parametrize("over, match", [
    (["--loss.distill_coef=1"], "go together"),
    (["--model.teacher_path=tiny-qwen3"], "go together"),
    (["--model.teacher_path=base", "--loss.distill_coef=1"], "LoRA"),
    (["--reward.functions=[]"], "reward.functions: at least one"),
    (["--model.teacher_path=tiny-nosuch", "--loss.distill_coef=1"], "model.teacher_path=tiny-nosuch"),
    (["--model.teacher_path=/no/such/teacher", "--loss.distill_coef=1"], "model.teacher_path: no such folder"),
])
def test_the_keys_go_together_and_a_bad_teacher_is_one_line(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY_TEXT[1], over)


def test_reward_free_distillation_needs_no_reward_function():
    cfg = load_config(TINY_TEXT[1], ["--model.teacher_path=tiny-qwen3", "--loss.distill_coef=1",
                                     "--reward.functions=[]"])
    assert cfg.reward.functions == [] and cfg.eval.functions  # evaluation still grades


def test_a_teacher_of_another_tokenizer_or_without_eyes_is_refused_at_start(tiny_dir, tmp_path):
    vl, text = tiny_dir("qwen2_5_vl"), tiny_dir("qwen3")
    other = tmp_path / "other"
    shutil.copytree(text, other)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<an-extra-token>"])
    tok.save_pretrained(other)

    def cfg(policy_path: str, teacher: str):
        return load_config(TINY_TEXT[1], [f"--model.path={policy_path}", f"--model.teacher_path={teacher}",
                                          "--loss.distill_coef=1", f"--run.out_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="tokenizer differs"):
        T.check_teacher(cfg(text, str(other)), text)
    with pytest.raises(ConfigError, match="text-only teacher"):
        T.check_teacher(cfg(vl, text), vl)
    T.check_teacher(cfg(text, tiny_dir("qwen3_moe")), text)  # another family, the same tokenizer
    assert T.teacher_folder(cfg(text, text), "/the/policy") == "/the/policy"  # model.path's own value


def _with_teacher(s, cfg, noise: float):
    """A trainer for tiny_step `s` whose teacher is the policy's weights plus seeded noise."""
    import model as M
    import sharding
    tr = make_trainer(s, cfg)
    teacher = M.load_model(s.path)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    tr.teacher = sharding.apply_fsdp(teacher.eval(), s.mesh)
    tr.teacher.requires_grad_(False)
    return tr


@pytest.mark.parametrize("mini_batches", [1, 2])  # 2: the teacher's logprobs from the proximal pass
def test_distill_kl_is_the_mean_reverse_kl_and_zero_for_the_policy_itself(tiny_step, mini_batches):
    import inputs as I
    import model as M
    over = ["--model.teacher_path=tiny", "--loss.distill_coef=0.5", f"--train.mini_batches={mini_batches}"]
    cfg = step_config(over)
    got, _ = run_step(tiny_step, _with_teacher(tiny_step, cfg, 0.0), cfg)
    assert got["train/distill_kl"] == 0.0                 # teacher = the policy: nothing to learn
    tr = _with_teacher(tiny_step, cfg, 0.05)
    want_num = want_den = 0.0  # the same reverse KL by hand, before the update changes the policy
    with torch.no_grad():
        for e in tiny_step.eps:
            batch = I.collate([e], [tiny_step.images[e.index]], tiny_step.procs, torch.device("cpu"))
            lp = M.sequence_logprobs(tr.policy, batch, tiny_step.procs.tokens, cfg.rollout.temperature)[0]
            te = T.teacher_logprobs(tr, batch, tiny_step.procs.tokens, cfg.rollout.temperature)
            m = batch.response_mask.float()
            want_num, want_den = want_num + float(((lp - te) * m).sum()), want_den + float(m.sum())
    got, _ = run_step(tiny_step, tr, cfg)
    if mini_batches == 1:  # with two, the second update's KL is measured after the first step
        assert got["train/distill_kl"] == pytest.approx(want_num / want_den, rel=1e-5)
    assert got["train/distill_kl"] > 0 and got["grad_norm"] > 0


@pytest.mark.slow
def test_the_demo_learns_from_a_teacher_alone_on_three_ranks(tmp_path):
    """Reward-free distillation (no reward function) of the text demo towards a tiny Qwen3 of
    another seed, 30 steps on 3 ranks: the per-token reverse KL falls; with the policy's own
    initial weights as the teacher the term is 0 at step 1."""
    teacher = F.build_tiny(tmp_path / "teacher", seed=7, model_type="qwen3")
    out = tmp_path / "run"
    torchrun(3, [*TINY_TEXT, "--run.steps=30", f"--run.out_dir={out}", f"--model.teacher_path={teacher}",
                 "--loss.distill_coef=1.0", "--reward.functions=[]", "--run.keep_last=0"])
    kl = [r["train/distill_kl"] for r in metrics(out)]
    assert len(kl) == 30 and all(r["reward/mean"] == 0.0 for r in metrics(out))
    assert sum(kl[-5:]) / 5 < 0.6 * sum(kl[:5]) / 5, kl   # measured: 0.38 -> 0.09 in a world of one
    self_out = tmp_path / "self"
    run_inline([[*TINY_TEXT, "--run.steps=1", f"--run.out_dir={self_out}", "--model.teacher_path=tiny-qwen3",
                 "--loss.distill_coef=1.0", "--run.keep_last=0"]])
    assert metrics(self_out)[0]["train/distill_kl"] == 0.0
