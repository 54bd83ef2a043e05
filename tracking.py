"""What a run writes about itself (docs/metrics.md): :class:`Recorder` (rank 0: the record files,
one console line per step, the trackers of trackers.py), the start-up summary, and
:func:`quiet_other_ranks` (library warnings once).
"""
from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import config as C
from failures import Fatal
from trackers import TrackerError, Trackers

ONCE = {  # counted every step, said the first step it is above 0: a step did not do as asked
    "train/oversized_sequences": "{n} sequence(s) longer than train.micro_batch_tokens, each alone "
                                 "in a micro-batch over that budget (nothing splits a sequence)",
    "train/routing_fallback": "{n} episode(s) without the engine's routing: model.moe_routing_replay "
                              "keeps the trainer's own routing for their tokens"}


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
        try:
            trackers = Trackers.open(cfg.run.report_to, out_dir, C.to_dict(cfg),
                                     run_name=out_dir.resolve().name, start_step=start,
                                     verbose=cfg.run.verbose)
        except TrackerError as e:  # one line naming the tracker, no traceback
            raise Fatal(str(e)) from None
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
    runs = [[r for _, r in run]  # a run of consecutive ranks has one rank - position
            for _, run in itertools.groupby(enumerate(ranks), lambda ir: ir[1] - ir[0])]
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
    from transformers.utils import logging as hf_logging  # train.py imported transformers already
    hf_logging.disable_progress_bar()
    if rank == 0:
        return
    import logging
    warnings.filterwarnings("ignore")
    for name in ("transformers", "torch", "data", "py.warnings"):
        logging.getLogger(name).setLevel(logging.ERROR)
    hf_logging.set_verbosity_error()
