"""Trackers with the real packages, offline: every metric of every step, the config and the samples
read back from what each tracker wrote; start failures are one line naming the tracker; a tracker
failing mid-run is reported once and the others keep logging."""
from __future__ import annotations

import glob
import html
import json
import math
import re
import struct
import subprocess
import sys
import types
import zlib
from pathlib import Path

import pytest

import trackers
import tracking as T
from tests.util import ROOT

STEPS = 4
CONFIG = {"run": {"steps": STEPS, "report_to": ["tensorboard", "wandb", "swanlab"], "out_dir": "x"},
          "train": {"lr": 1e-3, "kl_coef": 0.0, "warmup": None},
          "reward": {"functions": [{"name": "format", "weight": 1.0}]}}
RESPONSE = "<think>2*3 | a_b</think>\n<answer>6</answer>"  # HTML, markdown and a table separator


def metrics_at(step: int) -> dict:
    m = {"reward/mean": 0.25 * step, "time/step_s": 1.5, "train/skipped_steps": step // 2,
         "loss": float("nan") if step == 1 else -0.5 * step,
         "grad_norm": float("inf") if step == 2 else 1.0}
    if step % 2:  # a key that only some steps have, like eval/*
        m["eval/accuracy"] = 0.1 * step
    return m


def rows_at(step: int) -> list[dict]:
    return [{"index": 0, "response": RESPONSE, "reward": 1.0,
             "parts": {"format": 1.0, "accuracy": 0.0}, "version": step},
            {"index": 1, "response": f"step {step}", "reward": float("nan"),
             "parts": {"format": 0.0, "accuracy": 0.0}, "version": step}]


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No credentials, offline modes, HOME and CWD inside tmp_path (the CWD must stay empty)."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    for k in ("WANDB_API_KEY", "SWANLAB_API_KEY", "WANDB_DIR", "SWANLAB_LOG_DIR",
              "SWANLAB_SAVE_DIR", "WANDB_PROJECT", "SWANLAB_PROJ_NAME", "WANDB_CACHE_DIR",
              "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield tmp_path / "out"
    assert list(cwd.iterdir()) == [], "a tracker wrote into the working directory"


def write_run(out: Path, names: list[str]) -> None:
    tr = trackers.Trackers.open(names, out, CONFIG, run_name="test-run")
    assert tr.names == names
    for step in range(STEPS):
        tr.log(metrics_at(step), step)
        tr.log_samples(step, rows_at(step))
    tr.close()


