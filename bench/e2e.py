"""End-to-end step time: the CPU demo synchronous vs with one-step overlap, in one invocation.

    python bench/e2e.py                       # 3 rounds of 12 steps each way, 1 trainer + 1 engine
    python bench/e2e.py --steps 20 --nproc 3  # the demo's 2 trainers + 1 engine
    python bench/e2e.py --staleness 0,1,2,4 --partial   # engines k versions ahead (one JSON per run)
    python bench/e2e.py --staleness 0,4 --partial --engine vllm --nproc 3   # the same on vLLM
    python bench/e2e.py --engine-time 8b-h100 --steps 30 --warmup 10 --rounds 2   # generation on its own hardware, modelled

`--staleness K,...`: one run per k (rollout.max_staleness; loss.correction token_mask for k >= 1;
`--partial` adds a partial-rollout run of each k >= 1; `--engine vllm`: on the vLLM engine, with
`--rollout.max_model_len=512`, which needs a generation rank of its own, `--nproc 3`), on
`--max-new-tokens` (default 48) responses whose lengths spread as the random tiny model's EOS
draws make them; prints for each {"staleness", "partial", "tokens_per_s" (trained tokens over
the wall time of the steps after warm-up), "engine_idle_frac" (median over those steps but the
last k, where the stream is over and the engine has nothing left to make), "trainer_wait_frac"
(median),
over `--rounds` alternated runs (their medians; "tokens_per_s_each" every run's),
"staleness_mean", "staleness_max", "wall_s_to_reward" (seconds from the first step until the
step whose reward first reaches `--reward-threshold`, null if none)}.

`--engine-time MODEL` (generation that does not compete with the trainers for the CPU, as on
real hardware where it has its own devices): the engine's compute is replaced by a wall-clock
model of a vLLM engine (bench/engine_time.py: it sleeps, the CPU stays the trainers'), while the
rest is the real run: pipeline.Producer, its queue and staleness bound, weight versions and syncs,
partial rollouts through multiturn.generate, the trainers' compute. The time model, per call:
prefill `prefill_ms` a prompt token, then one decode step per position, `decode_ms +
decode_ms_per_seq * B` for B running samples; "8b-h100" (default figures): 0.032 ms a prefill
token, 6.18 ms + 0.297 ms x B a decode step, from a published vLLM 0.21 concurrency sweep of
Llama-3.1-8B on one H100 (TPOT 6.48 ms at concurrency 1, 10.94 ms at 16; prefill from 2 x 8e9
FLOP a token at half the H100's bf16 peak); "8b-a100": 0.10 ms, 12.9 ms + 0.41 ms x B (vLLM 0.23,
Llama-3.1-8B, A100-40GB: 75 tokens/s at concurrency 1, 6.6x at 8). Sources and the response
length model (log-normal, median max_new_tokens / 4, ~4% cut at max_new_tokens) in
bench/engine_time.py. Speed: a synchronous calibration run at scale 1 measures the modelled
generate seconds a step; every run's engine then scales its time so that a synchronous step's
generation (one batch at a time, waiting for its longest response) takes `--gen-ratio` (default
2) times the trainers' median train time over their last 4 steps (read from the run's
metrics.jsonl; `follow` is the calibration's generate seconds over the ratio), whatever this
machine's drift (`--engine-scale S`: a fixed scale instead). The ratio is the workload's
balance, the one free choice of the bench, and the same for every configuration (the same
hardware): generation-bound, as RL steps are (APRIL, arXiv 2509.18521: rollout generation more
than 90% of the runtime of synchronous RL frameworks); 2 is a generation share of 2/3 of a
synchronous step, below that. At 1 (an engine sized for the synchronous step) every k >= 1
is bound by the trainers and no scheduler can gain over k = 1. Runs with partial rollouts
generate `rollout.batches_in_flight = k + 1` batches at once (the next one starts while the
tails of earlier ones decode, their calls sharing the engine's decode steps as vLLM's do:
vllm_ahead.share_steps); the real hf engine generates one at a time. Measure past a long
warm-up (`--steps 30 --warmup 10`): step 0's train time holds one-off costs (~10x a step), and
an engine running k ahead fills its queue meanwhile, a head start the next steps train from
whatever the engine's speed (at 12 steps and a warm-up of 2 the k = 4 runs without partial
showed 0.78 train_frac where their steady state is 0.48, k = 1's). One JSON object: "modelled", one
entry per (k, partial) for k in `--staleness` (default 0,1,2,4) and partial off, "recompute" and
"keep" (k >= 1), the fields of the staleness runs plus "generate_s", "train_s" (medians a step),
"train_frac" (train time over wall time: tokens/s with the trainers' drifting speed divided out),
"reprefill_tokens" (a step's mean) and "batches_in_flight" (the most generated at once); "verdict", the issue's targets over them; "real", the
same sweep on the real hf engine (`--real-rounds`, default 1; 0: none).

Runs `train.py --config configs/tiny.toml` under torchrun (GRPO_BENCH_LAUNCH: another
launcher, :func:`launcher`), alternating synchronous
(max_staleness 0) and overlapped (1, with truncated importance sampling) runs for `--rounds`
rounds, and pools the steps after each run's warm-up. Prints one JSON object with medians:
sync_step_s, overlap_step_s, and the synchronous runs' generate_s, train_s, sync_s;
overlap_ratio = overlap_step_s / (max(generate_s, train_s) + sync_s), where 1.0 is a perfect
overlap. Also `overlap_ratio_same_step`: the median over overlapped steps of each step's time
over max(its generate, its train) + its sync, which no drift between runs can move (a
diagnostic of the overlap machinery; the target is judged on overlap_ratio).

This machine's speed drifts between two levels (~1.5x apart) over seconds, so a single pair of
runs gave overlap_ratio anywhere from 0.7 to 1.3; alternating rounds and pooling steps is what
makes the figure repeatable. The default is 2 processes because this machine has 2 cores: with
3 processes the overlapped phases compete for cores and the ideal max(generate, train) is not
reachable. Also reports the last-4-steps mean reward of the first round of each (overlap must
still learn).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(Path(__file__).resolve().parent) not in sys.path:  # imported, not run: after the core
    sys.path.append(str(Path(__file__).resolve().parent))  # (bench/sync.py must not shadow sync.py)
import engine_time  # noqa: E402  (bench/engine_time.py: the modelled engine's parameters)


def launcher() -> tuple[list[str], str]:
    """(the command that starts torchrun, the script its workers run): `python -m
    torch.distributed.run` and train.py, unless GRPO_BENCH_LAUNCH holds another pair as JSON
    `{"torchrun": [...], "entry": "..."}` (the tests' smoke run: their warm launcher,
    tests/warm.py, which forks the same torchrun and train.py instead of importing them)."""
    spec = os.environ.get("GRPO_BENCH_LAUNCH")
    if not spec:
        return [sys.executable, "-m", "torch.distributed.run"], str(ROOT / "train.py")
    spec = json.loads(spec)
    return list(spec["torchrun"]), str(spec["entry"])


def run(out: Path, nproc: int, steps: int, extra: list[str], timed: dict | None = None) -> list[dict]:
    """One torchrun launch of train.py (`timed`: of bench/engine_time.py, the modelled engine
    {"model", "scale"} in place of the hf one); its metrics.jsonl rows."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GRPO_DEVICE="cpu")
    torchrun, entry = launcher()
    script = [entry]
    if timed is not None:
        env["GRPO_ENGINE_TIME"] = json.dumps(timed)
        # the real launcher runs the script; the tests' warm one forks it as a module (tests/warm.py)
        script = ([str(ROOT / "bench" / "engine_time.py")] if entry == str(ROOT / "train.py")
                  else [entry, "-m", "bench.engine_time"])
    cmd = [*torchrun, "--standalone", f"--nproc_per_node={nproc}",
           *script, "--config", str(ROOT / "configs" / "tiny.toml"),
           f"--run.out_dir={out}", f"--run.steps={steps}", "--run.keep_last=0",
           '--reward.functions=[{name="target_fraction", weight=1.0}]', *extra]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def ahead(rows: list[dict], k: int, partial, warmup: int, threshold: float) -> dict:
    """One running-ahead run's figures (see the module docstring)."""
    med = lambda key: round(statistics.median(r.get(key, 0.0) for r in rows[warmup:]), 4)  # noqa: E731
    wall, reached = 0.0, None
    for r in rows:
        wall += r["time/step_s"]
        if reached is None and r["reward/mean"] >= threshold:
            reached = round(wall, 2)
    rest = rows[warmup:]
    # the last k steps train what is queued while the engine, the stream over (run.steps), has
    # nothing left to make: their idle is the run's end, not the scheduler's
    making = rows[warmup:len(rows) - k]
    return {"staleness": k, "partial": partial,
            "tokens_per_s": round(sum(r["train/tokens"] for r in rest) / sum(r["time/step_s"] for r in rest), 1),
            "engine_idle_frac": round(statistics.median(r.get("time/engine_idle_frac", 0.0) for r in making), 4),
            "trainer_wait_frac": med("time/trainer_wait_frac"),
            "staleness_mean": round(statistics.mean(r["rollout/staleness_mean"] for r in rest), 3),
            "staleness_max": max(r["rollout/staleness_max"] for r in rows),
            "generate_s": med("time/generate_s"), "train_s": med("time/train_s"),
            "reprefill_tokens": statistics.mean(r.get("rollout/reprefill_tokens", 0) for r in rest),
            "train_frac": round(sum(r["time/train_s"] for r in rest) / sum(r["time/step_s"] for r in rest), 4),
            "batches_in_flight": max(r.get("rollout/batches_in_flight", 1) for r in rows),
            "wall_s_to_reward": reached, "steps": len(rows)}


