"""The seed's table (issue 47): the HF export keeps the hub processor's pixel bounds, and
launch/vlmeval.sh / launch/vlmeval_table.py (commands under --dry-run, the table from
VLMEvalKit's result files)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

import checkpoint as ckpt
import inputs


def test_export_keeps_the_source_processors_pixel_bounds(tiny_dir, tmp_path):
    """The run's model.min/max_pixels (vl3b.toml: 4.19 MP) bound its own images; the export's
    image processor is the source's (Qwen2.5-VL-3B: 12.8 MP), so VLMEvalKit bounds a checkpoint's
    images as it does the base model's."""
    from transformers import AutoModelForImageTextToText
    src = tiny_dir("qwen2_5_vl")
    own = json.loads((Path(src) / "preprocessor_config.json").read_text())
    procs = inputs.load_processors(src, min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    run_size = {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 64}
    assert dict(procs.image_processor.size) == run_size != own["size"]  # what the run resizes with
    model = AutoModelForImageTextToText.from_pretrained(src)
    ckpt.export_hf(tmp_path / "hf", model.state_dict(), model, procs, src, torch.float32)
    out = json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())
    assert out["size"] == own["size"]  # transformers 5 keeps min/max_pixels as this size
    for key in ("min_pixels", "max_pixels"):
        assert out.get(key) == own.get(key)


# ---------------------------------------------------------------- launch/vlmeval_table.py
import os  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from tests.util import ROOT  # noqa: E402

sys.path.insert(0, str(ROOT / "launch"))
import vlmeval_table as VT  # noqa: E402

# VLMEvalKit's score tables (MathVista_acc, MATH_V_acc, evaluate_logicvista), as their columns
HEADS = {"LogicVista": "Task&Skill,tot,hit,acc", "MathVision_MINI": "Subject,tot,prefetch,hit,prefetch_rate,acc",
         "MathVista_MINI": "Task&Skill,tot,prefetch,hit,prefetch_rate,acc"}
JUDGE_NAME = {"LogicVista": "gpt4o-mini", "MathVision_MINI": "gpt-4o-mini", "MathVista_MINI": "gpt-4o-mini"}


def _scores(work, model, accs, run_id="T20260101_Gabc", mtime=None):
    for d, acc in zip(VT.DATASETS, accs):
        f = work / model / run_id / f"{model}_{d}_{JUDGE_NAME[d]}_score.csv"
        f.parent.mkdir(parents=True, exist_ok=True)
        cols = HEADS[d].split(",")
        first = {"Task&Skill": "inductive", "Subject": "algebra"}[cols[0]]
        rows = [[first] + ["10"] * (len(cols) - 2) + ["12.5"], ["Overall"] + ["448"] * (len(cols) - 2) + [str(acc)]]
        f.write_text("\n".join([HEADS[d]] + [",".join(r) for r in rows]) + "\n")
        if mtime is not None:
            os.utime(f, (mtime, mtime))


def test_table_from_vlmevalkit_result_files(tmp_path, capsys):
    _scores(tmp_path, "base", [31.2, 18.0, 52.9])
    _scores(tmp_path, "base", [1.0, 1.0, 1.0], run_id="T20250101_old", mtime=1)  # an older run
    _scores(tmp_path, "step_004550", [35.0, 20.1, 55.3])
    assert VT.main(["--work-dir", str(tmp_path), "--base", "base", "--trained", "step_004550"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split() == ["base", "step_004550", "delta", "seed", "base", "seed", "GPU", "seed", "NPU"]
    assert lines[1].split() == ["LogicVista", "31.2", "35.0", "+3.8", "31.0", "35.4", "35.3"]
    assert lines[3].split() == ["MathVista_MINI", "52.9", "55.3", "+2.4", "52.3", "55.9", "54.7"]
    assert lines[4].split() == ["average", "34.0", "36.8", "+2.8", "33.8", "37.4", "36.8"]
    assert err == ""  # every base score within a point of the seed's


def test_table_warns_while_the_base_is_off_and_names_a_missing_file(tmp_path, capsys):
    _scores(tmp_path, "base", [31.0, 16.9, 62.0])
    assert VT.main(["--work-dir", str(tmp_path), "--base", "base"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [re.search(r"base (\S+) is", e).group(1) for e in err] == ["MathVision_MINI", "MathVista_MINI"]
    assert "+9.7 from the seed's 52.3" in err[1]
    with pytest.raises(SystemExit, match=r"no step_1_LogicVista_<judge>_score.csv under .*LogicVista writes none"):
        VT.main(["--work-dir", str(tmp_path), "--base", "base", "--trained", "step_1"])


def test_check_export_flags_a_capped_processor(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 3136, "longest_edge": 4194304}}))
    assert "caps images at 4.19 MP" in VT.check_export(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 12845056}))
    assert VT.check_export(tmp_path) == ""


# ---------------------------------------------------------------- launch/vlmeval.sh --dry-run
def _vlmeval_examples() -> list[str]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    lines = [ln for p in pages for ln in p.read_text().splitlines()]
    lines += [ln.lstrip("# ") for ln in (ROOT / "launch" / "vlmeval.sh").read_text().splitlines()
              if ln.startswith("#")]
    found = {m.strip() for ln in lines for m in [ln.strip(), *re.findall(r"`([^`]+)`", ln)]
             if re.match(r"^(?:[A-Z_]+=\S+\s+)*bash launch/vlmeval\.sh .*--dry-run", m.strip())
             and "[" not in m}  # the usage line
    return sorted(found)


