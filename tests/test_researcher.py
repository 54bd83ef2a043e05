"""What a researcher forking the project relies on, through real runs (world of one, CPU):
trackers fed from the loop, evaluation for any task, any dataset schema, resume that never lies,
LR schedules, the console, full rollout dumps and the plot. A cosine schedule continuing exactly
on resume after a kill is checked in the 3-rank exact-resume run (tests/test_checkpoint.py::
test_exact_resume_after_a_kill_equals_the_uninterrupted_run), the library warnings of a 3-rank
launch of train.py itself cut in tests/test_failures.py::
test_user_stop_prints_one_line_per_rank_and_nothing_else (its Ctrl-C case)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import synthetic
import trainer as T
from tests.test_tracking import tensorboard_run, wandb_records
from tests.util import ROOT, TINY, env, metrics, train_py

TOY = ['--reward.functions=[{name="target_fraction", weight=1.0, target="<answer>"}]']


def train(out: Path, *args: str, extra_env: dict | None = None, timeout: float = 300):
    e = env()
    e.update(extra_env or {})
    return train_py([*TINY, f"--run.out_dir={out}", *args], env=e, timeout=timeout)


def ok(p):
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p


# ----------------------------------------------------------------------------- trackers
@pytest.mark.slow
def test_trackers_get_every_metric_of_every_step_from_the_loop(tmp_path):
    out = tmp_path / "run"
    p = ok(train(out, "--run.steps=3", "--run.keep_last=0", "--run.eval_every=3", "--run.eval_size=2",
                 '--run.report_to=["tensorboard", "wandb"]',
                 extra_env={"WANDB_MODE": "offline", "WANDB_SILENT": "true", "HOME": str(tmp_path)}))
    rows = metrics(out)
    acc = tensorboard_run(out)
    tags = set(acc.Tags()["scalars"])
    for key in {k for r in rows for k in r if k != "step"}:
        want = [r["step"] for r in rows if key in r and isinstance(r[key], (int, float))]
        assert [e.step for e in acc.Scalars(key)] == want, key    # one value per step
    assert "reward/target_fraction" in tags and "eval/accuracy" in tags
    history = [r.history for r in wandb_records(out) if r.HasField("history")]
    keys = {item.key or "/".join(item.nested_key) for h in history for item in h.item}
    assert {"reward/mean", "loss", "train/lr", "time/step_s"} <= keys, keys
    assert "trackers: tensorboard, wandb" in p.stdout


def test_a_tracker_that_cannot_start_is_one_line(tmp_path):
    p = train(tmp_path / "run", "--run.steps=1", '--run.report_to=["wandb"]',
              extra_env={"WANDB_MODE": "online", "HOME": str(tmp_path), "WANDB_API_KEY": ""})
    assert p.returncode != 0
    line = [ln for ln in p.stderr.splitlines() if "run.report_to: wandb" in ln]
    assert len(line) == 1, p.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()       # stopped before any step


# ----------------------------------------------------------------------------- evaluation
@pytest.mark.slow
def test_eval_any_task_n_samples_before_start_and_generations_saved(tmp_path):
    out = tmp_path / "run"
    p = ok(train(out, "--run.steps=2", "--run.eval_every=2", "--run.eval_size=3", "--eval.n=4",
                 "--eval.split=test", "--eval.before_start=true", "--eval.max_new_tokens=6",
                 "--eval.top_p=0.9", *TOY,
                 '--eval.functions=[{name="target_fraction", weight=1.0, target="<answer>"}]'))
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["after"] for e in evals] == [0, 2]
    for e in evals:
        assert e["eval/n"] == 3 and e["eval/samples"] == 12
        assert (e["split"], e["n"], e["temperature"], e["top_p"], e["max_new_tokens"]) == \
            ("test", 4, 1.0, 0.9, 6)                            # the settings it was made with
        assert 0 <= e["eval/target_fraction"] <= e["eval/reward/pass@4"] <= 1
    dump = [json.loads(x) for x in (out / "eval" / "step_000000.jsonl").read_text().splitlines()]
    assert len(dump) == 12 and sorted({d["sample"] for d in dump}) == [0, 1, 2, 3]
    assert {"index", "response", "reward", "parts", "length", "problem", "gold"} <= set(dump[0])
    assert max(d["length"] for d in dump) <= 6                   # eval.max_new_tokens, not 16
    test_set = {p.index: p for p in synthetic.synthetic_split("test", n=256)}
    assert all(d["gold"] == test_set[d["index"]].answer for d in dump)
    mean = sum(d["parts"]["target_fraction"] for d in dump) / 12
    assert math.isclose(mean, evals[0]["eval/target_fraction"], rel_tol=1e-9)
    best = {}
    for d in dump:
        best[d["index"]] = max(best.get(d["index"], 0.0), d["parts"]["target_fraction"])
    assert math.isclose(sum(best.values()) / 3, evals[0]["eval/reward/pass@4"], rel_tol=1e-9)
    assert metrics(out)[1]["eval/reward/pass@4"] == evals[1]["eval/reward/pass@4"]
    assert "note: reward" not in p.stdout                   # the same reward trains and grades

    # --eval-only: the same keys, its own generations file
    again = [*TINY, f"--run.out_dir={out}", "--run.eval_size=3", "--eval.n=2", "--eval.split=test",
             '--eval.functions=[{name="target_fraction", weight=1.0, target="<answer>"}]',
             "--eval-only", "--checkpoint", str(out / "checkpoints" / "step_000002")]
    q = ok(train_py(again))
    last = json.loads((out / "eval.jsonl").read_text().splitlines()[-1])
    assert last["checkpoint"].endswith("step_000002") and "eval/reward/pass@2" in last
    assert [k for k in last if "pass@" in k] == ["eval/reward/pass@2"]   # the score's alone
    assert (last["split"], last["n"], last["max_new_tokens"]) == ("test", 2, 16)
    first = (out / "eval" / "step_000002.eval-only.jsonl").read_text()
    assert len(first.splitlines()) == 6 and last["generations"] == "eval/step_000002.eval-only.jsonl"
    assert "generations:" in q.stdout and last["eval/skipped_rows"] == 0
    # a second --eval-only of the same checkpoint: its own file, the first one untouched
    q = ok(train_py(again))
    assert (out / "eval" / "step_000002.eval-only.jsonl").read_text() == first
    assert len((out / "eval" / "step_000002.eval-only.1.jsonl").read_text().splitlines()) == 6
    assert f"note: generations in {out / 'eval' / 'step_000002.eval-only.1.jsonl'}" in q.stdout


# ----------------------------------------------------------------------------- data schema
def test_any_dataset_schema_through_column_mapping(tmp_path):
    d = tmp_path / "mine"
    (d / "img").mkdir(parents=True)
    for split, n in (("train", 8), ("validation", 2)):
        lines = []
        for i, p in enumerate(synthetic.make_synthetic(n, seed=3 + n)):
            p.image.save(d / "img" / f"{split}{i}.png")
            lines.append(json.dumps({"question": p.problem, "solution": p.answer,
                                     "picture": f"img/{split}{i}.png"}))
        (d / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    cols = ["--data.problem_column=question", "--data.answer_column=solution",
            "--data.images_column=picture"]
    ok(train(tmp_path / "run", f"--data.source={d}", *cols, "--run.steps=1", "--run.keep_last=0",
             "--run.eval_every=1", "--run.eval_size=2", "--rollout.prompts_per_step=2"))
    p = train(tmp_path / "bad", f"--data.source={d}", *cols[:2], "--run.steps=1")
    assert p.returncode == 2
    assert "train.jsonl:1: missing column 'images'" in p.stderr and p.stderr.count("config error") == 1


# ----------------------------------------------------------------------------- resume
@pytest.mark.slow
def test_resume_never_lies(tmp_path):
    out = tmp_path / "run"
    ok(train(out, "--run.steps=2"))
    before = (out / "config.toml").read_text()
    # a key that changes what the run means: one line, exit 2, config.toml untouched
    p = train(out, "--run.steps=4", "--rollout.group_size=8", "--loss.aggregation=seq-mean-token-mean")
    assert p.returncode == 2
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("config error")]
    assert len(err) == 1 and "rollout.group_size 4 -> 8" in err[0]
    assert "loss.aggregation 'token-mean' -> 'seq-mean-token-mean'" in err[0]
    assert "run.allow_config_change" in err[0]
    assert (out / "config.toml").read_text() == before
    # optimizer keys are applied to the restored optimizer, said, and written
    p = ok(train(out, "--run.steps=4", "--train.lr=1e-3"))
    assert "== resumed from" in p.stdout and "step_000002 at step 2" in p.stdout
    assert "train.lr 0.002 -> 0.001" in p.stdout
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["train/lr"] for r in rows] == [2e-3, 2e-3, 1e-3, 1e-3]
    assert "lr = 0.001" in (out / "config.toml").read_text()
    # a finished run says so
    p = ok(train(out, "--run.steps=4", "--train.lr=1e-3"))
    assert "run already finished" in p.stdout and "resumed from" not in p.stdout
    # a meaning change can be forced
    p = ok(train(out, "--run.steps=5", "--train.lr=1e-3", "--rollout.group_size=8",
                 "--run.allow_config_change=true"))
    assert metrics(out)[-1]["step"] == 4


# ----------------------------------------------------------------------------- LR schedules
def test_lr_factor_by_hand():
    tc = SimpleNamespace(warmup_steps=2, lr_schedule="linear", min_lr_ratio=0.1)
    f = [T.lr_factor(s, tc, 10) for s in range(10)]
    assert f[:2] == [0.5, 1.0]                                   # warm-up (s + 1) / 2
    assert f[2:] == pytest.approx([1 - 0.9 * t / 8 for t in range(8)])
    tc.lr_schedule = "cosine"
    f = [T.lr_factor(s, tc, 10) for s in range(12)]
    assert f[2] == pytest.approx(1.0) and f[6] == pytest.approx(0.1 + 0.9 * 0.5)
    assert f[10] == pytest.approx(0.1) and f[11] == pytest.approx(0.1)   # floor after the end
    tc.lr_schedule, tc.warmup_steps = "constant", 0
    assert {T.lr_factor(s, tc, 10) for s in range(10)} == {1.0}


# ----------------------------------------------------------------------------- console, dumps
def test_console_line_summaries_and_full_rollout_dump(tmp_path):
    """The console and samples.jsonl of a 3-step run; it trains on the toy reward while the
    evaluation grades geometry (the default [eval] functions), which the console notes."""
    out = tmp_path / "run"
    p = ok(train(out, "--run.steps=3", "--run.log_samples=-1", "--run.eval_every=3",
                 "--run.eval_size=2", *TOY))
    assert "note: reward target_fraction is used for training but not for evaluation" in p.stdout
    lines = p.stdout.splitlines()
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert [ln.split(" |")[0] for ln in steps] == ["step 1/3", "step 2/3", "step 3/3"]
    assert all("ETA" in ln and "tok/s" in ln and "target_fraction" in ln for ln in steps)
    assert any(ln.startswith("== 1 rank(s) on cpu: rank 0 trainer+generation") for ln in lines)
    assert any(ln.startswith("== fresh start: steps 0 -> 3") for ln in lines)
    done = [ln for ln in lines if ln.startswith("done: 3 steps")]
    assert len(done) == 1 and "eval/accuracy best" in done[0] and "step_000003" in done[0]
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 16                                # every episode of every step
    assert {"step", "index", "group", "version", "reward", "parts", "length", "response",
            "problem", "gold", "advantage"} <= set(samples[0])
    problems = {p.index: p for p in synthetic.synthetic_split("train", n=256)}  # tiny.toml's set
    assert all((r["problem"], r["gold"]) == (problems[r["index"]].marked, problems[r["index"]].answer)
               for r in samples)
    for k in range(0, len(samples), 4):                          # GRPO: a group's advantages sum to 0
        group = samples[k:k + 4]
        assert len({r["group"] for r in group}) == 1 and abs(sum(r["advantage"] for r in group)) < 1e-5
    rows = metrics(out)
    assert all(r["time/gen_tokens_per_s"] > 0 for r in rows)
    assert [r["train/optimizer_steps"] for r in rows] == [1, 2, 3]


def test_plot_overlays_runs_with_smoothing(tmp_path):
    for name, shift in (("a", 0.0), ("b", 0.1)):
        d = tmp_path / name
        d.mkdir()
        rows = [{"step": i, "reward/mean": i / 10 + shift, "reward/format": shift, "entropy": 1 - i / 20,
                 "kl": 0.01 * i, "grad_norm": 1.0, "train/clip_frac_low": 0.0, "train/clip_frac_high": 0.1,
                 "logprob_diff/max": 1e-6, "response_len/mean": 16.0} for i in range(8)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "eval.jsonl").write_text(json.dumps({"after": 0, "eval/accuracy": 0.0}) + "\n"
                                      + json.dumps({"after": 8, "eval/accuracy": 0.5}) + "\n")
    out = tmp_path / "ab.png"
    p = subprocess.run([sys.executable, str(ROOT / "launch" / "plot.py"), str(tmp_path / "a"),
                        str(tmp_path / "b"), "--smooth", "0.6", "-o", str(out)],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 50_000
    bad = subprocess.run([sys.executable, str(ROOT / "launch" / "plot.py"), str(tmp_path / "a"),
                          "--smooth", "1.5"], cwd=ROOT, env=env(), capture_output=True, text=True)
    assert bad.returncode == 2 and "--smooth" in bad.stderr


def test_plot_panels_keys_styles_and_one_x_axis(tmp_path):
    """The figure itself: the panels drawn (flat ones left out), the total reward apart from its
    parts, timing and throughput, distinct styles per key, --keys, and steps and evaluations on
    one axis (rollout steps done)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("plot", ROOT / "launch" / "plot.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    d = tmp_path / "run"
    d.mkdir()
    rows = [{"step": i, "reward/mean": i / 10, "reward/format": 0.1 * (i % 3),
             "reward/target_fraction": i / 10, "reward/accuracy": 0.0, "reward/errors": 0.0,
             "entropy": 1 - i / 20, "kl": 0.0, "train/approx_kl": 0.0, "grad_norm": 1.0 + i,
             "train/clip_frac_low": 0.0, "train/clip_frac_high": 0.0, "train/lr": 1e-3,
             "time/step_s": 1.0 + 0.1 * i, "time/generate_s": 0.5, "time/train_s": 0.3 + 0.01 * i,
             "time/sync_s": 0.1, "time/gen_tokens_per_s": 100.0 + i, "time/train_tokens_per_s": 900.0,
             "train/filtered/short_only": 0.1 * (i % 2),   # a plugin's: no panel names it
             **{f"reward/p{j}": j * i / 100 for j in range(8)}} for i in range(8)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "eval.jsonl").write_text(json.dumps({"after": 0, "eval/accuracy": 0.0}) + "\n"
                                  + json.dumps({"after": 8, "eval/accuracy": 0.5}) + "\n")
    run = plot.load_run(d)
    fig = plot.plot([run])
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    # KL, clip fractions and lr are flat (all-zero or constant): no panel for them
    assert set(axes) == {"reward", "reward parts", "eval", "entropy", "grad norm", "time (s)", "tok/s",
                         "other train/"}
    assert [ln.get_label() for ln in axes["other train/"].lines] == ["train/filtered/short_only"]
    assert [ln.get_label() for ln in axes["reward"].lines] == ["reward/mean"]     # total apart
    parts = {ln.get_label() for ln in axes["reward parts"].lines}
    assert "reward/mean" not in parts and "reward/errors" not in parts
    assert "reward/accuracy" not in parts and "reward/p0" not in parts   # zero throughout: left out
    styles = [(ln.get_marker(), ln.get_linestyle(), ln.get_color()) for ln in axes["reward parts"].lines]
    assert len(set(styles)) == len(styles) == 9                        # every key its own look
    assert {ln.get_label() for ln in axes["time (s)"].lines} == {"time/step_s", "time/generate_s",
                                                                 "time/train_s", "time/sync_s"}
    assert all(ax.get_xlabel() == "rollout steps done" for ax in axes.values())
    # one x axis: step row k at k + 1, the evaluation after N rollout steps at N
    assert list(axes["reward"].lines[0].get_xdata()) == list(range(1, 9))
    assert list(axes["eval"].lines[0].get_xdata()) == [0, 8]
    # --keys: exactly those panels, flat ones included when asked for
    fig = plot.plot([run], keys=["kl", "time/"])
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == ["kl", "time"]
    assert plot.main([str(d), "--keys", "nothing/here", "-o", str(tmp_path / "x.png")]) == 2


def test_plot_labels_seed_bands_and_the_x_axis(tmp_path):
    """--labels a,b --x tokens over four runs (two seeds each): one mean line and one band per
    label, x in trained tokens so far (evaluations where their step ended), the labels (not the
    paths) in the title and legends, the legends beside the axes."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("plot", ROOT / "launch" / "plot.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    dirs = []
    for name, shift in (("a0", 0.0), ("a1", 0.2), ("b0", 0.5), ("b1", 0.7)):
        d = tmp_path / name
        d.mkdir()
        rows = [{"step": i, "reward/mean": i / 10 + shift, "reward/accuracy": 0.0,
                 "train/tokens": 100.0, "time/step_s": 0.5, "train/optimizer_steps": 2 * (i + 1)}
                for i in range(5)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "eval.jsonl").write_text(json.dumps({"after": 5, "eval/accuracy": shift}) + "\n")
        dirs.append(d)
    runs = [plot.load_run(d) for d in dirs]
    fig = plot.plot(runs, labels=["a", "a", "b", "b"], x="tokens")
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert {"reward", "eval"} <= set(axes) and "reward parts" not in axes  # accuracy: all zero
    assert not any("reward/accuracy" in ln.get_label() for a in fig.axes for ln in a.lines)
    ax = axes["reward"]
    assert ax.get_xlabel() == "trained tokens"
    assert [ln.get_label() for ln in ax.lines] == ["a: reward/mean", "b: reward/mean"]
    assert list(ax.lines[0].get_xdata()) == [100, 200, 300, 400, 500]
    assert list(ax.lines[0].get_ydata()) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])  # the mean
    assert len(ax.collections) == 2                           # one band per label
    assert list(axes["eval"].lines[0].get_xdata()) == [500]   # after step 5: where it ended
    assert fig._suptitle.get_text() == "a vs b"
    legend = ax.get_legend()
    assert legend.get_bbox_to_anchor().x0 > ax.get_window_extent().x1 - 1  # outside the data
    fig = plot.plot(runs[:1], x="optimizer_steps")
    assert fig.axes[0].get_xlabel() == "optimizer steps"
    assert list(fig.axes[0].lines[0].get_xdata()) == [2, 4, 6, 8, 10]
    out = tmp_path / "ab.png"
    assert plot.main([*map(str, dirs[:2]), "--labels", "a,b", "--x", "tokens", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.main([str(dirs[0]), "--labels", "a,b"]) == 2


def _plot_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("plot", ROOT / "launch" / "plot.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    return plot


def test_plot_seed_bands_on_a_common_grid_for_time_and_tokens(tmp_path):
    """3 seeds x 2 labels whose steps fall at different token counts and times: each label's band
    and mean are the seeds' curves interpolated onto one grid (every x any seed has within the
    range all cover), smoothed first with --smooth; a metric absent from some rows is bridged;
    y axis labelled with the key, the time axis with start-up included, one legend entry per
    label; .pdf and .svg by the extension."""
    plot = _plot_module()
    dirs, runs = [], {}
    for label, shift in (("a", 0.0), ("b", 1.0)):
        for seed in range(3):
            d = tmp_path / f"{label}{seed}"
            d.mkdir()
            T, D, E = 100 + 10 * seed, 1.0 + 0.2 * seed, 5.0 + seed    # tokens, s per step, start-up
            rows = [{"step": i, "train/tokens": float(T), "time/step_s": D, "time/elapsed_s": E + (i + 1) * D,
                     **({} if (seed, i) == (0, 2) else {"reward/mean": 0.1 * i + shift + 0.01 * seed})}
                    for i in range(6)]
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            dirs.append(d)
            runs[(label, seed)] = (T, D, E, shift)
    loaded = [plot.load_run(d) for d in dirs]
    labels = ["a"] * 3 + ["b"] * 3

    def at(g, x, label):  # each seed's curve is linear in x (its steps are evenly spaced): exact
        ys = []
        for seed in range(3):
            T, D, E, shift = runs[(label, seed)]
            i = g / T - 1 if x == "tokens" else (g - E) / D - 1
            ys.append(0.1 * i + shift + 0.01 * seed)
        return ys

    def x_of(seed, i, x):  # where step i of seed `seed` (label a) ends
        T, D, E, _ = runs[("a", seed)]
        return (i + 1) * T if x == "tokens" else E + (i + 1) * D

    for x in ("tokens", "time"):
        grid, mean, lo, hi = plot.band(loaded[:3], "reward/mean", x)
        xs = {round(x_of(seed, i, x), 9) for seed in range(3) for i in range(6) if (seed, i) != (0, 2)}
        lo_x, hi_x = max(x_of(seed, 0, x) for seed in range(3)), x_of(0, 5, x)
        assert grid == pytest.approx(sorted(v for v in xs if lo_x - 1e-9 <= v <= hi_x + 1e-9))
        assert 300.0 not in grid                                   # seed 0's step 2 has no value
        assert mean == pytest.approx([sum(at(g, x, "a")) / 3 for g in grid])
        assert lo == pytest.approx([min(at(g, x, "a")) for g in grid])
        assert hi == pytest.approx([max(at(g, x, "a")) for g in grid])
        fig = plot.plot(loaded, keys=["reward/mean"], labels=labels, x=x)
        ax = fig.axes[0]
        assert list(ax.lines[0].get_xdata()) == pytest.approx(grid)        # the plotted mean
        assert list(ax.lines[0].get_ydata()) == pytest.approx(mean)
        assert len(ax.collections) == 2                                    # one band per label
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b"]
        assert ax.get_ylabel() == "reward/mean"
    assert ax.get_xlabel() == "wall time (s, start-up included)"
    # --smooth: the band and the mean are the smoothed curves', the raw mean faint behind
    grid, mean, lo, hi = plot.band(loaded[3:], "reward/mean", "tokens", smooth=0.6)
    raw = plot.band(loaded[3:], "reward/mean", "tokens")
    assert mean != pytest.approx(raw[1]) and grid == raw[0]
    fig = plot.plot(loaded, keys=["reward/mean"], labels=labels, x="tokens", smooth=0.6)
    lines = fig.axes[0].lines
    assert len(lines) == 4 and list(lines[3].get_ydata()) == pytest.approx(mean)
    assert list(lines[2].get_ydata()) == pytest.approx(raw[1]) and lines[2].get_alpha() == 0.25
    # several keys in a panel: each label once, each key once
    fig = plot.plot(loaded, keys=["time/"], labels=labels, x="tokens")
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == [
        "a", "b", "time/elapsed_s", "time/step_s"]
    for ext, magic in ((".pdf", b"%PDF"), (".svg", b"<?xml")):
        out = tmp_path / f"f{ext}"
        assert plot.main([*map(str, dirs), "--labels", ",".join(labels), "--x", "time", "-o", str(out)]) == 0
        assert out.read_bytes().startswith(magic)
    # a run without time/elapsed_s (older records): the time axis says what it leaves out
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward/mean": i, "time/step_s": 1.0})
                                               + "\n" for i in range(3)))
    fig = plot.plot([plot.load_run(old)], x="time")
    assert fig.axes[0].get_xlabel().startswith("wall time (s, steps only: start-up")
    assert list(fig.axes[0].lines[0].get_xdata()) == [1.0, 2.0, 3.0]
    fig = plot.plot([loaded[0], plot.load_run(old)], keys=["reward/mean"], x="time")  # one axis for both
    assert fig.axes[0].get_xlabel().startswith("wall time (s, steps only")
    assert list(fig.axes[0].lines[0].get_xdata())[:2] == [1.0, 2.0]
    # a resumed run: its clock starts again, its segment drawn after the kept rows
    rows = [{"step": i, "time/elapsed_s": e, "time/step_s": 1.0} for i, e in enumerate([10, 12, 5, 7])]
    assert plot.step_x(rows, "time") == {-1: 9.0, 0: 10, 1: 12, 2: 17, 3: 19}
