"""The whole loop under real torchrun launches (CPU, gloo, tiny random Qwen2.5-VL).

- learning: a toy reward the tiny policy can learn rises by a wide margin, and with the sync
  switched off the generation side does NOT improve (so the rise is the sync's doing); the
  learning run (two mini-batches x two PPO epochs, one module fixture) also checks parity at
  every step and the clips binding (the console of a 3-rank launch of train.py itself:
  tests/test_failures.py's Ctrl-C test);
- parity: after every sync the engine's weights equal the trainer's bit for bit, and the
  engine's generation-time logprobs equal the trainer's recomputation (fp32) to 1e-4 (the dense
  VLM in the learning run, a text-only MoE apart);
- overlap: with one-step staleness and truncated importance sampling it still learns;
- a world of 1 and two simulated nodes run the same config.
"""
from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest

from tests.util import ROOT, TINY, TINY_TEXT, env, free_port, metrics, torchrun, torchrun_cmd, train_py

# (and the parts of the run's reward: reward/accuracy and reward/format for the demo's geometry)
REQUIRED = ["step", "weight_version", "reward/mean",
            "response_len/mean", "loss", "grad_norm", "kl", "entropy", "time/generate_s",
            "time/train_s", "time/sync_s", "time/step_s", "sync/bytes", "logprob_diff/max"]
pytestmark = pytest.mark.slow  # torchrun launches: the full tier only

TOY = ['--reward.functions=[{name="target_fraction", weight=1.0, target="<answer>"}]']


GEOMETRY = ("reward/accuracy", "reward/format")


def check_parity(rows: list[dict], steps: int, parts=GEOMETRY) -> None:
    assert [r["step"] for r in rows] == list(range(steps))
    for r in rows:
        assert {*REQUIRED, *parts} <= set(r), {*REQUIRED, *parts} - set(r)
        assert r["sync/checksum_ok"] == 1.0, r
        assert r["logprob_diff/max"] <= 1e-4, r
        assert r["sync/bytes"] > 0
    # the engine really generated with each new version
    assert [r["weight_version"] for r in rows] == list(range(steps))


def check_parity_run(out, steps: int, parts=GEOMETRY) -> None:
    """A 3-rank run with sync.verify: parity at every step, the run's records, a strict export."""
    import model as M
    check_parity(metrics(out), steps, parts)
    assert (out / "config.toml").exists()
    assert len((out / "samples.jsonl").read_text().splitlines()) == steps * 2
    M.load_model(str(out / "checkpoints" / f"step_{steps:06d}" / "hf"))


def test_parity_three_ranks_text_moe(tmp_path):
    """2 FSDP trainers + 1 engine for a text-only MoE (its experts go per expert and land back in
    the engine's fused parameters bitwise); the export loads strictly. The dense VLM's 3-rank
    parity is checked at every step of the learning run below."""
    torchrun(3, [*TINY_TEXT, "--model.path=tiny-qwen3_moe", f"--run.out_dir={tmp_path}",
                 "--run.steps=4", "--sync.verify=true",
                 "--sync.bucket_mb=0.05"])  # small buckets: many buckets, double buffering
    check_parity_run(tmp_path, 4)


@pytest.fixture(scope="module")
def learning(tmp_path_factory):
    """The demo with the toy reward, 24 steps on 2 FSDP trainers + 1 engine, two mini-batches x
    two PPO epochs, every sync verified bitwise over small buckets; and its control, the same
    run with the sync switched off, for its first 12 steps: without a sync the engine samples
    from the initial policy at every step, so its reward has no trend to show at any length,
    while the synced run's is already rising by step 12 (about 0.3 over steps 9-12 here)."""
    root = tmp_path_factory.mktemp("learning")
    args = [*TINY, *TOY, "--train.mini_batches=2", "--train.ppo_epochs=2",
            "--sync.verify=true", "--sync.bucket_mb=0.05"]  # small buckets: many, double buffered
    torchrun(3, [*args, "--run.steps=24", f"--run.out_dir={root / 'on'}"])
    torchrun(3, [*args, "--run.steps=12", f"--run.out_dir={root / 'off'}", "--sync.enabled=false"])
    return SimpleNamespace(on=root / "on", off=root / "off")