def sweep(a, plan: list, d: str, timed: dict | None = None, rounds: int | None = None) -> list[dict]:
    """Each (k, partial) of `plan` over `rounds` runs alternated with the others, every other
    round in reverse order (this machine drifts, and a fixed order would hand the drift to the
    plan's last configurations): the figures of every round's run, then their medians (`wall_s_to_reward`: the
    median of those that reached it). `partial`: False, True or "recompute" / "keep"."""
    got: dict = {c: [] for c in plan}
    for i in range(a.rounds if rounds is None else rounds):
        for k, partial in (plan if i % 2 == 0 else plan[::-1]):  # drift spread over the plan's order
            extra = [*a.engine_args, f"--rollout.max_new_tokens={a.max_new_tokens}"]
            if k:
                extra += [f"--rollout.max_staleness={k}", "--loss.correction=token_mask"]
            if partial:
                extra += [f"--rollout.partial={'true' if partial is True else partial}"]
            if partial and timed:  # the modelled engine shares its steps as vLLM's: k + 1 batches at once
                extra += [f"--rollout.batches_in_flight={k + 1}"]
            name = f"{'t' if timed else 'r'}k{k}{partial or ''}{i}"
            rows = run(Path(d) / name, a.nproc, a.steps, extra, timed)
            got[(k, partial)].append(ahead(rows, k, partial, a.warmup, a.reward_threshold))
    summary = []
    for (k, partial), runs in got.items():
        out = {"staleness": k, "partial": partial, "rounds": len(runs)}
        for key in ("tokens_per_s", "engine_idle_frac", "trainer_wait_frac", "staleness_mean",
                    "generate_s", "train_s", "train_frac"):
            out[key] = round(statistics.median(r[key] for r in runs), 4)
        out["staleness_max"] = max(r["staleness_max"] for r in runs)
        out["batches_in_flight"] = max(r["batches_in_flight"] for r in runs)
        reached = [r["wall_s_to_reward"] for r in runs if r["wall_s_to_reward"] is not None]
        out["wall_s_to_reward"] = round(statistics.median(reached), 2) if reached else None
        out["reprefill_tokens"] = round(statistics.median(r["reprefill_tokens"] for r in runs), 1)
        out["tokens_per_s_each"] = [r["tokens_per_s"] for r in runs]
        summary.append(out)
    return summary