# ----------------------------------------------------------------------------- readers
def tensorboard_run(out: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def wandb_records(out: Path):
    """The records of the one offline run, read from its `.wandb` file: W&B writes its protobuf
    records in LevelDB's log format (32 KiB blocks, CRC32 per chunk) after a 7-byte header."""
    from wandb.proto import wandb_internal_pb2 as pb
    (path,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = Path(path).read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer too short for a header: zero padding
            pos += 32768 - pos % 32768
            continue
        crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + n]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc
        pos += 7 + n
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL, FIRST | MIDDLE, LAST
        if kind in (1, 4):
            yield pb.Record.FromString(buf)


def swanlab_records(out: Path) -> list[dict]:
    from swanlab.log.backup.datastore import DataStore
    (path,) = glob.glob(str(out / "swanlog" / "run-*" / "backup.swanlab"))
    ds = DataStore()
    ds.open_for_scan(path)
    return [json.loads(r) for r in ds]


# ----------------------------------------------------------------------------- (a) (b) (c)
def test_tensorboard_has_every_metric_the_config_and_the_samples(offline):
    pytest.importorskip("tensorboard")
    write_run(offline, ["tensorboard"])
    acc = tensorboard_run(offline)
    expected = {}
    for step in range(STEPS):
        for k, v in metrics_at(step).items():
            expected.setdefault(k, []).append((step, v))
    assert set(acc.Tags()["scalars"]) == set(expected)
    for k, want in expected.items():
        got = [(e.step, e.value) for e in acc.Scalars(k)]
        assert [s for s, _ in got] == [s for s, _ in want], k  # exactly one value per step
        assert all(same(g, w) for (_, g), (_, w) in zip(got, want)), (k, got, want)
    # hyperparameters: the hparams plugin's session record, flattened as section.key
    from tensorboard.plugins.hparams import plugin_data_pb2
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hp = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hp["run.steps"].number_value == STEPS and hp["train.lr"].number_value == 1e-3
    assert json.loads(hp["run.report_to"].string_value) == CONFIG["run"]["report_to"]
    assert "train.warmup" not in hp  # None has no hparams type: left out, still in the config text
    (config_text,) = acc.Tensors("config/text_summary")
    assert json.loads(config_text.tensor_proto.string_val[0].decode().strip("`\n")) == CONFIG
    # samples: a markdown table per step that TensorBoard renders back to the literal response
    from tensorboard import plugin_util
    samples = acc.Tensors("samples/text_summary")
    assert [e.step for e in samples] == list(range(STEPS))
    page = plugin_util.markdown_to_safe_html(samples[-1].tensor_proto.string_val[0])
    cells = [html.unescape(c.replace("<br>", "\n"))
             for c in re.findall(r"<td>(.*?)</td>", page, re.S)]
    assert cells[:6] == ["0", RESPONSE, "1", "1", "0", "3"]  # row 0 of step 3, as written
    assert re.findall(r"<th>(.*?)</th>", page) == ["index", "response", "reward", "parts/format",
                                                    "parts/accuracy", "version"]
    assert "nan" in cells


def test_wandb_offline_run_has_every_metric_the_config_and_the_samples(offline):
    pytest.importorskip("wandb")
    write_run(offline, ["wandb"])
    history, config = {}, {}
    for r in wandb_records(offline):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                   for i in r.history.item}
            history[row["_step"]] = row
        elif kind == "run":
            config = {i.key: json.loads(i.value_json) for i in r.run.config.update}
            assert r.run.display_name == "test-run" and r.run.project == trackers.DEFAULT_PROJECT
    assert sorted(history) == list(range(STEPS))
    for step, row in history.items():
        want = metrics_at(step)
        got = {k: v for k, v in row.items() if not k.startswith(("_", "samples"))}
        assert set(got) == set(want), step
        assert all(same(float(got[k]), v) for k, v in want.items()), (step, got)
        assert row["samples/_type"] == "table-file"
    assert {k: config[k] for k in CONFIG} == CONFIG
    for step in range(STEPS):  # the table files the offline run keeps for `wandb sync`
        (path,) = glob.glob(str(offline / "wandb" / "offline-run-*" / "files" / "media" / "table"
                                / f"samples_{step}_*.table.json"))
        table = json.loads(Path(path).read_text())
        assert table["columns"] == ["index", "response", "reward", "parts/format", "parts/accuracy",
                                    "version"]
        assert table["data"][0][:2] == [0, RESPONSE] and table["data"][0][-1] == step


def test_wandb_end_of_run_block_only_when_verbose(offline, monkeypatch, capfd):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_SILENT")                   # what a user's shell has
    for verbose in (False, True):
        tr = trackers.Trackers.open(["wandb"], offline / str(verbose), CONFIG, run_name="test-run",
                             verbose=verbose)
        for step in range(3):
            tr.log(metrics_at(step), step)
        tr.close()
        out = "".join(capfd.readouterr())
        assert ("Run history:" in out and "Run summary:" in out) == verbose, out


def test_swanlab_offline_run_has_every_metric_the_config_and_the_samples(offline):
    pytest.importorskip("swanlab")
    yaml = pytest.importorskip("yaml")
    write_run(offline, ["swanlab"])
    records = swanlab_records(offline)
    got: dict[str, list] = {}
    for r in records:
        if r["model_type"] == "Scalar":  # nan and inf are kept as the strings "NaN" and "INF"
            d = r["data"]
            got.setdefault(d["key"], []).append((d["step"], float(d["metric"]["data"])))
    expected = {}
    for step in range(STEPS):
        for k, v in metrics_at(step).items():
            expected.setdefault(k, []).append((step, v))
    assert set(got) == set(expected)
    for k, want in expected.items():
        assert [s for s, _ in got[k]] == [s for s, _ in want], k
        assert all(same(g, w) for (_, g), (_, w) in zip(got[k], want)), (k, got[k], want)
    (experiment,) = [r["data"] for r in records if r["model_type"] == "Experiment"]
    assert experiment["name"] == "test-run"
    (run_dir,) = glob.glob(str(offline / "swanlog" / "run-*"))
    saved = yaml.safe_load(Path(run_dir, "files", "config.yaml").read_text())
    assert {k: saved[k]["value"] for k in CONFIG} == CONFIG
    media = [r["data"] for r in records
             if r["model_type"] == "Media" and r["data"]["key"] == "samples"]
    assert [m["step"] for m in media] == list(range(STEPS))
    (chart,) = glob.glob(str(Path(run_dir, "media", "*", media[-1]["metric"]["data"][0])))
    table = json.loads(Path(chart).read_text())
    assert [c["field"] for c in table["colDefs"]] == ["index", "response", "reward", "parts/format",
                                                      "parts/accuracy", "version"]
    assert table["rowData"][0]["response"] == RESPONSE and table["rowData"][1]["reward"] == "nan"