def test_learning_and_sync_off_control(learning):
    on, off = learning.on, learning.off
    r_on = [r["reward/mean"] for r in metrics(on)]
    r_off = [r["reward/mean"] for r in metrics(off)]
    first = sum(r_on[:4]) / 4
    last_on, last_off = sum(r_on[-4:]) / 4, sum(r_off[-4:]) / 4
    print("reward with sync:", [round(x, 3) for x in r_on])
    print("reward without sync:", [round(x, 3) for x in r_off])
    assert first < 0.05
    assert last_on > 0.4, r_on              # learned: a wide margin over the start
    assert last_off < 0.1, r_off            # the engines never saw the learned weights
    assert [r["weight_version"] for r in metrics(off)] == [0] * 12


def test_parity_three_ranks_at_every_step_of_the_learning_run(learning):
    """2 FSDP trainers + 1 engine, a dense VLM: engine == trainer bitwise after every sync and
    logprob parity at every one of the 24 steps; the export loads strictly."""
    check_parity_run(learning.on, 24, parts=("reward/target_fraction",))  # the toy reward


def test_two_mini_batches_two_epochs_clip_binds_and_learns(learning):
    """M = E = 2 (the learning run): four optimizer steps per rollout step, one sync per rollout
    step, the ratio moves and both clips bind; it learns (test_learning_and_sync_off_control)."""
    rows = metrics(learning.on)
    assert all(r["train/updates"] == 4 and r["sync/checksum_ok"] == 1.0 for r in rows)
    assert [r["weight_version"] for r in rows] == list(range(24))      # one sync per rollout step
    # the ratio moves once there is a gradient (at step 0 every reward is 0: no advantage)
    assert all(r["train/approx_kl"] > 0 for r in rows if r["advantage/abs_mean"] > 0)
    assert max(r["train/clip_frac_low"] for r in rows) > 0, rows
    assert max(r["train/clip_frac_high"] for r in rows) > 0, rows
    rewards = [r["reward/mean"] for r in rows]
    assert sum(rewards[:3]) / 3 < 0.05 and sum(rewards[-4:]) / 4 > 0.4, rewards


