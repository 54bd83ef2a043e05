"""Bad input named in one line before anything is built: command-line flags without a value or
pointing nowhere, a dataset path that does not exist, a non-UTF-8 dataset row, a non-finite
reward weight; and a NaN reward never reaches the loss."""
from __future__ import annotations

import math
from pathlib import Path
import signal

import pytest
import torch

import config as C
import resume_rules
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


# ------------------------------------------------- runs that would train on the wrong thing, and
# unclear messages (one line naming the culprit, exit 2, nothing trained before the refusal)
def _model_copy(tiny_dir, tmp_path, model_type: str = "qwen2_5_vl") -> Path:
    import shutil
    dst = tmp_path / model_type
    shutil.copytree(tiny_dir(model_type), dst)
    return dst


def _refused(tmp_path, *args: str) -> str:
    out = tmp_path / "run"
    p = train_py([*TINY, f"--run.out_dir={out}", "--run.steps=2", *args])
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith(("error:", "config error:"))]
    assert p.returncode == 2 and len(lines) == 1, (p.returncode, p.stderr[-3000:])
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()
    return lines[0]


NO_GENERATION_PROMPT = ("{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' -}}"
                        "{%- if m['content'] is string -%}{{- m['content'] -}}{%- else -%}"
                        "{%- for c in m['content'] -%}{%- if c['type'] == 'image' -%}"
                        "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}{%- else -%}"
                        "{{- c['text'] -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
                        "{{- '<|im_end|>\\n' -}}{%- endfor -%}")


@pytest.mark.slow
def test_a_template_that_ignores_add_generation_prompt_is_refused(tiny_dir, tmp_path):
    folder = _model_copy(tiny_dir, tmp_path)
    (folder / "chat_template.jinja").write_text(NO_GENERATION_PROMPT)
    line = _refused(tmp_path, f"--model.path={folder}")
    assert line == (f"config error: model.path={folder}: its chat template (chat_template.jinja) "
                    "ignores add_generation_prompt: every prompt would lack the assistant header; "
                    "use a template that opens the assistant turn"), line


@pytest.mark.slow
def test_enable_thinking_on_a_template_without_the_switch_is_refused(tmp_path):
    line = _refused(tmp_path, "--data.enable_thinking=false")
    assert "data.enable_thinking=false: the chat template of model.path=" in line
    assert line.endswith("takes no enable_thinking (it would be ignored); unset it"), line


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3"])
def test_a_folder_without_tokenizer_files_is_named(tiny_dir, tmp_path, model_type):
    folder = _model_copy(tiny_dir, tmp_path, model_type)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).unlink()
    extra = [] if model_type == "qwen2_5_vl" else ["--data.images_column="]
    line = _refused(tmp_path, f"--model.path={folder}", *extra)
    assert line == (f"config error: model.path={folder}: no tokenizer (looked for tokenizer.json, "
                    "tokenizer_config.json, vocab.json, tokenizer.model)"), line


@pytest.mark.slow
def test_a_lora_rank_above_the_smallest_adapted_dimension_is_refused(tmp_path):
    line = _refused(tmp_path, "--model.lora_rank=33")  # the tiny k_proj: 64 -> 32
    assert line == ("config error: model.lora_rank=33 is above the smallest adapted dimension, 32 "
                    "(model.language_model.layers.0.self_attn.k_proj): an adapter cannot have a "
                    "higher rank than its layer; use model.lora_rank <= 32"), line


@pytest.mark.slow
def test_qwen3_5_on_the_cpu_vllm_build_is_named_before_the_engine_starts(tmp_path):
    line = _refused(tmp_path, "--model.path=tiny-qwen3_5", "--rollout.engine=vllm",
                    "--train.share_prompt=false")
    assert line.endswith("Qwen3.5 is not served by this vLLM build on cpu (its linear-attention "
                         "kernels fail to load there); use rollout.engine = 'hf' here"), line


@pytest.mark.slow
def test_an_allowed_but_incompatible_resume_names_the_key_not_damage(tmp_path):
    out = tmp_path / "run"
    p = train_py([*TINY, f"--run.out_dir={out}", "--run.steps=2", "--model.lora_rank=8"])
    assert p.returncode == 0, p.stderr[-3000:]
    p = train_py([*TINY, f"--run.out_dir={out}", "--run.steps=4", "--model.lora_rank=4",
                  "--run.allow_config_change=true"])
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert "is incompatible with this config: model.lora_rank 8 -> 4 (" in lines[0], lines
    assert "damaged" not in lines[0] and lines[0].endswith(
        "resume without that change, or use another run.out_dir"), lines


def _perturb_one_tensor(folder: Path) -> str:
    from safetensors.torch import load_file, save_file
    f = folder / "model.safetensors"
    sd = load_file(str(f))
    name = sorted(k for k in sd if k.endswith("mlp.up_proj.weight"))[0]
    sd[name] = sd[name] + 0.01
    save_file(sd, str(f), metadata={"format": "pt"})
    return name


def test_the_base_fingerprint_sees_one_changed_tensor(tiny_dir, tmp_path):
    import checkpoint as ckpt
    a = _model_copy(tiny_dir, tmp_path)
    before = resume_rules.fingerprint(str(a))
    assert before and before == resume_rules.fingerprint(tiny_dir("qwen2_5_vl"))
    _perturb_one_tensor(a)
    assert resume_rules.fingerprint(str(a)) != before
    assert resume_rules.fingerprint(str(tmp_path)) == ""  # no safetensors: nothing to compare


@pytest.mark.slow
def test_a_lora_resume_on_a_changed_base_stops_unless_allowed(tiny_dir, tmp_path):
    base = _model_copy(tiny_dir, tmp_path)
    out = tmp_path / "run"
    common = [*TINY, f"--model.path={base}", "--model.lora_rank=8", f"--run.out_dir={out}"]
    assert train_py([*common, "--run.steps=2"]).returncode == 0
    _perturb_one_tensor(base)
    p = train_py([*common, "--run.steps=3"])
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("config error:")]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert (f"its base weights were {base} (fingerprint " in lines[0]
            and f"model.path={base} now holds other weights" in lines[0]
            and "--run.allow_new_base=true" in lines[0]), lines
    assert len(metrics_rows(out)) == 2  # nothing trained after the refusal
    p = train_py([*common, "--run.steps=3", "--run.allow_new_base=true"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(metrics_rows(out)) == 3


def metrics_rows(out: Path) -> list:
    return (out / "metrics.jsonl").read_text().splitlines()


SWANLAB_FULL = """
import errno, os, sys
sys.path.insert(0, {root!r})
os.environ["SWANLAB_MODE"] = "offline"
import trackers
import tracking as T
from swanlab.log.backup import datastore
tr = trackers.Trackers.open(["swanlab"], __import__("pathlib").Path({out!r}), {{"run": {{}}}})
tr.log({{"reward/mean": 0.5}}, 0)
def full(self, *a, **k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
datastore.DataStore._write_record = full   # its folder fills up at the end of the run
tr.close()
print("console still ours"); print("stderr too", file=sys.stderr)
"""


@pytest.mark.slow
def test_a_tracker_failing_at_the_end_is_a_warning_and_the_run_exits_0(tmp_path):
    pytest.importorskip("swanlab")
    import subprocess
    import sys
    code = SWANLAB_FULL.format(root=str(ROOT), out=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "console still ours" in p.stdout and "stderr too" in p.stderr
    assert "warning: tracker swanlab failed at close (close): OSError: [Errno 28]" in p.stderr
