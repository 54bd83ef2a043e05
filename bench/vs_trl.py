"""This trainer vs Hugging Face TRL's GRPOTrainer on the same work, alternated, one JSON object.

    python bench/vs_trl.py --make-trl-env runs/trl-env    # once: TRL in its own venv (see below)
    python bench/vs_trl.py                                # 5 rounds x 40 steps of each side
    python bench/vs_trl.py --rounds 2 --steps 60 --keep runs/vs_trl --trl-python ENV/bin/python

The work (one optimizer step = one batch): a random tiny Qwen2.5-VL built ONCE here (text hidden
128, 2 layers, 4 heads / 2 KV heads, MLP 256; vision depth 2, hidden 64, 2 heads, MLP 128; the
byte-level tokenizer and Qwen special tokens of families.build_tiny; fp32), 4 prompts x G = 4 samples
per step, at most 16 new tokens, temperature 1, 56 x 56 diagrams (4 image tokens), lr 2e-3, reward
= share of response tokens equal to "a" (rewards/toy.py `target_fraction`, called by both sides),
one thread per process (OMP_NUM_THREADS=1). The data folder holds exactly 4 problems, so every
step of every side sees the same 4 prompts (same text, same images, same token ids: checked at
start, see `trl_worker`). Three sides, run in turn each round (trl, ours_world1,
ours_3rank_overlap, trl, ...) and pooled after `--warmup` steps per run, so machine drift cancels:
- trl: GRPOTrainer in one process (`--trl-python`, a Python that has TRL 1.16.0; see below);
- ours_world1: `python train.py --config configs/tiny.toml --section.key=value ...`;
- ours_3rank_overlap: `torchrun --standalone --nproc_per_node 3 train.py ... --rollout.max_staleness=1
  --loss.tis_cap=2.0` (2 FSDP2 trainer ranks + 1 generation rank, one-step overlap).
Per side: median step time and generation time per step, completion tokens/s (completion tokens
/ step wall, over the pooled steps), the first step whose mean reward reaches `--threshold`
(per run; median over runs, null when most runs never reach it), and ratios ours / trl. Round r
runs every side with run seed `--seed + r` (sampling; the model is built once from `--seed`), and
each side is deterministic in its seed up to thread timing, so the reward figures compare seeds
(more rounds, more seeds), while the timings also average machine drift.

TRL 1.16.0 defaults overridden so both sides do the same work (grpo_config.py / base_config.py /
grpo_trainer.py of the installed trl 1.16.0):
- bf16=False (base_config.py: None -> True unless fp16) and fp32 weights: the project runs fp32;
- gradient_checkpointing=False (base_config.py default True; the project's tiny config is off);
- temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0 (already TRL's
  defaults; set explicitly so a TRL upgrade cannot move them), max_completion_length=16 (default
  512), num_generations=4 (default 8);
- per_device_train_batch_size=16, gradient_accumulation_steps=1, steps_per_generation=1,
  num_iterations=1: one generation of 4 x 4 and one optimizer step per batch, like the project;
  with these TRL skips its extra old-logprob forward (grpo_trainer.py `_generate_and_score_
  completions`: old_per_token_logps = None, ratio from per_token_logps.detach());
- beta=0.0 (no reference model; TRL 1.16's default is already 0), loss_type="dapo" (token-mean
  over the global batch = the project's `token-mean`; TRL's default is also "dapo"),
  scale_rewards="group" (std-scaled group advantages = `loss.scale_by_std = true`), epsilon=0.2,
  epsilon_high=0.28 (TRL default None = symmetric 0.2), mask_truncated_completions=False;
- learning_rate=2e-3 (default 1e-6), lr_scheduler_type="constant" (TrainingArguments default
  "linear" decays to 0 over max_steps; the project keeps lr constant), warmup_steps=0,
  weight_decay=0.0, AdamW betas 0.9/0.999, max_grad_norm=1.0 (= train.grad_clip);
- shuffle_dataset=False (the 4 problems in order; the project shuffles its 4 per epoch: same set);
- logging_strategy="no", report_to="none", disable_tqdm=True, save_strategy="no",
  eval_strategy="no", log_completions=False, and the PrinterCallback/ProgressCallback removed:
  no per-step logging work (the project writes one metrics line per step, outside its step time);
- generation_kwargs={"suppress_tokens": the project's `inputs.Tokens.suppressed`}: TRL itself
  suppresses only the image-pad token when the processing class is a processor
  (trl 1.16.0 trainer/grpo_trainer.py line 1170, in `__init__`'s non-vLLM branch:
  `if isinstance(processing_class, ProcessorMixin): generation_kwargs["suppress_tokens"] =
  [model.config.image_token_id]`, commented "A sampled image token would mismatch the image
  features"; `generation_kwargs` from the config then update that dict, line 1172); the project also
  suppresses the other special tokens except eos, so TRL gets the same list and both sample from
  the same distribution.
Left at TRL's defaults on purpose (they are TRL's own implementation, not different work):
optim "adamw_torch_fused" (TrainingArguments default; same AdamW math as the project's
torch.optim.AdamW), TRL's fused LM head (log-probs of completion positions only, as the project
does), per-step re-tokenisation of the chat prompt by the processor, the datasets image column.
Differences that remain: TRL computes its loss logprobs over the full vocabulary (the project
removes the suppressed ids before the softmax; a tiny change to the gradient, none to sampling);
TRL's advantages divide by std + 1e-4.

Timing: ours = `time/step_s` and `time/generate_s` from metrics.jsonl (generation + reward
scoring; in the overlapped run generation happens during the previous step). TRL = wall time
between consecutive `on_step_end` callbacks (everything: data loading, generation, scoring, loss,
optimizer) and the time in `GRPOTrainer._generate` (chat template + image processor + generate +
decode). Completion tokens include the eos token on both sides.

TRL's environment: trl 1.16.0 needs `datasets>=4.7.0`, and no datasets release fits this project's
CPU pins: datasets 5.1.0-5.2.0 need pyarrow>=24 (requirements.txt pins 22.0.0), 4.8.0-5.0.1 cap
fsspec at <=2026.2.0..2026.6.0 (the vLLM CPU build pins 2026.9.0), 4.7.0 needs dill<0.4.1
(pinned 0.4.1). So TRL runs from a virtual environment layered on this one (torch, transformers,
tokenizers, PIL, ... are this environment's; nothing installed here changes):
    python bench/vs_trl.py --make-trl-env runs/trl-env   # the `#trl ` pins of requirements-bench.txt
    python bench/vs_trl.py                               # --trl-python defaults to runs/trl-env
TRL needs no torchvision here: the bench hands GRPOTrainer a Qwen2.5-VL processor built without a
video processor (the only torchvision-backed part), as rollout.py does for vLLM. Everything runs
offline (HF_HUB_OFFLINE=1).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS, GROUP, NEW_TOKENS, IMAGE_PX, LR = 4, 4, 16, 56, 2e-3
PIXELS = IMAGE_PX * IMAGE_PX                     # min = max pixels: 56 x 56 -> 2 x 2 merged patches
TARGET = "a"
SIDES = ("trl", "ours_world1", "ours_3rank_overlap")
# The bench's model: families.build_tiny's tokenizer and text tower at hidden 128, with a wider
# vision tower than build_tiny's (hidden 32 is hard-coded there).
TEXT_HIDDEN, TEXT_LAYERS = 128, 2
VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2)  # head dim 32
# Qwen2-VL's published chat template (the one Qwen2.5-VL-*-Instruct ship): TRL renders prompts
# with it; it yields exactly inputs.prompt_ids' tokens (checked in trl_worker and the test).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ----------------------------------------------------------------------------- the shared work
def build_model(out: Path, seed: int = 0) -> Path:
    """The bench's tiny Qwen2.5-VL as a Hugging Face folder (weights, config, tokenizer with a chat
    template, image processor with 56 x 56 pixel bounds). Deterministic in `seed`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    import families as F
    import inputs as I
    if (out / "model.safetensors").exists():
        return out
    base = F.build_tiny(out.with_name(out.name + ".base"), seed=seed, hidden=TEXT_HIDDEN,
                        layers=TEXT_LAYERS)
    cfg = Qwen2_5_VLConfig.from_pretrained(base)
    for k, v in VISION.items():
        setattr(cfg.vision_config, k, v)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():  # families._build_tiny's init, so the random policy's groups disagree
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 0.08)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tok = AutoTokenizer.from_pretrained(base)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(tmp)
    I.load_image_processor(str(base), PIXELS, PIXELS).save_pretrained(tmp)
    (tmp / "README.md").write_text(f"Random tiny Qwen2.5-VL for bench/vs_trl.py (seed {seed}).\n")
    tmp.rename(out)
    shutil.rmtree(base, ignore_errors=True)
    return out