def test_lora_learns_serves_the_merged_policy_and_changes_only_the_adapters(tmp_path):
    """`--model.lora_rank=8` on the demo, 3 ranks, with a KL term (its reference: the base, the
    adapters disabled): every sync verified bitwise and logprob parity every step; the reward
    rises as with full training (test above; the demo's adapters include the output head,
    configs/tiny.toml: frozen, the tiny random head alone caps the reward near 0.4). The
    checkpoint holds the adapters only; its HF export differs from the base exactly in the 15
    adapted weights (7 linear layers x 2 decoder layers, and the head)."""
    torchrun(3, [*TINY, f"--run.out_dir={tmp_path}", "--run.steps=32", *TOY, "--model.lora_rank=8",
                 "--loss.kl_coef=0.01", "--sync.verify=true"])
    rows = metrics(tmp_path)
    assert [r["weight_version"] for r in rows] == list(range(32))
    assert all(r["sync/checksum_ok"] == 1.0 and r["logprob_diff/max"] <= 1e-4 for r in rows), rows
    assert rows[-1]["kl"] > 0                                        # the reference is used
    sent = [r["sync/bytes"] for r in rows]
    assert sent[1] < sent[0] and len(set(sent[1:])) == 1             # every tensor once, then the adapted
    rewards = [r["reward/mean"] for r in rows]
    print("reward with LoRA:", [round(x, 3) for x in rewards])
    assert sum(rewards[:4]) / 4 < 0.05
    assert sum(rewards[-4:]) / 4 > 0.6, rewards

    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    step = tmp_path / "checkpoints" / "step_000032"
    keys = [k for k in dcp.FileSystemReader(str(step / "state")).read_metadata().state_dict_metadata
            if k.startswith("model.")]
    assert keys and all(".lora_" in k for k in keys)
    base, hf = load_file(str(tmp_path / "tiny-model" / "model.safetensors")), load_file(str(step / "hf" / "model.safetensors"))
    changed = sorted(k for k in base if not torch.equal(base[k], hf[k]))
    layers = [f"model.layers.{i}.{m}.weight" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    assert changed == sorted([*layers, "lm_head.weight"])
    assert (step / "adapter" / "adapter_model.safetensors").is_file()


def test_overlap_one_step_stale_still_learns(tmp_path):
    """`rollout.max_staleness=1`: the engines generate step k+1's batch while the trainers train
    on step k, so from step 1 on every episode is one version behind, and the loss corrects with
    truncated importance sampling against the engine's logprobs. It must still learn."""
    torchrun(3, [*TINY, "--run.steps=24", *TOY, f"--run.out_dir={tmp_path}",
                 "--rollout.max_staleness=1", "--loss.tis_cap=2.0"])
    rows = metrics(tmp_path)
    assert [r["rollout/staleness"] for r in rows] == [0] + [1] * 23
    assert [r["weight_version"] for r in rows] == [0] + list(range(23))
    tis = [r["train/tis_weight_mean"] for r in rows]
    assert all(0 < w <= 2.0 for w in tis), tis
    assert any(abs(w - 1) > 1e-3 for w in tis), tis   # the correction is really applied
    rewards = [r["reward/mean"] for r in rows]
    print("reward with overlap:", [round(x, 3) for x in rewards])
    assert sum(rewards[:4]) / 4 < 0.05
    assert sum(rewards[-4:]) / 4 > 0.4, rewards


def test_world_of_one(tmp_path):
    p = train_py([*TINY, f"--run.out_dir={tmp_path}", "--run.steps=2", "--sync.verify=true"])
    assert p.returncode == 0, p.stderr[-4000:]
    check_parity(metrics(tmp_path), 2)
    assert "step 2/2 |" in p.stdout


def test_two_nodes_simulated(tmp_path):
    """Two torchrun launchers, --nnodes 2, static rendezvous on 127.0.0.1: node 0 trains, node 1
    generates (the vl3b layout in miniature)."""
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = torchrun_cmd(2, [*TINY, f"--run.out_dir={tmp_path}", "--run.steps=3",
                               "--cluster.gen_ranks=2", "--sync.verify=true"],
                           launcher=["--nnodes=2", "--nproc_per_node=2", f"--node_rank={node}",
                                     "--master_addr=127.0.0.1", f"--master_port={port}"])
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env(warm=True), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    check_parity(metrics(tmp_path), 3)


def test_two_nodes_per_node_layout_learns_at_parity(tmp_path):
    """`cluster.layout = "per_node"` (ROLL's second layout) through launch/multinode.sh twice on
    one machine: 2 nodes of 3 ranks, 2 trainers + 1 engine on EACH node (ranks 0, 1, 3, 4 train
    as one FSDP2 mesh; 2 and 5 generate); every sync verified bitwise, logprob parity at every
    step, and the toy reward learned as in the 3-rank learning run."""
    port = free_port()
    args = [*TOY, "--cluster.layout=per_node", "--cluster.gen_ranks=2", "--train.mini_batches=2",
            "--train.ppo_epochs=2", "--sync.verify=true", "--run.steps=24", f"--run.out_dir={tmp_path}"]
    procs = []
    for node in (0, 1):
        e = env()
        e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(node), NNODES="2",
                 NPROC_PER_NODE="3", CONFIG=str(ROOT / "configs" / "tiny.toml"), RDZV_TIMEOUT="120")
        procs.append(subprocess.Popen(["bash", str(ROOT / "launch" / "multinode.sh"), *args], cwd=ROOT,
                                      env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=1200) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    rows = metrics(tmp_path)
    check_parity(rows, 24, parts=("reward/target_fraction",))
    rewards = [r["reward/mean"] for r in rows]
    print("reward, per_node layout:", [round(x, 3) for x in rewards])
    assert sum(rewards[:3]) / 3 < 0.05 and sum(rewards[-4:]) / 4 > 0.4, rewards
    assert "== 6 rank(s) on cpu: ranks 0-1,3-4 trainer; ranks 2,5 generation" in outs[0][0], outs[0][0][:2000]