def test_tensorboard_resume_keeps_one_value_per_step(offline):
    """A run resumed at step 2 after a crash at step 3: TensorBoard drops the crashed run's
    steps 2-3 (purge_step), so every step still has exactly one value."""
    pytest.importorskip("tensorboard")
    crashed = trackers.Trackers.open(["tensorboard"], offline, CONFIG)
    for step in range(STEPS):
        crashed.log({"reward/mean": -1.0}, step)
    crashed.close(failed=True)
    resumed = trackers.Trackers.open(["tensorboard"], offline, CONFIG, start_step=2)
    for step in range(2, STEPS):
        resumed.log({"reward/mean": 1.0}, step)
    resumed.close()
    got = [(e.step, e.value) for e in tensorboard_run(offline).Scalars("reward/mean")]
    assert got == [(0, -1.0), (1, -1.0), (2, 1.0), (3, 1.0)]


# ----------------------------------------------------------------------------- (d) start failures
def test_unknown_or_repeated_names_are_one_line_errors(offline):
    with pytest.raises(trackers.TrackerError, match=r"^run\.report_to: unknown tracker 'mlflow' "
                                             r"\(choose from tensorboard, wandb, swanlab\)$"):
        trackers.Trackers.open(["tensorboard", "mlflow"], offline, CONFIG)
    with pytest.raises(trackers.TrackerError, match=r"^run\.report_to: wandb is listed twice$"):
        trackers.Trackers.open(["wandb", "wandb"], offline, CONFIG)
    assert not offline.exists()  # names are checked before anything starts


def test_tracker_that_cannot_start_is_one_line_naming_it(offline):
    pytest.importorskip("tensorboard")
    offline.mkdir()
    (offline / "tensorboard").write_text("a file where the event folder should be")
    with pytest.raises(trackers.TrackerError) as e:
        trackers.Trackers.open(["tensorboard"], offline, CONFIG)
    assert str(e.value).startswith("run.report_to: tensorboard: ") and "\n" not in str(e.value)


def test_online_without_credentials_fails_at_start_and_closes_the_others(offline, monkeypatch):
    pytest.importorskip("wandb"), pytest.importorskip("swanlab"), pytest.importorskip("tensorboard")
    monkeypatch.delenv("WANDB_MODE")
    with pytest.raises(trackers.TrackerError,
                       match=r"^run\.report_to: wandb: no API key .*WANDB_MODE=offline$"):
        trackers.Trackers.open(["tensorboard", "wandb"], offline, CONFIG)
    # tensorboard, started first, was closed (flushed): its config record is on disk
    assert "config/text_summary" in tensorboard_run(offline).Tags()["tensors"]
    monkeypatch.setenv("WANDB_MODE", "offline")  # the refused start left no online state behind
    trackers.Trackers.open(["wandb"], offline, CONFIG).close()
    assert len(glob.glob(str(offline / "wandb" / "offline-run-*"))) == 1
    monkeypatch.delenv("SWANLAB_MODE")
    with pytest.raises(trackers.TrackerError,
                       match=r"^run\.report_to: swanlab: no API key .*SWANLAB_MODE=offline$"):
        trackers.Trackers.open(["swanlab"], offline, CONFIG)


# ----------------------------------------------------------------------------- (e) mid-run failure
def test_tracker_failing_mid_run_is_reported_once_and_the_others_keep_logging(offline, capsys):
    pytest.importorskip("wandb"), pytest.importorskip("swanlab"), pytest.importorskip("tensorboard")
    tr = trackers.Trackers.open(["tensorboard", "swanlab", "wandb"], offline, CONFIG)
    tr.log(metrics_at(0), 0)
    tr._live[1].run.finish()  # the SwanLab run ends under us: its next log raises
    capsys.readouterr()
    for step in range(1, STEPS):
        tr.log(metrics_at(step), step)
        tr.log_samples(step, rows_at(step))
    tr.close()
    err = [ln for ln in capsys.readouterr().err.splitlines() if "tracker" in ln]
    assert len(err) == 1
    assert err[0].startswith("warning: tracker swanlab failed at step 1 (log): RuntimeError: ")
    assert tr.names == []
    acc = tensorboard_run(offline)
    assert [e.step for e in acc.Scalars("reward/mean")] == list(range(STEPS))
    assert [e.step for e in acc.Tensors("samples/text_summary")] == list(range(1, STEPS))
    steps = [r.history for r in wandb_records(offline) if r.WhichOneof("record_type") == "history"]
    assert len(steps) == STEPS
    tr.close()  # a second close is a no-op