def write_data(out: Path, seed: int = 0) -> Path:
    """Geometry3K layout (train.jsonl + images) holding exactly PROMPTS problems, 56 x 56 images."""
    import synthetic
    if not (out / "train.jsonl").exists():
        synthetic.write_synthetic(out, PROMPTS, 1, 1, seed=seed, image_size=IMAGE_PX)
    return out


def n_params(model_dir: Path) -> int:
    from safetensors import safe_open
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


# ----------------------------------------------------------------------------- this project
def ours_cmd(world: int, model_dir: Path, data_dir: Path, out: Path, steps: int, seed: int) -> list[str]:
    args = [str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "tiny.toml"),
            f"--run.out_dir={out}", f"--run.steps={steps}", f"--run.seed={seed}",
            "--run.keep_last=0", "--run.log_samples=0", f"--model.path={model_dir}",
            "--model.dtype=float32", f"--model.min_pixels={PIXELS}", f"--model.max_pixels={PIXELS}",
            f"--data.source={data_dir}", f"--rollout.prompts_per_step={PROMPTS}",
            f"--rollout.group_size={GROUP}", f"--rollout.max_new_tokens={NEW_TOKENS}",
            "--rollout.temperature=1.0", f"--train.lr={LR}",
            # one forward/backward over the 16 sequences, as TRL does (the config says 8)
            f"--train.micro_batch_size={PROMPTS * GROUP}",
            f'--reward.functions=[{{name="target_fraction", weight=1.0, target="{TARGET}"}}]']
    if world == 1:
        return [sys.executable, *args]
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        raise SystemExit(f"error: no torchrun beside {sys.executable}")
    return [str(torchrun), "--standalone", f"--nproc_per_node={world}", *args,
            "--rollout.max_staleness=1", "--loss.tis_cap=2.0"]


