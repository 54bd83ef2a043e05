"""registry.py: objectives and response filters with their own [loss] keys, from loss.py or a
plugin module of the user's (loss.plugins), with no edit to config.py or trainer.py."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch

import config as C
import loss as L
import registry
from loss import policy_loss
from tests.util import TINY, loss_inputs, metrics, torchrun
from train import load_config


def test_built_in_objectives_own_their_keys_and_defaults():
    lc = C.LossConfig()
    assert registry.OBJECTIVES["ppo"].params(lc).__dict__ == {"clip_low": 0.2, "clip_high": 0.28,
                                                              "clip_dual": 0.0}
    assert set(registry.OBJECTIVES["gspo"].keys) == set(registry.OBJECTIVES["cispo"].keys) == \
        {"clip_low", "clip_high"}
    cfg = load_config(TINY[1], ["--loss.objective=cispo", "--loss.clip_high=4.0"])
    assert (cfg.loss.clip_low, cfg.loss.clip_high) == (0.2, 4.0)      # default filled, value kept


def test_a_new_objective_is_one_function_with_its_own_key(monkeypatch):
    """The fork's whole change: one registered function with its key beside it. Config loading,
    checking and policy_loss then take it as it is (no edit to config.py);
    tests/test_update.py runs it through update.train_step, and the plugin tests below from a
    module outside the project."""
    monkeypatch.setattr(registry, "OBJECTIVES", dict(registry.OBJECTIVES))   # undone after the test
    monkeypatch.setattr(L, "OBJECTIVES", registry.OBJECTIVES)

    @registry.objective("scaled_reinforce", keys={"pg_scale": registry.Key(1.0, "> 0")})
    def scaled_reinforce(logprobs, old_logprobs, advantages, mask, p):
        ratio = torch.exp(logprobs - old_logprobs)
        return L.Term(-p.pg_scale * ratio * advantages.unsqueeze(-1), ratio,
                      {"tokens_seen": torch.ones_like(ratio)})

    with pytest.raises(C.ConfigError, match="loss.clip_low: a key of objective 'ppo', objective "
                       "'gspo', objective 'cispo', not of the selected objective 'scaled_reinforce'"):
        load_config(TINY[1], ["--loss.objective=scaled_reinforce"])    # tiny.toml sets clip_low
    cfg = load_config(None, ["--loss.objective=scaled_reinforce", "--loss.pg_scale=3"])
    assert cfg.loss.pg_scale == 3.0 and isinstance(cfg.loss.pg_scale, float)
    assert "pg_scale = 3.0" in C.dump_toml(cfg) and "clip_low" not in C.dump_toml(cfg)
    assert load_config(None, ["--loss.objective=scaled_reinforce"]).loss.pg_scale == 1.0
    with pytest.raises(C.ConfigError, match="loss.pg_scale must be > 0"):
        load_config(None, ["--loss.objective=scaled_reinforce", "--loss.pg_scale=-1"])
    with pytest.raises(C.ConfigError, match="loss.pg_scale: a key of objective 'scaled_reinforce'"):
        load_config(None, ["--loss.pg_scale=3"])                      # not the selected objective's
    logp, old, adv, mask = loss_inputs()
    loss, met = policy_loss(logp, logp.detach(), adv, mask, cfg.loss)
    assert loss.item() == pytest.approx(3 * -(3 * 2.0 - 2 * 1.0) / 5, abs=1e-14)
    assert met["tokens_seen"] == 1.0 and L.log_name("tokens_seen") == "train/tokens_seen"
    assert policy_loss(logp, logp.detach(), adv, mask, cfg.loss, pg_scale=1.0)[0].item() == \
        pytest.approx(-(3 * 2.0 - 2 * 1.0) / 5)
    with pytest.raises(TypeError, match="clip_dual"):                 # not a key of this objective
        policy_loss(logp, logp.detach(), adv, mask, cfg.loss, clip_dual=3.0)
    with pytest.raises(ValueError, match="registered twice"):
        registry.objective("ppo")(scaled_reinforce)


PLUGIN = '''
import torch

import loss as L
import registry


@registry.objective("scaled_pg", keys={**L.CLIP, "pg_scale": registry.Key(2.0, "> 0")})
def scaled_pg(logprobs, old_logprobs, advantages, mask, p):
    ratio = torch.exp(logprobs - old_logprobs)
    return L.Term(-p.pg_scale * ratio * advantages.unsqueeze(-1), ratio, {"big_ratio": ratio > 1.5})


@registry.response_filter("short_only", keys={"max_len": registry.Key(12, ">= 1")},
                          needs=("logprobs",))
def short_only(r, p):
    assert len(r.logprobs) == len(r.rewards) == len(r.engine_logprobs)
    assert all(len(a) == len(b) == n for a, b, n in zip(r.logprobs, r.engine_logprobs, r.lengths))
    return torch.tensor([n <= p.max_len for n in r.lengths])
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    path = tmp_path / "plugins" / "my_parts.py"
    path.parent.mkdir()
    path.write_text(PLUGIN)
    monkeypatch.setattr(registry, "OBJECTIVES", dict(registry.OBJECTIVES))
    monkeypatch.setattr(registry, "FILTERS", dict(registry.FILTERS))
    import loss
    monkeypatch.setattr(loss, "OBJECTIVES", registry.OBJECTIVES)
    return path


def test_a_plugin_file_registers_an_objective_and_a_filter_with_their_keys(plugin):
    over = [f'--loss.plugins=["{plugin}"]', "--loss.objective=scaled_pg", '--loss.filters=["short_only"]']
    cfg = load_config(TINY[1], over + ["--loss.max_len=9"])
    assert (cfg.loss.pg_scale, cfg.loss.max_len, cfg.loss.clip_low) == (2.0, 9, 0.2)
    assert "max_len = 9" in C.dump_toml(cfg)
    load_config(TINY[1], over)                                       # loaded once, not twice
    for extra, msg in [(["--loss.max_len=0"], "loss.max_len must be >= 1, got 0"),
                       (["--loss.max_len=1.5"], "loss.max_len: expected int, got 1.5"),
                       (['--loss.filters=["nope"]'], "loss.filters[0]: unknown filter 'nope'")]:
        with pytest.raises(C.ConfigError, match=msg.replace("[", r"\[")):
            load_config(TINY[1], over + extra)


def test_a_plugin_that_cannot_be_imported_is_one_line(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('no\\nway')\n")
    for name, msg in [(str(bad), r"loss.plugins: cannot import '.*broken.py' \(RuntimeError: no way\)"),
                      ("no_such_module_x", "loss.plugins: cannot import 'no_such_module_x'")]:
        with pytest.raises(C.ConfigError, match=msg) as e:
            load_config(TINY[1], [f'--loss.plugins=["{name}"]'])
        assert "\n" not in str(e.value)


def test_a_plugin_that_exits_at_import_is_named_not_the_runs_exit_code(tmp_path):
    """sys.exit(3) in a plugin's import: a ConfigError naming the plugin, not exit code 3 (the
    project's code for non-finite steps) with no message."""
    bad = tmp_path / "quits.py"
    bad.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(C.ConfigError, match=r"loss.plugins: cannot import '.*quits.py' "
                                            r"\(it called sys.exit\(3\) at import\)"):
        load_config(TINY[1], [f'--loss.plugins=["{bad}"]'])