def staleness_runs(a) -> None:
    """`--staleness`: one JSON line per configuration (plain runs, then with --partial partial
    ones), each over `--rounds` runs alternated with the others (:func:`sweep`)."""
    plan = [(k, False) for k in a.staleness] + [(k, True) for k in a.staleness if a.partial and k]
    with tempfile.TemporaryDirectory() as d:
        for out in sweep(a, plan, d):
            print(json.dumps(out), flush=True)


MODES = (False, "recompute", "keep")  # rollout.partial of the --engine-time runs


def calibrate(a, d: str) -> dict:
    """A synchronous run (k = 0) of the modelled engine at scale 1: its median generate time
    (`follow`, bench/engine_time.py) and the scale that makes it its median train time (where
    the runs' engines start before they follow the trainers)."""
    rows = run(Path(d) / "calibrate", a.nproc, a.steps, [f"--rollout.max_new_tokens={a.max_new_tokens}"],
               {"model": a.engine_time, "scale": 1.0})[a.warmup:]
    gen = statistics.median(r["time/generate_s"] for r in rows)
    train = statistics.median(r["time/train_s"] for r in rows)
    return {"generate_s_at_scale_1": round(gen, 4), "train_s": round(train, 4), "gen_ratio": a.gen_ratio,
            "scale": float(f"{a.gen_ratio * train / gen:.3g}"), "follow": round(gen / a.gen_ratio, 4)}