def ours_rows(out: Path) -> list[dict]:
    rows = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        rows.append({"step": m["step"], "step_s": m["time/step_s"], "generate_s": m["time/generate_s"],
                     "reward": m["reward/mean"],
                     "completion_tokens": m["response_len/mean"] * PROMPTS * GROUP})
    return rows


# ----------------------------------------------------------------------------- TRL
def trl_cmd(trl_python: str, model_dir: Path, data_dir: Path, out: Path, steps: int, seed: int) -> list[str]:
    return [trl_python, str(Path(__file__).resolve()), "--trl-worker", "--model-dir", str(model_dir),
            "--data-dir", str(data_dir), "--out", str(out), "--steps", str(steps), "--seed", str(seed)]


def trl_worker(model_dir: Path, data_dir: Path, out: Path, steps: int, seed: int) -> None:
    """Runs inside the TRL environment: GRPOTrainer on the shared work; writes out/metrics.jsonl."""
    import torch
    torch.set_num_threads(1)
    import trl
    if trl.__version__ != "1.16.0":
        raise SystemExit(f"error: --trl-python has trl {trl.__version__}; this bench is written "
                         "against trl 1.16.0's GRPOTrainer")
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, ProgressCallback, TrainerCallback
    from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
    from trl import GRPOConfig, GRPOTrainer

    import data
    import inputs as I
    import model as M
    from rewards.toy import target_fraction

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):
        # transformers 5.x attaches a video processor that needs torchvision, which breaks the
        # CPU torch build; images need only the (PIL) image processor and the tokenizer.
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template, **kwargs)

    path = str(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")  # TRL's own choice
    processor = ImageOnlyProcessor(I.load_image_processor(path, PIXELS, PIXELS), tokenizer,
                                   chat_template=tokenizer.chat_template)
    procs = I.load_processors(path, PIXELS, PIXELS)
    tokens = procs.tokens
    problems, skipped = data.load_split(str(data_dir), "train")
    if skipped or len(problems) != PROMPTS:
        raise SystemExit(f"error: {data_dir}: expected {PROMPTS} usable problems, got {len(problems)}")
    texts = [data.user_text(p) for p in problems]
    # Same prompts: TRL's rendering (chat template + processor) must give the project's token ids.
    for p, text in zip(problems, texts):
        got = processor.apply_chat_template([[{"role": "user", "content": [
            {"type": "image", "image": p.image}, {"type": "text", "text": text}]}]],
            add_generation_prompt=True, tokenize=True, return_dict=True)
        n_img = I.n_image_tokens(got["image_grid_thw"])
        want = I.expand_images(I.prompt_ids(procs, text, 1), n_img, tokens.image_pad)
        if list(got["input_ids"][0]) != want or n_img != [4]:
            raise SystemExit(f"error: problem {p.index}: TRL's prompt differs from the project's "
                             f"({n_img} image tokens)")
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": t}], "image": p.image}
                            for p, t in zip(problems, texts)])

    def reward_target(completions, completion_ids, **_) -> list[float]:
        return [target_fraction(c[0]["content"], {"response_len": len(ids)}, target=TARGET)["reward"]
                for c, ids in zip(completions, completion_ids)]

    args = GRPOConfig(
        output_dir=str(out), use_cpu=True, seed=seed, bf16=False, fp16=False,
        gradient_checkpointing=False, per_device_train_batch_size=PROMPTS * GROUP,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        num_generations=GROUP, max_completion_length=NEW_TOKENS, temperature=1.0, top_p=1.0,
        top_k=0, min_p=None, repetition_penalty=1.0, beta=0.0, loss_type="dapo",
        scale_rewards="group", epsilon=0.2, epsilon_high=0.28, mask_truncated_completions=False,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, max_steps=steps,
        shuffle_dataset=False, logging_strategy="no", save_strategy="no", eval_strategy="no",
        report_to="none", disable_tqdm=True, log_completions=False, dataloader_num_workers=0,
        generation_kwargs={"suppress_tokens": list(tokens.suppressed)})

    class Timed(GRPOTrainer):
        generate_s = 0.0

        def _generate(self, prompts):
            t = time.perf_counter()
            result = super()._generate(prompts)
            self.generate_s += time.perf_counter() - t
            return result

    rows: list[dict] = []

    class Recorder(TrainerCallback):
        t = None

        def on_step_begin(self, args, state, control, **kw):
            if self.t is None:
                self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            m = trainer._metrics["train"]
            rows.append({"step": state.global_step - 1, "step_s": now - self.t,
                         "generate_s": trainer.generate_s, "reward": m["reward"][-1],
                         "completion_tokens": m["completions/mean_length"][-1] * PROMPTS * GROUP})
            trainer.generate_s, self.t = 0.0, now

    policy = M.load_model(path, dtype=torch.float32)  # sdpa, fp32: as the project loads it
    trainer = Timed(model=policy, reward_funcs=reward_target, args=args, train_dataset=ds,
                    processing_class=processor, callbacks=[Recorder()])
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.train()
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def trl_pins(requirements: Path = ROOT / "requirements-bench.txt") -> list[str]:
    """The `#trl <pin>` lines of requirements-bench.txt (commented: they cannot go beside
    requirements.txt, see the module docstring)."""
    pins = [ln[len("#trl "):].split("#")[0].strip() for ln in requirements.read_text().splitlines()
            if ln.startswith("#trl ")]
    if not pins or not all("==" in p for p in pins):
        raise SystemExit(f"error: {requirements}: no `#trl name==version` lines")
    return pins