def test_a_filter_declares_what_it_needs():
    with pytest.raises(ValueError, match="unknown needs"):
        registry.response_filter("x", needs=("gradients",))


@pytest.mark.slow
def test_plugin_objective_and_filter_run_through_the_unchanged_trainer(plugin, tmp_path):
    """Three ranks (two trainers): the plugin is imported on every rank; the filter sees every
    response of the step with the proximal logprobs; what it removed and the term's own metric
    reach metrics.jsonl with no list naming them."""
    out = tmp_path / "run"
    torchrun(3, [*TINY, f"--run.out_dir={out}", "--run.steps=2", "--run.log_samples=-1",
                 "--run.keep_last=0", f'--loss.plugins=["{plugin}"]', "--loss.objective=scaled_pg",
                 '--loss.filters=["short_only"]', "--loss.max_len=14"])
    rows = metrics(out)
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    for r in rows:
        lengths = [s["length"] for s in samples if s["step"] == r["step"]]
        assert len(lengths) == 16
        assert r["train/filtered/short_only"] == pytest.approx(sum(n > 14 for n in lengths) / 16)
        assert 0.0 <= r["train/big_ratio"] <= 1.0 and "train/clip_frac_low" not in r
    assert textwrap.dedent(PLUGIN) == plugin.read_text()             # the plugin is outside the project