def _run(cmd: str, cwd, **env) -> subprocess.CompletedProcess:
    words = shlex.split(cmd)
    assigns = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
    args = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
    e = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "JUDGE_KEY")}
    e.update(assigns, PYTHON=sys.executable, **env)
    args[1] = str(ROOT / args[1])
    return subprocess.run(args, cwd=cwd, env=e, capture_output=True, text=True, timeout=60)


def test_documented_examples_pass_dry_run(tmp_path):
    examples = _vlmeval_examples()
    assert len(examples) >= 3, examples  # the script's own two and docs/reproducing.md's
    for cmd in examples:
        for word in shlex.split(cmd)[3:]:  # the checkpoints a documented example names
            if not word.startswith("-") and "/checkpoints/" in word:
                (tmp_path / word / "hf").mkdir(parents=True, exist_ok=True)
                (tmp_path / word / "hf" / "config.json").write_text("{}")
                (tmp_path / word / "hf" / "preprocessor_config.json").write_text(
                    json.dumps({"min_pixels": 3136, "max_pixels": 12845056}))
        p = _run(cmd, tmp_path)
        assert p.returncode == 0, (cmd, p.stderr)
        assert "run.py --config" in p.stdout and "vlmeval_table.py" in p.stdout, p.stdout


def test_dry_run_prints_each_models_command_with_vlmevalkits_settings(tmp_path):
    ckpt = tmp_path / "runs" / "r" / "checkpoints" / "step_000065"
    (ckpt / "hf").mkdir(parents=True)
    (ckpt / "hf" / "config.json").write_text("{}")
    (ckpt / "hf" / "preprocessor_config.json").write_text(json.dumps({"size": {"longest_edge": 4194304}}))
    p = _run("bash launch/vlmeval.sh --dry-run --judge-base-url http://127.0.0.1:8000/v1 --judge "
             "judge-model Qwen/Qwen2.5-VL-3B-Instruct runs/r/checkpoints/step_000065", tmp_path,
             WORK_DIR=str(tmp_path / "w"), JUDGE_KEY="sk-secret")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    torchruns = [ln for ln in out.splitlines() if "torchrun" in ln]
    assert len(torchruns) == 2 and all("--judge judge-model --judge-base-url http://127.0.0.1:8000/v1" in t
                                       for t in torchruns)
    assert "sk-secret" not in out  # the key goes by the environment
    configs = [json.loads(ln[2:]) for ln in out.splitlines() if ln.startswith("# {")]
    assert [list(c["model"]) for c in configs] == [["base"], ["step_000065"]]
    for c in configs:
        (m,) = c["model"].values()
        assert (m["class"], m["min_pixels"], m["max_pixels"], m["use_custom_prompt"]) == (
            "Qwen2VLChat", 1280 * 28 * 28, 16384 * 28 * 28, False)
        assert set(c["data"]) == {"LogicVista", "MathVision_MINI", "MathVista_MINI"}
    assert configs[1]["model"]["step_000065"]["model_path"] == str(ckpt / "hf")
    assert "VLMEVALKIT_COMMIT" not in out and "e8e78f05f3080fe28154f2130321f17951c3be94" in out
    assert "--base base --trained step_000065" in out
    assert "caps images at 4.19 MP" in p.stderr  # an export from before the fix
    assert not (tmp_path / "w").exists()  # a dry run writes nothing


def test_bad_arguments_are_one_line_before_anything_runs(tmp_path):
    p = _run("bash launch/vlmeval.sh Qwen/Qwen2.5-VL-3B-Instruct runs/missing", tmp_path)
    assert p.returncode == 2 and "runs/missing: neither a checkpoint" in p.stderr
    p = _run("bash launch/vlmeval.sh Qwen/Qwen2.5-VL-3B-Instruct", tmp_path)
    assert p.returncode == 2 and "no judge: set JUDGE_KEY" in p.stderr
    p = _run("bash launch/vlmeval.sh Qwen/Qwen2.5-VL-3B-Instruct", tmp_path, JUDGE_KEY="k",
             VLMEVALKIT_DIR=str(tmp_path / "kit"))
    assert p.returncode == 2 and "no VLMEvalKit at" in p.stderr and "git -C" in p.stderr
    kit = tmp_path / "kit"
    subprocess.run(["git", "init", "-q", str(kit)], check=True)
    subprocess.run(["git", "-C", str(kit), "-c", "user.name=t", "-c", "user.email=t@t", "commit",
                    "-q", "--allow-empty", "-m", "x"], check=True)
    p = _run("bash launch/vlmeval.sh Qwen/Qwen2.5-VL-3B-Instruct", tmp_path, JUDGE_KEY="k",
             VLMEVALKIT_DIR=str(kit))
    assert p.returncode == 2 and "not the pinned e8e78f05f3080fe28154f2130321f17951c3be94" in p.stderr
    assert not (tmp_path / "runs").exists()  # refused before anything is written