# ----------------------------------------------------------------------------- laziness
def test_no_tracker_is_a_no_op_and_importing_loads_no_package(offline):
    tr = trackers.Trackers.open([], offline, CONFIG)
    tr.log({"a": 1.0}, 0), tr.log_samples(0, [{"response": "x"}]), tr.close()
    assert not offline.exists()
    code = ("import sys, tracking; "
            "bad = {'torch', 'wandb', 'swanlab', 'tensorboard'} & set(sys.modules); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# ----------------------------------------------------------------------------- the run's records
def _records(out: Path, steps: int, evals: list[int]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.5}) + "\n"
                                               for s in range(steps)))
    (out / "samples.jsonl").write_text("".join(json.dumps({"step": s, "index": i}) + "\n"
                                               for s in range(steps) for i in range(2)))
    (out / "eval.jsonl").write_text("".join(json.dumps({"after": a, "eval/accuracy": 0.5}) + "\n"
                                            for a in evals))


def _col(path: Path, key: str) -> list:
    return [json.loads(ln)[key] for ln in path.read_text().splitlines()]


@pytest.mark.parametrize("name", ["metrics.jsonl", "samples.jsonl", "eval.jsonl"])
def test_resume_keeps_the_steps_before_it_and_drops_a_torn_last_line(tmp_path, capsys, name):
    """Resuming at step 3: the rows of steps 0-2 stay (the evaluation after 3 steps ran in step
    2), the later ones move aside; a last line cut off mid-write is dropped, naming its file."""
    _records(tmp_path, 5, [0, 2, 3, 4])
    with open(tmp_path / name, "a") as f:
        f.write('{"step": 5, "ind')
    T.resume_records(tmp_path, 3)
    assert capsys.readouterr().err == (f"warning: {tmp_path / name}: its last line was cut off "
                                       "mid-write (16 bytes, not JSON; a full disk or a kill while "
                                       "writing): dropped\n")
    assert _col(tmp_path / "metrics.jsonl", "step") == [0, 1, 2]
    assert _col(tmp_path / "metrics.abandoned.jsonl", "step") == [3, 4]
    assert _col(tmp_path / "samples.jsonl", "step") == [0, 0, 1, 1, 2, 2]
    assert _col(tmp_path / "eval.jsonl", "after") == [0, 2, 3]
    assert _col(tmp_path / "eval.abandoned.jsonl", "after") == [4]
    assert not list(tmp_path.glob("*.tmp"))
    T.resume_records(tmp_path, 3)                       # the same start again: nothing moves
    assert _col(tmp_path / "metrics.abandoned.jsonl", "step") == [3, 4]


def test_fresh_start_moves_every_row_aside_even_the_first_evaluation(tmp_path):
    """A start at step 0 runs eval.before_start again: its row (after 0) moves aside too."""
    _records(tmp_path, 2, [0, 1])
    T.resume_records(tmp_path, 0)
    assert (tmp_path / "metrics.jsonl").read_text() == (tmp_path / "eval.jsonl").read_text() == ""
    assert _col(tmp_path / "eval.abandoned.jsonl", "after") == [0, 1]


def test_a_damaged_record_file_stops_the_start_before_anything_moves(tmp_path):
    import failures
    _records(tmp_path, 4, [1, 2])
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    lines[2] = lines[2][:9]                             # not the last line: not a torn write
    (tmp_path / "samples.jsonl").write_text("\n".join(lines) + "\n")
    before = {p.name: p.read_text() for p in tmp_path.iterdir()}
    with pytest.raises(failures.Fatal) as e:
        T.resume_records(tmp_path, 1)
    assert str(e.value).startswith(f"{tmp_path / 'samples.jsonl'}:3: not JSON (")
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == before   # metrics.jsonl too