def verdict(rows: list[dict]) -> dict:
    """The issue's targets over the modelled runs: k = 4 "keep" against k = 0 and the best k = 1
    run, its engine idle and trainer wait, and "keep" against "recompute" at every k."""
    by = {(r["staleness"], r["partial"]): r for r in rows}
    tps = lambda k, p: by[(k, p)]["tokens_per_s"] if (k, p) in by else None  # noqa: E731
    out: dict = {}
    if (4, "keep") in by and (0, False) in by:
        keep4 = by[(4, "keep")]
        best1 = max((tps(1, p) for p in MODES if tps(1, p)), default=None)
        out = {"keep4_over_k0": round(keep4["tokens_per_s"] / tps(0, False), 3),
               "keep4_over_best_k1": round(keep4["tokens_per_s"] / best1, 3) if best1 else None,
               "keep4_engine_idle_frac": keep4["engine_idle_frac"],
               # the same ratios on train_frac: this machine's drift of the trainers' speed divided out
               "train_frac_keep4_over_k0": round(keep4["train_frac"] / by[(0, False)]["train_frac"], 3),
               "train_frac_keep4_over_best_k1": round(keep4["train_frac"] / max(
                   by[(1, p)]["train_frac"] for p in MODES if (1, p) in by), 3) if best1 else None,
               "keep4_trainer_wait_frac": keep4["trainer_wait_frac"]}
        out["met"] = {"keep4_over_k0 >= 1.5": out["keep4_over_k0"] >= 1.5,
                      "keep4_over_best_k1 >= 1.2": bool(best1) and out["keep4_over_best_k1"] >= 1.2,
                      "engine_idle <= 0.05": keep4["engine_idle_frac"] <= 0.05,
                      "trainer_wait <= 0.15": keep4["trainer_wait_frac"] <= 0.15}
    out["keep_over_recompute"] = {str(k): round(tps(k, "keep") / tps(k, "recompute"), 3)
                                  for k in sorted({k for k, _ in by}) if tps(k, "keep") and tps(k, "recompute")}
    out["keep_over_recompute_train_frac"] = {
        k: round(by[(int(k), "keep")]["train_frac"] / by[(int(k), "recompute")]["train_frac"], 3)
        for k in out["keep_over_recompute"]}
    return out


