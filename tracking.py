"""What a run writes about itself (docs/metrics.md): :class:`Recorder` (rank 0: the record files,
one console line per step, the trackers), :class:`Trackers` (TensorBoard, W&B, SwanLab, each
package imported only when asked for), and :func:`quiet_other_ranks` (library warnings once).
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import config as C
from errors import one_line
from failures import Fatal

DEFAULT_PROJECT = "grpo"  # W&B / SwanLab project unless the caller or the environment names one
ONCE = {  # counted every step, said the first step it is above 0: a step did not do as asked
    "train/oversized_sequences": "{n} sequence(s) longer than train.micro_batch_tokens, each alone "
                                 "in a micro-batch over that budget (nothing splits a sequence)",
    "train/routing_fallback": "{n} episode(s) without the engine's routing: model.moe_routing_replay "
                              "keeps the trainer's own routing for their tokens"}


class TrackerError(Exception):
    """A tracker could not start. The message is one line: `run.report_to: <name>: <why>`."""


class Trackers:
    """The open trackers of this run; with none, every call is a no-op (other ranks, CPU demo)."""

    def __init__(self, backends: list | None = None):
        self._live = list(backends or [])

    @property
    def names(self) -> list[str]:
        """The trackers still receiving calls."""
        return [b.name for b in self._live]

    @classmethod
    def open(cls, names: list[str], out_dir: Path | str, config: dict, run_name: str | None = None,
             project: str | None = None, start_step: int = 0, verbose: bool = False) -> "Trackers":
        """Start each named tracker (rank 0 only). `config` is the resolved config as a nested dict
        of sections. `start_step` > 0 marks a resumed run: TensorBoard then drops the earlier
        events at or after it. `verbose` (run.verbose): W&B prints its end-of-run history and
        summary block (off: only the run's link). Raises TrackerError naming the first tracker
        that fails; the ones already started are closed first."""
        for i, name in enumerate(names):
            if name not in C.TRACKERS:
                raise TrackerError(f"run.report_to: unknown tracker {name!r} "
                                   f"(choose from {', '.join(C.TRACKERS)})")
            if name in names[:i]:
                raise TrackerError(f"run.report_to: {name} is listed twice")
        out_dir, config = Path(out_dir), _plain(config)
        opened: list = []
        for name in names:
            try:
                opened.append(_BACKENDS[name](out_dir, config, run_name, project, start_step,
                                              verbose))
            except Exception as e:  # noqa: BLE001 - any start failure: one line naming the tracker
                for b in opened:
                    try:
                        b.close(failed=True)
                    except Exception:  # noqa: BLE001 - the first error is the one to show
                        pass
                raise TrackerError(f"run.report_to: {name}: {one_line(e, typed=False)}") from e
        return cls(opened)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """One step's metrics (floats/ints; nan and inf allowed; keys may come and go)."""
        self._each("log", step, metrics, step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """A few decoded samples of this step, one dict per row, e.g. {"index", "response",
        "reward", <reward parts>..., "version"}; a nested dict value (parts) becomes `key/sub`
        columns. Call it after `log(metrics, step)` of the same step (W&B drops earlier steps)."""
        rows = [_flat_row(r) for r in rows]
        if not rows:
            return
        columns = list(dict.fromkeys(k for r in rows for k in r))
        self._each("log_samples", step, step, columns, [[r.get(c) for c in columns] for r in rows])

    def close(self, failed: bool = False) -> None:
        """Flush and finish every live tracker; `failed=True` marks the run as crashed where the
        tracker has such a state (W&B exit code 1, SwanLab CRASHED). Safe to call twice."""
        self._each("close", None, failed=failed)
        self._live = []

    def _each(self, method: str, step: int | None, *args, **kwargs) -> None:
        for b in list(self._live):
            try:
                getattr(b, method)(*args, **kwargs)
            except (Exception, SystemExit) as e:  # noqa: BLE001 - a tracker never stops training
                self._live.remove(b)
                where = f"step {step}" if step is not None else "close"
                print(f"warning: tracker {b.name} failed at {where} ({method}): "
                      f"{one_line(e)}; no further calls to it",
                      file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the run's records
class Recorder:
    """Everything rank 0 writes about the run while it trains: `metrics.jsonl`, `samples.jsonl`
    (`run.log_samples`; -1: every episode), `eval.jsonl`, `eval/step_N.jsonl`, the console line
    and the trackers."""

    def __init__(self, out_dir: Path, n_samples: int, start: int, total: int, trackers: Trackers):
        self.out_dir, self.n_samples, self.total, self.trackers = Path(out_dir), n_samples, total, trackers
        resume_records(self.out_dir, start)  # what a stopped run logged of the steps it redoes
        self.metrics = open(self.out_dir / "metrics.jsonl", "a")
        self.samples = open(self.out_dir / "samples.jsonl", "a")
        self.t_open = self.t_last = time.perf_counter()  # t_open: before the models load
        self.step_times: list[float] = []
        self.evals: list[tuple[int, dict]] = []
        self.said: set[str] = set()  # the ONCE keys already said

    @classmethod
    def open(cls, cfg: C.Config, out_dir: Path, start: int) -> "Recorder":
        """Rank 0, once the run is known to start: config.toml (what runs now), the trackers (one
        that cannot start stops the run here, before anything is built), the run's files."""
        out_dir.mkdir(parents=True, exist_ok=True)
        with _writing(out_dir / "config.toml"):
            (out_dir / "config.toml").write_text(C.dump_toml(cfg))
        trackers = Trackers.open(cfg.run.report_to, out_dir, C.to_dict(cfg),
                                 run_name=out_dir.resolve().name, start_step=start,
                                 verbose=cfg.run.verbose)
        return cls(out_dir, cfg.run.log_samples, start, cfg.run.steps, trackers)

    def begin(self) -> None:
        """The loop starts now (the ETA measures steps, not start-up)."""
        self.t_last = time.perf_counter()

    def step(self, m: dict, episodes: list, advantages: list[float], problems: dict) -> None:
        """One step: its metrics and samples to the files and trackers, one console line.
        `advantages[i]` is episode i's; `problems` maps a dataset index to its Problem (the
        sample rows carry its text and gold answer). Adds `time/elapsed_s` (docs/metrics.md)."""
        m["time/elapsed_s"] = time.perf_counter() - self.t_open
        with _writing(self.out_dir / "metrics.jsonl"):
            self.metrics.write(json.dumps(m) + "\n")
            self.metrics.flush()
        n = len(episodes) if self.n_samples < 0 else self.n_samples
        rows = [{"index": e.index, **({"source": e.source} if getattr(e, "source", "") else {}),
                 "group": e.group, "version": e.version,
                 "problem": problems[e.index].marked, "gold": problems[e.index].answer,
                 "reward": e.reward, "advantage": a, "parts": e.parts, "info": e.info,
                 "length": sum(e.loss_mask) if getattr(e, "loss_mask", None) else len(e.response_ids),
                 "truncated": e.truncated, "response": e.text,
                 **({"turns": e.turns} if getattr(e, "turns", None) else {})}  # multi-turn: every turn
                for e, a in list(zip(episodes, advantages))[:n]]
        with _writing(self.out_dir / "samples.jsonl"):
            for r in rows:
                self.samples.write(json.dumps({"step": m["step"], **r}) + "\n")
            self.samples.flush()
        self.trackers.log(m, m["step"])
        self.trackers.log_samples(m["step"], rows[:8] if self.n_samples < 0 else rows)
        now = time.perf_counter()
        self.step_times.append(now - self.t_last)
        self.t_last = now
        print(self.line(m), flush=True)
        if m.get("train/dropped_groups", 0) > 0:  # DAPO's refill bound hit: said every such step
            print(dropped_note(m, len({e.group for e in episodes})), file=sys.stderr, flush=True)
        for key in [k for k in ONCE if m.get(k, 0) > 0 and k not in self.said]:
            self.said.add(key)
            print(f"warning: step {m['step'] + 1}: {ONCE[key].format(n=int(m[key]))}; counted "
                  f"every step as {key} (said once)", file=sys.stderr, flush=True)

    def line(self, m: dict) -> str:
        """The console line of one step."""
        recent = sorted(self.step_times[-10:])
        eta = recent[len(recent) // 2] * (self.total - m["step"] - 1) if recent else 0.0
        parts = " ".join(f"{k[7:]} {v:.3f}" for k, v in m.items()
                         if k.startswith("reward/") and k not in ("reward/mean", "reward/errors"))
        evals = " ".join(f"{k[5:]} {v:.3f}" for k, v in m.items() if k.startswith("eval/")
                         and not k.endswith(("/n", "/samples", "/response_len", "/skipped_rows")))
        lpdiff = f"{m['logprob_diff/max']:.1e}" if "logprob_diff/max" in m else "-"  # all stale: "-"
        clip = (f"clip {m['train/clip_frac_low'] + m['train/clip_frac_high']:.3f} "
                if "train/clip_frac_low" in m and "train/clip_frac_high" in m else "")
        return (f"step {m['step'] + 1}/{self.total} | v{m['weight_version']} | "
                f"reward {m['reward/mean']:.3f} ({parts}) | len {m['response_len/mean']:.1f} | "
                f"loss {m.get('loss', 0):+.4f} gnorm {m.get('grad_norm', 0):.3f} {clip}"
                f"ent {m.get('entropy', 0):.2f} lpdiff {lpdiff} | "
                f"gen {m['time/generate_s']:.2f}s {m.get('time/gen_tokens_per_s', 0):.0f} tok/s"
                f" | train {m['time/train_s']:.2f}s {m.get('time/train_tokens_per_s', 0):.0f} "
                f"tok/s | sync {m['time/sync_s']:.2f}s | step {m['time/step_s']:.2f}s "
                f"ETA {_duration(eta)}" + (f" | eval {evals}" if evals else ""))

    def evaluation(self, after: int, version: int, metrics: dict, rows: list[dict],
                   settings: dict) -> None:
        """One evaluation (after `after` rollout steps), see :func:`write_evaluation`."""
        write_evaluation(self.out_dir, after, version, metrics, rows, settings=settings)
        self.evals.append((after, metrics))
        if after == 0:  # before the first step: no step row carries it, so the trackers get it here
            self.trackers.log(metrics, 0)

    def summary(self, wall_s: float, steps: int, checkpoint: str | None) -> str:
        """The end-of-run line: wall time, best and last evaluation, where the checkpoint is."""
        out = f"done: {steps} steps in {_duration(wall_s)}"
        if self.evals:
            key = next((k for k in ("eval/accuracy", "eval/reward") if k in self.evals[-1][1]),
                       next((k for k in self.evals[-1][1] if k.startswith("eval/")), None))
            if key:
                best = max(self.evals, key=lambda e: e[1].get(key, float("-inf")))
                out += (f" | {key} best {best[1][key]:.4f} (after step {best[0]}), "
                        f"last {self.evals[-1][1][key]:.4f} (after step {self.evals[-1][0]})")
        return out + f" | checkpoint: {checkpoint or 'none written (run.keep_last = 0)'}"

    def say(self, text: str) -> None:
        print(text, flush=True)

    def close(self, failed: bool = False) -> None:
        self.trackers.close(failed=failed)
        self.metrics.close()
        self.samples.close()


def dropped_note(m: dict, n_groups: int) -> str:
    """The line of a step whose groups with equal rewards (no learning signal) reached the update:
    DAPO's refill ran out of rounds (`rollout.max_refill_rounds`)."""
    d = int(m["train/dropped_groups"])
    return (f"warning: step {m['step'] + 1}: {d} of {n_groups} groups have equal rewards after "
            f"{int(m.get('rollout/refill_rounds', 0))} refill round(s) "
            f"({int(m.get('rollout/prompts_drawn', 0))} prompts drawn; rollout.max_refill_rounds): "
            "masked out of the update" + ("; every group is: this step's update is a no-op "
                                          "(loss 0, gradient norm 0)" if d >= n_groups else ""))


def startup_summary(cfg: C.Config, roles: list[str], device: str, n_params: int | dict, n_problems: int,
                    n_skipped: int, n_eval: int, plan: dict, sources: str) -> str:
    """Who does what, on what, with which data and config, and where the run starts. `n_params`:
    trainer.parameter_counts (total, trainable, optimizer-state bytes), or a plain count."""
    by_role: dict[str, list[int]] = {}
    for r, role in enumerate(roles):
        by_role.setdefault(role, []).append(r)
    who = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_runs(rs)} {role}" for role, rs in by_role.items())
    ev = cfg.eval
    lines = [f"== {len(roles)} rank(s) on {device}: {who} ({cfg.rollout.engine} engine)",
             f"   model {cfg.model.path} ({_params_text(cfg.model, n_params)}; engines in "
             f"{cfg.model.dtype}) | data {cfg.data.source or _mixture(cfg.data.sources)}: "
             f"{n_problems} training problems "
             f"({n_skipped} rows skipped)" + (f", {n_eval} {ev.split} problems for evaluation"
                                              if n_eval else ""),
             f"   config {sources} -> {Path(cfg.run.out_dir) / 'config.toml'} | trackers: "
             f"{', '.join(cfg.run.report_to) or 'none'}"]
    if cfg.loss.kl_in_reward and cfg.loss.kl_estimator == "k3":
        lines.append("   note: loss.kl_in_reward with loss.kl_estimator = k3; verl's and EasyR1's "
                     "reward KL default to k1 (--loss.kl_estimator=k1 to match them)")
    plain = [e for e in cfg.data.sources if "reward_functions" not in e]  # graded by [reward], [eval]
    missing = (sorted({f["name"] for f in cfg.reward.functions} - {f["name"] for f in ev.functions})
               if plain or not cfg.data.sources else [])  # (a source's own grade both)
    if n_eval and missing:
        lines.append(f"   note: reward {', '.join(missing)} is used for training but not for "
                     f"evaluation ([eval] functions: {', '.join(f['name'] for f in ev.functions)})")
    p = plan["progress"]
    lines.append(f"== resumed from {plan['path']} at step {p.step} (weight version {p.version}); "
                 f"steps {p.step} -> {cfg.run.steps} ==" if plan["path"] else
                 f"== fresh start: steps 0 -> {cfg.run.steps}, {cfg.rollout.prompts_per_step} "
                 f"prompts x {cfg.rollout.group_size} samples per step")
    if plan["path"] and cfg.rollout.stale == "drop" and p.stream:
        lines.append("   the engines' prompt streams resume at " + ", ".join(
            f"batch {b} (+{g} groups)" for b, g in p.stream))
    changed = plan.get("other_changes", []) + (plan.get("meaning_changes", []) if plan["path"] else [])
    if changed:  # the meaning changes are here only when run.allow_config_change let them pass
        lines.append("   changed since the checkpoint: " + "; ".join(f"{k} {a!r} -> {b!r}"
                                                                    for k, a, b in changed))
    return "\n".join(lines)


def _runs(ranks: list[int]) -> str:
    """[0, 1, 3, 4] as "0-1,3-4" (cluster.layout = "per_node" interleaves the roles)."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def _mixture(entries: list[dict]) -> str:
    """data.sources as "geo (synthetic) 0.75 + txt (synthetic-text) 0.25" (the prompts' shares)."""
    total = sum(e["weight"] for e in entries)
    return " + ".join(f"{e['name']} ({e['source']}) {e['weight'] / total:.2g}" for e in entries)


def _params_text(mc: C.ModelConfig, n: int | dict) -> str:
    """"0.71M parameters, 0.03M trainable (LoRA rank 8, alpha 16), AdamW state 0.2 MiB"."""
    if not isinstance(n, dict):
        return f"{n / 1e6:.2f}M parameters"
    how = (f"{n['trainable'] / 1e6:.3g}M trainable (LoRA rank {mc.lora_rank}, alpha "
           f"{mc.lora_alpha:g})" if mc.lora_rank else "all trainable")
    return (f"{n['total'] / 1e6:.2f}M parameters, {how}, AdamW state "
            f"{n['optimizer_bytes'] / 2**20:.3g} MiB")


def write_evaluation(out_dir: Path, after: int, version: int, metrics: dict, rows: list[dict],
                     checkpoint: str | None = None, settings: dict | None = None) -> Path:
    """An evaluation's metrics as one line of `eval.jsonl`, with its `settings`
    (evaluation.settings), the `checkpoint` an `--eval-only` named and its `generations` file:
    `eval/step_<after>.jsonl`, or `eval/<checkpoint folder>.eval-only.jsonl`; where that exists
    (a second `--eval-only`, a step evaluated again after a resume) the first free
    `<name>.<k>.jsonl`, said: an evaluation's generations never replace another's."""
    folder = Path(out_dir) / "eval"
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{Path(checkpoint).name}.eval-only" if checkpoint else f"step_{after:06d}"
    path, k = folder / f"{stem}.jsonl", 1
    while path.exists():
        path, k = folder / f"{stem}.{k}.jsonl", k + 1
    if k > 1:
        print(f"note: generations in {path} ({stem}.jsonl holds an earlier evaluation's)", flush=True)
    with _writing(path), open(path, "x") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    with _writing(Path(out_dir) / "eval.jsonl"), open(Path(out_dir) / "eval.jsonl", "a") as f:
        f.write(json.dumps({"after": after, "weight_version": version, **(settings or {}),
                            **metrics, "generations": path.relative_to(out_dir).as_posix(),
                            **({"checkpoint": str(checkpoint)} if checkpoint else {})}) + "\n")
    return path


RECORDS = ("metrics.jsonl", "samples.jsonl", "eval.jsonl")


def _kept(name: str, row: dict, start: int) -> bool:
    """Whether a row stays when the run resumes at step `start`: a step's rows precede its
    checkpoint; the evaluation `after` k steps ran in step k - 1 (k = 0: before the first step,
    run again by a fresh start); `--eval-only` rows always stay."""
    if name == "eval.jsonl":
        return "checkpoint" in row or row["after"] < start or row["after"] == start > 0
    return row["step"] < start


def resume_records(out_dir: Path, start: int) -> None:
    """A run starting at step `start` keeps exactly the rows of the steps before it in every
    record file; the others move to `<name>.abandoned.jsonl`. A torn last line is dropped, said
    in one line. Every file is checked before anything moves: a line that is no record of this
    run is a :class:`Fatal` naming the file and line."""
    plans = []
    for name in RECORDS:
        path = out_dir / name
        if not path.exists():
            continue
        lines = [ln for ln in path.read_text(errors="replace").split("\n") if ln.strip()]
        rows, torn = [], None
        for n, ln in enumerate(lines, 1):
            try:
                rows.append((ln, _kept(name, json.loads(ln), start)))
            except json.JSONDecodeError as e:
                if n < len(lines):
                    raise Fatal(f"{path}:{n}: not JSON ({e.msg}); only a last line cut off "
                                "mid-write is dropped by itself: repair or move the file") from None
                torn = ln
            except (KeyError, TypeError):
                raise Fatal(f"{path}:{n}: not a record of this run (no "
                            f"{'after' if name == 'eval.jsonl' else 'step'} field): repair or "
                            "move the file") from None
        plans.append((path, rows, torn))
    for path, rows, torn in plans:
        if torn is not None:
            print(f"warning: {path}: its last line was cut off mid-write ({len(torn)} bytes, not "
                  "JSON; a full disk or a kill while writing): dropped", file=sys.stderr, flush=True)
        gone = [ln for ln, keep in rows if not keep]
        if gone:
            abandoned = path.with_name(path.stem + ".abandoned.jsonl")
            with _writing(abandoned), open(abandoned, "a") as f:
                f.writelines(ln + "\n" for ln in gone)
        if gone or torn is not None:  # the file itself last, replaced whole (never half written)
            tmp = path.with_name(path.name + ".tmp")
            with _writing(path):
                tmp.write_text("".join(ln + "\n" for ln, keep in rows if keep))
                os.replace(tmp, path)


@contextlib.contextmanager
def _writing(path: Path):
    """An OSError while writing `path` (a full disk) stops the run with one line naming the file
    and its folder (:class:`failures.Fatal`; rank 0 writes the records)."""
    try:
        yield
    except OSError as e:
        why = e.strerror or str(e)
        if e.errno == errno.ENOSPC:
            try:
                free = f"{shutil.disk_usage(path.parent).free / 2**20:.1f} MiB free"
            except OSError:
                free = "free space unknown"
            why = f"No space left on device ({path.parent}: {free})"
        raise Fatal(f"cannot write {path}: {why}; free space or fix the folder, then restart: "
                    "the run resumes from its last checkpoint") from e


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def quiet_other_ranks(rank: int) -> None:
    """Library warnings (transformers, torch, FSDP) once for the job: only rank 0 prints them;
    no rank draws weight-loading progress bars. Errors and this project's lines stay."""
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    if rank == 0:
        return
    import logging
    warnings.filterwarnings("ignore")
    for name in ("transformers", "torch", "data", "py.warnings"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


# ----------------------------------------------------------------------------- the three backends
class _TensorBoard:
    name = "tensorboard"

    def __init__(self, out_dir: Path, config: dict, run_name, project, start_step: int,
                 verbose: bool = False):
        try:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams
        except ImportError as e:
            raise RuntimeError(f"package not installed ({one_line(e, typed=False)}); "
                               "pip install tensorboard") from e
        # flush_secs: the default 120 s makes a live dashboard lag two minutes behind.
        self.writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"), flush_secs=10,
                                    purge_step=start_step or None)
        # Only the session-start record of the hparams plugin: without an experiment record,
        # TensorBoard offers every scalar tag as a metric column beside the hyperparameters.
        _, session_start, _ = hparams({k: _hparam(v) for k, v in _flatten(config).items()}, {})
        self.writer.file_writer.add_summary(session_start)
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", start_step)

    def log(self, metrics: dict, step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def log_samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        self.writer.add_text("samples", _markdown_table(columns, rows), step)

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class _WandB:
    name = "wandb"

    def __init__(self, out_dir: Path, config: dict, run_name, project, start_step: int,
                 verbose: bool = False):
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError(f"package not installed ({one_line(e, typed=False)}); pip install wandb") from e
        self.wandb = wandb
        try:
            mode = os.environ.get("WANDB_MODE", "online")
            online = mode not in ("offline", "dryrun", "disabled")
            if online and not wandb.login(prompt=False, verify=False):  # reads keys, no network
                raise RuntimeError("no API key for online mode: set WANDB_API_KEY or run "
                                   "`wandb login`, or set WANDB_MODE=offline")
            out_dir.mkdir(parents=True, exist_ok=True)  # wandb makes <dir>/wandb/ but not <dir>
            project = project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT
            # quiet: no history / summary block at exit (the run's link still prints online)
            settings = None if verbose else wandb.Settings(quiet=True)
            self.run = wandb.init(dir=str(out_dir), name=run_name, config=config, project=project,
                                  settings=settings)
        except BaseException:
            # login()/init() set up a process-wide W&B state from the environment of the moment;
            # drop it so that a later start reads the environment afresh.
            wandb.teardown()
            raise

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def log_samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        # One immutable table per step, like TRL: the UI steps through them with a slider.
        table = self.wandb.Table(columns=columns, data=rows, allow_mixed_types=True)
        self.run.log({"samples": table}, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
        # finish() can return before wandb-core has written the last records; teardown waits for
        # it (wandb also calls it at exit, "not reliable in certain setups" says its docstring).
        self.wandb.teardown()


class _SwanLab:
    name = "swanlab"

    def __init__(self, out_dir: Path, config: dict, run_name, project, start_step: int,
                 verbose: bool = False):
        with warnings.catch_warnings():  # swanlab 0.6 imports the deprecated pynvml shim
            warnings.simplefilter("ignore", FutureWarning)
            try:
                import swanlab
                from swanlab.error import KeyFileError
                from swanlab.package import get_key
            except ImportError as e:
                raise RuntimeError(f"package not installed ({one_line(e, typed=False)}); "
                                   "pip install swanlab") from e
        mode = os.environ.get("SWANLAB_MODE", "cloud")
        if mode == "cloud":  # swanlab would otherwise ask on the terminal (and hang under torchrun)
            try:
                get_key()
            except KeyFileError:
                raise RuntimeError("no API key for cloud mode: set SWANLAB_API_KEY or run "
                                   "`swanlab login`, or set SWANLAB_MODE=offline") from None
        self.swanlab = swanlab
        # swanlab replaces the console streams' write (copying every line into its folder) and
        # the excepthook; what they were, to give them back when its finish fails
        self._console = ((sys.stdout, sys.stdout.write), (sys.stderr, sys.stderr.write), sys.excepthook)
        self.run = swanlab.init(
            project=project or os.environ.get("SWANLAB_PROJ_NAME") or DEFAULT_PROJECT,
            experiment_name=run_name, config=config, logdir=str(out_dir / "swanlog"))

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def log_samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        table = self.swanlab.echarts.Table().add(columns, [[_cell(v) for v in r] for r in rows])
        self.run.log({"samples": table}, step=step)

    def close(self, failed: bool = False) -> None:
        from swanlab.data.run import SwanLabRunState
        try:
            if failed:
                self.run.finish(SwanLabRunState.CRASHED, error="training failed")
            else:
                self.run.finish()
        except BaseException:
            self._give_back_console()
            raise

    def _give_back_console(self) -> None:
        """A finish that failed (a full disk) leaves swanlab's console proxies in place, which
        copy every later line into its folder and fail there: the console is ours again."""
        (out, out_write), (err, err_write), hook = self._console
        out.write, err.write, sys.excepthook = out_write, err_write, hook


_BACKENDS = {"tensorboard": _TensorBoard, "wandb": _WandB, "swanlab": _SwanLab}


# ----------------------------------------------------------------------------- helpers
def _plain(x):
    """The config as JSON types only (paths, tuples, enums become str / list)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _hparam(v):
    """TensorBoard's hparams take numbers, strings and bools; lists are shown as text."""
    return v if v is None or isinstance(v, (bool, int, float, str)) else json.dumps(v)


def _flat_row(row: dict) -> dict:
    out = {}
    for k, v in row.items():
        if isinstance(v, dict):
            out.update({f"{k}/{sub}": x for sub, x in v.items()})
        else:
            out[k] = v
    return out


def _cell(v):
    """SwanLab's table is JSON: a non-finite float would be written as null."""
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


_MD_ESCAPE = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", "|": "\\|", "\\": "\\\\",
                            "*": "\\*", "_": "\\_", "`": "\\`", "[": "\\[", "]": "\\]",
                            "#": "\\#", "\n": "<br>", "\r": ""})


def _markdown_table(columns: list[str], rows: list[list]) -> str:
    """A markdown table whose cells show the model's text literally: `<answer>` stays visible
    instead of being taken as HTML, and `*`, `_`, `|` as written."""
    def cell(v) -> str:
        if isinstance(v, float):
            v = f"{v:.4g}"
        return str(v).translate(_MD_ESCAPE)
    lines = ["| " + " | ".join(cell(c) for c in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)