def test_a_full_disk_while_writing_records_names_the_file_and_the_folder(tmp_path):
    """/dev/full fails every write with ENOSPC, as a full file system does."""
    import failures
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    rec = T.Recorder(tmp_path, 2, 0, 3, trackers.Trackers())
    rec.samples.close()
    rec.samples = open("/dev/full", "a")
    m = {"step": 0, "weight_version": 0, "reward/mean": 0.5, "response_len/mean": 4.0,
         "time/generate_s": 0.1, "time/train_s": 0.1, "time/sync_s": 0.0, "time/step_s": 0.2}
    ep = types.SimpleNamespace(index=0, group=0, version=0, reward=1.0, parts={}, info={},
                               response_ids=[1], truncated=False, text="x" * 10_000)  # > the buffer
    problems = {0: types.SimpleNamespace(marked="Find x.", answer="1")}
    with pytest.raises(failures.Fatal) as e:
        rec.step(m, [ep], [0.5], problems)
    assert str(e.value).startswith(f"cannot write {tmp_path / 'samples.jsonl'}: No space left on "
                                   f"device ({tmp_path}: ")
    assert "\n" not in str(e.value) and "then restart" in str(e.value)


def test_refill_bound_hit_is_said_on_the_console_every_step_it_lasts(tmp_path, capsys):
    """DAPO: when the refill rounds run out, the groups with equal rewards are masked out; with
    every group so the update is a no-op, which only the metrics used to say."""
    rec = T.Recorder(tmp_path, 0, 0, 3, trackers.Trackers())
    base = {"weight_version": 0, "reward/mean": 1.0, "response_len/mean": 4.0, "time/generate_s": 0.1,
            "time/train_s": 0.1, "time/sync_s": 0.0, "time/step_s": 0.2,
            "rollout/refill_rounds": 4, "rollout/prompts_drawn": 20}
    eps = [types.SimpleNamespace(group=g) for g in range(4) for _ in range(4)]
    for step, dropped in enumerate([4, 1, 0]):
        rec.step({"step": step, **base, "train/dropped_groups": float(dropped)}, eps,
                 [0.0] * len(eps), {})
    rec.close()
    assert capsys.readouterr().err.splitlines() == [
        "warning: step 1: 4 of 4 groups have equal rewards after 4 refill round(s) (20 prompts "
        "drawn; rollout.max_refill_rounds): masked out of the update; every group is: this "
        "step's update is a no-op (loss 0, gradient norm 0)",
        "warning: step 2: 1 of 4 groups have equal rewards after 4 refill round(s) (20 prompts "
        "drawn; rollout.max_refill_rounds): masked out of the update"]


def test_console_line_shows_the_clip_fraction_when_the_objective_clips(tmp_path):
    rec = T.Recorder(tmp_path, 0, 0, 3, trackers.Trackers())
    base = {"step": 0, "weight_version": 0, "reward/mean": 1.0, "response_len/mean": 4.0,
            "time/generate_s": 0.1, "time/train_s": 0.1, "time/sync_s": 0.0, "time/step_s": 0.2}
    assert " clip " not in rec.line(base)
    line = rec.line({**base, "train/clip_frac_low": 0.01, "train/clip_frac_high": 0.02})
    assert "gnorm 0.000 clip 0.030 ent" in line, line
    rec.close()


def test_samples_rows_keep_a_rewards_info_and_the_image_markers(tmp_path):
    import synthetic
    rec = T.Recorder(tmp_path, -1, 0, 1, trackers.Trackers())
    m = {"step": 0, "weight_version": 0, "reward/mean": 1.0, "response_len/mean": 1.0,
         "time/generate_s": 0.1, "time/train_s": 0.1, "time/sync_s": 0.0, "time/step_s": 0.2}
    ep = types.SimpleNamespace(index=0, group=0, version=0, reward=1.0, parts={"accuracy": 1.0},
                               info={"difficulty": 2}, response_ids=[1], truncated=False, text="x")
    problem = synthetic.Problem(0, [object(), object()], "Which is larger?", "A")
    rec.step(m, [ep], [0.5], {0: problem})
    rec.close()
    row = json.loads((tmp_path / "samples.jsonl").read_text())
    assert row["info"] == {"difficulty": 2} and row["parts"] == {"accuracy": 1.0}
    assert row["problem"] == "<image><image>Which is larger?"
    assert "difficulty" not in json.loads((tmp_path / "metrics.jsonl").read_text())


