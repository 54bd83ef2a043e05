"""bench/vs_trl.py: the shared work is what it claims (same prompt tokens, 4 image tokens, flags
the trainer accepts) and the summary arithmetic. TRL itself is not needed here."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "bench"))  # after the core: bench/sync.py must not shadow sync.py (a spawned vLLM process inherits sys.path)

import vs_trl as V  # noqa: E402


def rows(rewards, step_s=1.0, gen_s=0.25, tokens=256.0):
    return [{"step": i, "step_s": step_s, "generate_s": gen_s, "reward": r,
             "completion_tokens": tokens} for i, r in enumerate(rewards)]


def test_first_reaching_and_median_count_never_as_latest():
    assert V.first_reaching(rows([0.1, 0.49, 0.5, 0.2]), 0.5) == 2
    assert V.first_reaching(rows([0.1, 0.2]), 0.5) is None
    assert V.median_or_none([3, 5, None]) == 5
    assert V.median_or_none([3, None, None]) is None
    assert V.median_or_none([2, 4]) == 3


def test_summarise_pools_after_warmup_and_ratios():
    a = rows([0.0, 0.6, 0.7], step_s=2.0)
    a[0]["step_s"] = 100.0  # warm-up: must not count
    b = rows([0.0, 0.1, 0.9], step_s=1.0, gen_s=0.5, tokens=128.0)
    s = V.summarise([a, b], [10.0, 12.0], warmup=1, threshold=0.5)
    assert s["step_s"] == 1.5 and s["steps_pooled"] == 4
    assert s["completion_tokens_per_s"] == round((2 * 256 + 2 * 128) / (2 * 2.0 + 2 * 1.0), 1)
    assert s["reward_0.5_step_per_run"] == [1, 2] and s["reward_0.5_step"] == 1.5
    assert s["response_len_mean"] == round((2 * 256 + 2 * 128) / 4 / 16, 2)
    t = V.summarise([rows([0.0, 0.0, 0.0], step_s=3.0)], [5.0], warmup=1, threshold=0.5)
    r = V.ratios(s, t, 0.5)
    assert r["step_s"] == 0.5 and r["reward_0.5_step"] is None
    with pytest.raises(ValueError, match="warm-up"):
        V.summarise([a], [1.0], warmup=3, threshold=0.5)


def test_trl_pins_are_exact_and_include_trl():
    pins = V.trl_pins()
    assert "trl==1.16.0" in pins and all("==" in p for p in pins)


def test_our_commands_are_valid_trainer_flags(tmp_path):
    import config as C
    (tmp_path / "m").mkdir()
    (tmp_path / "d").mkdir()
    one = V.ours_cmd(1, tmp_path / "m", tmp_path / "d", tmp_path / "o", 7, 3)
    three = V.ours_cmd(3, tmp_path / "m", tmp_path / "d", tmp_path / "o", 7, 3)
    assert one[0] == sys.executable and one[1].endswith("train.py")
    assert Path(three[0]).name == "torchrun" and "--nproc_per_node=3" in three
    assert "--rollout.max_staleness=1" in three and "--loss.tis_cap=2.0" in three
    for cmd in (one, three):
        i = cmd.index("--config")
        cfg = C.load([cmd[i + 1]], [x for x in cmd[i + 2:]])  # unknown keys would raise
        assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size) == (4, 4)
        assert cfg.rollout.max_new_tokens == 16 and cfg.train.lr == 2e-3
        assert cfg.model.min_pixels == cfg.model.max_pixels == 56 * 56
        assert cfg.reward.functions == [{"name": "target_fraction", "weight": 1.0, "target": "a"}]
    assert cfg.rollout.max_staleness == 1 and cfg.loss.tis_cap == 2.0


def test_model_and_data_give_trl_the_projects_prompt(tmp_path):
    """The chat template TRL renders with yields exactly inputs.prompt_ids' tokens, and a 56 x 56
    image is 4 image tokens under the folder's image processor."""
    import data
    import inputs as I
    from transformers import AutoTokenizer

    mdir = V.build_model(tmp_path / "model", seed=0)
    ddir = V.write_data(tmp_path / "data", seed=0)
    assert V.n_params(mdir) == 621_760
    problems, skipped = data.load_split(str(ddir), "train")
    assert len(problems) == 4 and not skipped
    tok = AutoTokenizer.from_pretrained(str(mdir))
    procs = I.load_processors(str(mdir), V.PIXELS, V.PIXELS)
    ip = procs.image_processor
    for p in problems:
        text = data.user_text(p)
        got = tok.apply_chat_template([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": text}]}], add_generation_prompt=True,
            tokenize=True)
        got = list(got["input_ids"] if hasattr(got, "keys") else got)
        assert got == I.prompt_ids(procs, text, 1)
        assert I.n_image_tokens(I.image_inputs(ip, [p.image])["image_grid_thw"]) == [4]
    # building again reuses the folder (the same weights for every run)
    assert V.build_model(tmp_path / "model", seed=0) == mdir