def engine_time_runs(a) -> None:
    """`--engine-time MODEL`: the staleness sweep (k in `--staleness`, each k >= 1 with partial
    off, "recompute" and "keep") on the modelled engine, then the same on the real hf engine
    (`--real-rounds`, 0: none); one JSON object."""
    ks = a.staleness if a.staleness is not None else [0, 1, 2, 4]
    plan = [(k, m) for k in ks for m in MODES if k or not m]
    with tempfile.TemporaryDirectory() as d:
        cal = calibrate(a, d) if a.engine_scale is None else {"scale": a.engine_scale, "follow": None}
        timed = {"model": a.engine_time, "scale": cal["scale"], "follow": cal["follow"]}
        modelled = sweep(a, plan, d, timed)
        real = sweep(a, plan, d, rounds=a.real_rounds) if a.real_rounds else []
    print(json.dumps({"engine_time": {"model": a.engine_time, **vars(engine_time.MODELS[a.engine_time]),
                                      "scale": cal["scale"], "follows_trainers": bool(cal["follow"]),
                                      "calibration": cal},
                      "steps": a.steps, "warmup": a.warmup, "nproc": a.nproc, "rounds": a.rounds,
                      "max_new_tokens": a.max_new_tokens, "modelled": modelled,
                      "verdict": verdict(modelled), "real": real, "real_rounds": a.real_rounds}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each configuration, alternated")
    ap.add_argument("--staleness", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="comma-separated k: one running-ahead run each (see the docstring)")
    ap.add_argument("--partial", action="store_true", help="with --staleness: partial rollouts too")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--reward-threshold", type=float, default=0.3)
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    ap.add_argument("--engine-time", choices=sorted(engine_time.MODELS), default=None,
                    help="the modelled engine (bench/engine_time.py): the sweep of the docstring")
    ap.add_argument("--engine-scale", type=float, default=None,
                    help="with --engine-time: a fixed scale of the time model (default: it follows the "
                         "trainers' train time, bench/engine_time.py)")
    ap.add_argument("--gen-ratio", type=float, default=2.0,
                    help="with --engine-time: a synchronous step's generation time over its train time "
                         "(the workload's balance; see the docstring)")
    ap.add_argument("--real-rounds", type=int, default=1,
                    help="with --engine-time: rounds of the same sweep on the real hf engine (0: none)")
    a = ap.parse_args()
    a.engine_args = ["--rollout.engine=vllm", "--rollout.max_model_len=512"] if a.engine == "vllm" else []
    last = max(a.staleness or [0, 1, 2, 4])
    if (a.engine_time is not None or a.staleness is not None) and a.steps <= a.warmup + last:
        raise SystemExit(f"--steps must exceed --warmup + the largest k ({a.warmup} + {last}): engine "
                         "idle is the median over the steps after warm-up but the last k")
    if a.engine_time is not None:
        return engine_time_runs(a)
    if a.staleness is not None:
        return staleness_runs(a)
    sync: list[list[dict]] = []
    over: list[list[dict]] = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(a.rounds):
            sync.append(run(Path(d) / f"sync{i}", a.nproc, a.steps, a.engine_args))
            over.append(run(Path(d) / f"overlap{i}", a.nproc, a.steps,
                            [*a.engine_args, "--rollout.max_staleness=1", "--loss.tis_cap=2.0"]))
    pool = lambda runs: [r for rows in runs for r in rows[a.warmup:]]  # noqa: E731
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    ps, po = pool(sync), pool(over)
    gen, tr, sy = med(ps, "time/generate_s"), med(ps, "time/train_s"), med(ps, "time/sync_s")
    same = statistics.median(r["time/step_s"] / (max(r["time/generate_s"], r["time/train_s"])
                                                 + r["time/sync_s"]) for r in po)
    out = {"nproc": a.nproc, "steps": a.steps, "rounds": a.rounds,
           "sync_step_s": round(med(ps, "time/step_s"), 4),
           "overlap_step_s": round(med(po, "time/step_s"), 4),
           "generate_s": round(gen, 4), "train_s": round(tr, 4), "sync_s": round(sy, 4),
           "overlap_ratio": round(med(po, "time/step_s") / (max(gen, tr) + sy), 3),
           "overlap_ratio_same_step": round(same, 3),
           "speedup": round(med(ps, "time/step_s") / med(po, "time/step_s"), 3),
           "staleness": max(r["rollout/staleness"] for r in po),
           "reward_last4_sync": round(sum(r["reward/mean"] for r in sync[0][-4:]) / 4, 3),
           "reward_last4_overlap": round(sum(r["reward/mean"] for r in over[0][-4:]) / 4, 3)}
    print(json.dumps(out))

if __name__ == "__main__":
    main()