def test_startup_says_when_the_reward_kl_is_k3_where_peers_default_to_k1():
    import config as C
    plan = {"path": None, "progress": types.SimpleNamespace(step=0, version=0)}
    note = ("   note: loss.kl_in_reward with loss.kl_estimator = k3; verl's and EasyR1's reward KL "
            "default to k1 (--loss.kl_estimator=k1 to match them)")
    on = C.load(None, ["--loss.kl_coef=0.01", "--loss.kl_in_reward=true"])
    assert note in T.startup_summary(on, ["trainer"], "cpu", 10, 8, 0, 0, plan, "x").splitlines()
    k1 = C.load(None, ["--loss.kl_coef=0.01", "--loss.kl_in_reward=true", "--loss.kl_estimator=k1"])
    assert note not in T.startup_summary(k1, ["trainer"], "cpu", 10, 8, 0, 0, plan, "x").splitlines()


def test_oversized_sequences_and_replay_falling_back_are_said_once_and_counted(tmp_path, capsys):
    """train/oversized_sequences and train/routing_fallback: every step in the metrics, one
    warning line the first step each is above 0 (rank 0's Recorder), none while 0."""
    rec = T.Recorder(tmp_path, 0, 0, 4, trackers.Trackers())
    base = {"weight_version": 0, "reward/mean": 1.0, "response_len/mean": 4.0, "time/generate_s": 0.1,
            "time/train_s": 0.1, "time/sync_s": 0.0, "time/step_s": 0.2}
    counts = [(0, 0), (2, 0), (3, 5), (1, 1)]
    for step, (big, missing) in enumerate(counts):
        rec.step({"step": step, **base, "train/oversized_sequences": float(big),
                  "train/routing_fallback": float(missing)}, [], [], {})
    rec.close()
    assert capsys.readouterr().err.splitlines() == [
        "warning: step 2: 2 sequence(s) longer than train.micro_batch_tokens, each alone in a "
        "micro-batch over that budget (nothing splits a sequence); counted every step as "
        "train/oversized_sequences (said once)",
        "warning: step 3: 5 episode(s) without the engine's routing: model.moe_routing_replay "
        "keeps the trainer's own routing for their tokens; counted every step as "
        "train/routing_fallback (said once)"]
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["train/oversized_sequences"], r["train/routing_fallback"]) for r in rows] == counts


def test_console_line_says_no_lpdiff_when_every_token_was_stale(tmp_path):
    rec = T.Recorder(tmp_path, 0, 0, 3, trackers.Trackers())
    base = {"step": 0, "weight_version": 0, "reward/mean": 1.0, "response_len/mean": 4.0,
            "time/generate_s": 0.1, "time/train_s": 0.1, "time/sync_s": 0.0, "time/step_s": 0.2}
    assert " lpdiff - |" in rec.line({**base, "logprob_diff/tokens": 0})
    assert " lpdiff 2.0e-06 |" in rec.line({**base, "logprob_diff/tokens": 9, "logprob_diff/max": 2e-6})
    rec.close()


def test_evaluation_files_are_never_overwritten(tmp_path, capsys):
    """A second --eval-only of one checkpoint, or a step evaluated again after a resume: the next
    free name, said, and named in its eval.jsonl row; the first file untouched."""
    rows = [{"index": 0, "response": "a"}]
    first = T.write_evaluation(tmp_path, 2, 2, {"eval/reward": 0.5}, rows, checkpoint="ck/step_000002")
    assert first == tmp_path / "eval" / "step_000002.eval-only.jsonl" and not capsys.readouterr().out
    paths = [T.write_evaluation(tmp_path, 2, 2, {"eval/reward": 0.7}, [{"index": 0, "response": f"b{i}"}],
                                checkpoint="ck/step_000002") for i in range(2)]
    assert [p.name for p in paths] == ["step_000002.eval-only.1.jsonl", "step_000002.eval-only.2.jsonl"]
    assert json.loads(first.read_text()) == rows[0]
    assert json.loads(paths[1].read_text())["response"] == "b1"
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"note: generations in {paths[1]} (step_000002.eval-only.jsonl holds an earlier evaluation's)")
    assert T.write_evaluation(tmp_path, 4, 4, {}, rows).name == "step_000004.jsonl"
    assert T.write_evaluation(tmp_path, 4, 4, {}, rows).name == "step_000004.1.jsonl"
    evals = [json.loads(ln) for ln in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [e["generations"] for e in evals] == [
        "eval/step_000002.eval-only.jsonl", "eval/step_000002.eval-only.1.jsonl",
        "eval/step_000002.eval-only.2.jsonl", "eval/step_000004.jsonl", "eval/step_000004.1.jsonl"]