def make_trl_env(env: Path) -> None:
    """A venv layered on this Python's packages with exactly the TRL pins added (no resolver:
    --no-deps, so nothing this environment has is upgraded or shadowed), then `pip check`."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(env)], check=True)
    pip = [str(env / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", "--no-deps", *trl_pins()], check=True)
    check = subprocess.run([*pip, "check"], capture_output=True, text=True)
    # pip check also lists what this environment already had broken (vllm's own pins on CPU);
    # only the packages added here must be consistent.
    added = {p.split("==")[0].lower() for p in trl_pins()}
    bad = [ln for ln in check.stdout.splitlines() if ln.split(" ")[0].lower() in added]
    if bad:
        raise SystemExit("error: the TRL environment is inconsistent:\n" + "\n".join(bad))
    print(f"TRL environment ready: --trl-python {env / 'bin' / 'python'}")


# ----------------------------------------------------------------------------- summary
def first_reaching(rows: list[dict], threshold: float) -> int | None:
    return next((r["step"] for r in rows if r["reward"] >= threshold), None)


def median_or_none(xs: list[int | None]) -> float | None:
    """Median with never-reached (None) counted as later than any step; None if it lands there."""
    m = statistics.median([math.inf if x is None else x for x in xs])
    return None if math.isinf(m) else m


def summarise(runs: list[list[dict]], walls: list[float], warmup: int, threshold: float) -> dict:
    pooled = [r for rows in runs for r in rows[warmup:]]
    if not pooled:
        raise ValueError(f"no steps left after a warm-up of {warmup}: raise --steps")
    tokens = sum(r["completion_tokens"] for r in pooled)
    reach = [first_reaching(rows, threshold) for rows in runs]
    return {"step_s": round(statistics.median(r["step_s"] for r in pooled), 4),
            "generate_s": round(statistics.median(r["generate_s"] for r in pooled), 4),
            "completion_tokens_per_s": round(tokens / sum(r["step_s"] for r in pooled), 1),
            "completion_tokens_per_generate_s": round(tokens / sum(r["generate_s"] for r in pooled), 1),
            "response_len_mean": round(tokens / len(pooled) / (PROMPTS * GROUP), 2),
            f"reward_{threshold}_step": median_or_none(reach),
            f"reward_{threshold}_step_per_run": reach,
            "reward_last5_per_run": [round(statistics.mean(r["reward"] for r in rows[-5:]), 3)
                                     for rows in runs],
            "steps_pooled": len(pooled), "run_wall_s": [round(w, 1) for w in walls]}


def ratios(ours: dict, trl: dict, threshold: float) -> dict:
    key = f"reward_{threshold}_step"
    div = lambda a, b: None if a is None or not b else round(a / b, 3)  # noqa: E731
    return {k: div(ours[k], trl[k]) for k in
            ("step_s", "generate_s", "completion_tokens_per_s", key)}


# ----------------------------------------------------------------------------- main
def versions(trl_python: str | None) -> dict:
    import torch
    import transformers
    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    if trl_python:
        out["trl"] = subprocess.run([trl_python, "-c", "import trl; print(trl.__version__)"],
                                    capture_output=True, text=True).stdout.strip()
    return out


def run_one(cmd: list[str], out: Path, timeout_s: float, what: str) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GRPO_DEVICE="cpu",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # a world of one must not inherit a launcher's
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"error: {what} ran past {timeout_s:.0f} s: {' '.join(cmd)}") from None
    (out / "stdout.log").write_text(p.stdout)
    (out / "stderr.log").write_text(p.stderr)
    if p.returncode != 0:
        tail = "\n".join(p.stderr.strip().splitlines()[-15:])
        raise SystemExit(f"{tail}\nerror: {what} exited {p.returncode} (logs in {out})")
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trl-python", default=os.environ.get(
                        "BENCH_TRL_PYTHON", str(ROOT / "runs" / "trl-env" / "bin" / "python")),
                    help="a Python with trl 1.16.0 (default $BENCH_TRL_PYTHON, else runs/trl-env)")
    ap.add_argument("--make-trl-env", metavar="DIR", help="create that environment and exit")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of trl, ours_world1, ours_3rank")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="steps dropped from each run's timing")
    ap.add_argument("--threshold", type=float, default=0.5, help="mean reward to reach")
    ap.add_argument("--sides", default=",".join(SIDES), help="subset of " + ",".join(SIDES))
    ap.add_argument("--seed", type=int, default=0, help="model seed; run seeds are seed + round")
    ap.add_argument("--keep", help="keep the model, data and run folders here")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    # internal: the TRL side, run under --trl-python
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--data-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.trl_worker:
        return trl_worker(Path(a.model_dir), Path(a.data_dir), Path(a.out), a.steps, a.seed)
    if a.make_trl_env:
        return make_trl_env(Path(a.make_trl_env))
    sides = [s for s in a.sides.split(",") if s]
    bad = [s for s in sides if s not in SIDES]
    if bad:
        raise SystemExit(f"error: --sides: unknown {bad}; known: {list(SIDES)}")
    if a.steps <= a.warmup:
        raise SystemExit(f"error: --steps {a.steps} leaves nothing after --warmup {a.warmup}")
    if "trl" in sides:
        probe = subprocess.run([a.trl_python, "-c", "import trl; print(trl.__version__)"],
                               capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1")
                               ) if Path(a.trl_python).exists() else None
        if probe is None or probe.returncode != 0 or probe.stdout.strip().splitlines()[-1:] != ["1.16.0"]:
            raise SystemExit(f"error: --trl-python {a.trl_python}: no trl 1.16.0 there; make one "
                             "with --make-trl-env runs/trl-env (see this file's docstring)")

    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="vs_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        model_dir = build_model(work / "model", a.seed)
        data_dir = write_data(work / "data", a.seed)
        runs: dict[str, list[list[dict]]] = {s: [] for s in sides}
        walls: dict[str, list[float]] = {s: [] for s in sides}
        for rnd in range(a.rounds):
            seed = a.seed + rnd
            for side in sides:
                out = work / f"{side}_r{rnd}"
                shutil.rmtree(out, ignore_errors=True)  # no resume from an earlier --keep run
                if side == "trl":
                    cmd = trl_cmd(a.trl_python, model_dir, data_dir, out, a.steps, seed)
                else:
                    cmd = ours_cmd(1 if side == "ours_world1" else 3, model_dir, data_dir, out,
                                   a.steps, seed)
                walls[side].append(run_one(cmd, out, a.timeout, f"{side} round {rnd}"))
                rows = ours_rows(out) if side != "trl" else [
                    json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
                if len(rows) != a.steps:
                    raise SystemExit(f"error: {side} round {rnd} logged {len(rows)} of {a.steps} steps")
                runs[side].append(rows)
                print(f"{side} round {rnd}: {walls[side][-1]:.1f} s", file=sys.stderr, flush=True)
        result: dict = {"setup": {
            "params": n_params(model_dir), "prompts_per_step": PROMPTS, "group_size": GROUP,
            "max_new_tokens": NEW_TOKENS, "image_px": IMAGE_PX, "image_tokens": 4, "dtype": "float32",
            "threads_per_process": 1, "lr": LR, "rounds": a.rounds, "steps": a.steps,
            "warmup": a.warmup, "threshold": a.threshold, "cpus": os.cpu_count(),
            "versions": versions(a.trl_python if "trl" in sides else None)}}
        for side in sides:
            result[side] = summarise(runs[side], walls[side], a.warmup, a.threshold)
        for side in sides:
            if side != "trl" and "trl" in sides:
                result[f"ratio_{side}_over_trl"] = ratios(result[side], result["trl"], a.threshold)
        print(json.dumps(result))
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
