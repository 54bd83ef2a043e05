"""Bad input named in one line before anything is built: command-line flags without a value or
pointing nowhere, a dataset path that does not exist, a non-UTF-8 dataset row, a non-finite
reward weight; and a NaN reward never reaches the loss."""
from __future__ import annotations

import math
import signal

import pytest
import torch

import config as C
import data
import loss as L
import rewards
import synthetic
import train
from tests.util import ROOT, TINY, train_py


@pytest.fixture
def main(capsys):
    """train.main in this process, for errors found while parsing (before any process group);
    its signal handlers are put back afterwards. Returns (exit code, stderr)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def call(*args: str) -> tuple[int, str]:
        code = train.main(list(args))
        return code, capsys.readouterr().err
    yield call
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.mark.parametrize("args, line", [
    (["--config"], "config error: --config needs a value (see --help)"),
    ([*TINY, "--dry-run", "--resume"], "config error: --resume needs a value (see --help)"),
    ([*TINY, "--resume", "--dry-run"], "config error: --resume needs a value (see --help)"),
    ([*TINY, "--dry-run", "--resume="], "config error: --resume needs a value (see --help)"),
    ([*TINY, "--dry-run", "--eval-only", "--checkpoint"],
     "config error: --checkpoint needs a value (see --help)"),
])
def test_flag_without_a_value_is_one_line_exit_2(main, args, line):
    code, err = main(*args)
    assert (code, err) == (2, line + "\n")


def test_config_that_is_a_folder_or_not_text_is_one_line_exit_2(main, tmp_path):
    code, err = main("--config", str(tmp_path), "--dry-run")
    assert (code, err) == (2, f"config error: --config: {tmp_path} is a folder, not a TOML file\n")
    (tmp_path / "x.toml").write_bytes(b"\xff\xfe[run]\n")
    code, err = main("--config", str(tmp_path / "x.toml"), "--dry-run")
    assert (code, err) == (2, f"config error: --config: cannot read {tmp_path / 'x.toml'} "
                              "(UnicodeDecodeError)\n")


@pytest.mark.parametrize("source", ["no_such_dataset", "tests/no_such_dataset", "a/b/c",
                                    "./no_such_dataset", "data/nope", "datasets/g3k",
                                    "mine/train.jsonl"])
def test_relative_data_source_that_does_not_exist_is_named(main, monkeypatch, source):
    """Not sent to the hub as a repo id (which said `pip install datasets`): a bare name, a path
    under an existing local folder, more than owner/name, ./..., an owner/name that looks like
    a path (`data/nope` where no data/ exists, a file name)."""
    monkeypatch.chdir(ROOT)
    code, err = main(*TINY, "--dry-run", f"--data.source={source}")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"config error: data.source: {source} is not a dataset folder: no such "
                          f"folder (relative to {ROOT})")


def test_hub_ids_and_local_folders_are_still_sources(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert data.source_problem("hiyouga/geometry3k") is None      # owner/name: the hub
    assert data.source_problem("synthetic") is None
    (tmp_path / "g3k").mkdir()
    assert data.source_problem("g3k") is None                     # a local folder, relative
    (tmp_path / "file").write_text("x")
    assert "not a dataset folder" in data.source_problem("file")


@pytest.mark.slow
@pytest.mark.parametrize("flags, line", [
    (["--resume", "{tmp}/nope"], "config error: --resume: no such checkpoint folder {tmp}/nope"),
    (["--eval-only", "--checkpoint", "{tmp}/nope"], "config error: --checkpoint: no such folder {tmp}/nope"),
])
def test_missing_checkpoint_paths_stop_before_any_model_is_built(tmp_path, flags, line):
    out = tmp_path / "run"
    p = train_py([*TINY, f"--run.out_dir={out}", *[f.format(tmp=tmp_path) for f in flags]],
                 timeout=120)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr == line.format(tmp=tmp_path) + "\n"
    assert not (out / "tiny-model").exists() and not (out / "config.toml").exists()


def test_non_utf8_jsonl_row_is_skipped_and_counted(tmp_path):
    synthetic.write_synthetic(tmp_path, 4, 2, 2, seed=3)
    path = tmp_path / "train.jsonl"
    lines = path.read_bytes().split(b"\n")
    lines[1] = lines[1].replace(b"Find", b"Fi\xffnd", 1)   # one byte that is not UTF-8
    assert lines[1] != path.read_bytes().split(b"\n")[1]
    path.write_bytes(b"\n".join(lines))
    rows, skipped = data.load_split(str(tmp_path), "train")
    assert [p.index for p in rows] == [0, 2, 3]
    assert len(skipped) == 1 and skipped[0][0] == 1
    assert skipped[0][1].startswith("train.jsonl:2: not UTF-8 (byte 0xff at column ")
    # the same through the trainer's loader: counted with every other skipped row
    probs, n_skipped = data.load_problems(str(tmp_path), "train", seed=0, n_synthetic=0,
                                          image_size=112, prompt_len=lambda p: 1, max_prompt_len=9)
    assert len(probs) == 3 and n_skipped == 1


def test_unicode_line_separator_inside_a_jsonl_string_stays_in_its_row(tmp_path):
    synthetic.write_synthetic(tmp_path, 2, 1, 1, seed=3)
    path = tmp_path / "train.jsonl"
    text = path.read_text(encoding="utf-8").replace("Find", "Fi\u2028nd", 1)
    path.write_bytes(text.encode("utf-8"))   # raw U+2028, as json.dumps(ensure_ascii=False) writes
    rows, skipped = data.load_split(str(tmp_path), "train")
    assert len(rows) == 2 and not skipped and "\u2028" in rows[0].problem + rows[1].problem


@pytest.mark.parametrize("weight", ["nan", "inf", "-inf", '"1"'])
def test_reward_weight_must_be_a_finite_number(weight):
    with pytest.raises(C.ConfigError, match=r"reward.functions\[0\].weight must be a finite number"):
        C.load(TINY[1], [f'--reward.functions=[{{name="geometry", weight={weight}}}]'])


@rewards.register("_test_nan_reward")
def _nan_reward(response, sample):
    return {"reward": float("nan")}


def test_nan_reward_is_an_error_and_never_reaches_the_loss():
    """Item 4 of the fault campaign: a NaN reward scores 0 and counts in reward/errors, so a
    group's advantages stay finite (the step is not skipped, the loss is not blamed)."""
    runner = rewards.RewardRunner([{"name": "_test_nan_reward", "weight": 1.0},
                                   {"name": "target_fraction", "weight": 1.0, "target": "a"}], 2.0)
    out = runner.score(["aab", "bbb", "aaa", "abb"], [{"response_len": 3}] * 4)
    runner.close()
    assert [o["errors"] for o in out] == [1.0] * 4
    r = torch.tensor([o["reward"] for o in out])
    assert all(math.isfinite(x) for x in r.tolist())
    adv = L.group_advantages(r, group_size=4)
    assert torch.isfinite(adv).all() and adv.abs().sum() > 0
