"""registry.py: objectives and response filters with their own [loss] keys, from loss.py or a
plugin module of the user's (loss.plugins), with no edit to config.py or trainer.py."""
from __future__ import annotations

import json
import textwrap

import pytest

import config as C
import registry
from tests.util import TINY, metrics, torchrun
from train import load_config

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
