"""LoRA (lora.py, the peft library) in one process: which layers get adapters, a policy whose
updates change the adapters only, the base as the KL reference with no second copy, the merged
weights the engines get (bitwise verified, logprob parity), the merged export with the PEFT
adapter folder beside it, and an exact restore of adapters + optimizer state."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import checkpoint as ckpt
import config as C
import data
import inputs as I
import lora
import model as M
import hf_engine as HF
import episode as E
import sync as S
import synthetic
import trainer as T
from tests.util import CheckpointCounter

CPU = torch.device("cpu")


def _mc(**kw) -> C.ModelConfig:
    cfg = C.ModelConfig(**{"lora_rank": 8, **kw})
    C.check_lora(cfg)
    return cfg


def _episodes(path: str, procs: I.Processors, n: int = 2):
    """A batch of `n` episodes with random responses (images when the model has vision)."""
    tokens = procs.tokens
    problems = synthetic.make_synthetic(n, seed=5)
    g = torch.Generator().manual_seed(0)
    allowed = [i for i in range(tokens.vocab_size) if i not in tokens.suppressed]
    eps, images = [], []
    for i, p in enumerate(problems):
        resp = [allowed[j] for j in torch.randint(len(allowed), (6 + i,), generator=g)]
        k = 1 if procs.vision else 0
        eps.append(E.Episode(p.index, i, I.prompt_ids(procs, data.user_text(p), k), resp,
                             [0.0] * len(resp), 0.0, {}, 0, True))
        images.append(p.images[:k])
    return eps, images


def _update(tr: T.Trainer, batch: dict, tokens: I.Tokens, kl: bool = True) -> None:
    """One optimizer step on a loss that moves the policy away from the reference."""
    lp, _ = M.sequence_logprobs(tr.policy, batch, tokens, 1.0)
    mask = batch.response_mask.float()
    loss = -(lp * mask).sum()
    if kl:
        loss = loss + ((lp - T.reference_logprobs(tr, batch, tokens, 1.0)) ** 2 * mask).sum()
    loss.backward()
    T.optimizer_step(tr, C.TrainConfig())


# ----------------------------------------------------------------------------- targets
def test_default_targets_are_the_language_models_linear_layers(tiny_dir):
    model = M.model_from_config(tiny_dir("qwen2_5_vl"), meta=True)
    layers = model.config.text_config.num_hidden_layers
    every = lora.lora_targets(model, _mc())
    assert len(every) == 7 * layers                              # q k v o gate up down
    assert all(n.startswith("model.language_model.layers.") for n in every)  # no vision, no lm_head
    assert lora.lora_targets(model, _mc(lora_target_modules="all-linear")) == every
    assert lora.lora_targets(model, _mc(lora_target_modules=["all-linear"])) == every
    qv = lora.lora_targets(model, _mc(lora_target_modules=["q_proj", "self_attn.v_proj"]))
    assert [n.rsplit(".", 1)[1] for n in qv] == ["q_proj", "v_proj"] * layers
    with_tower = lora.lora_targets(model, _mc(lora_vision=True))
    assert set(every) < set(with_tower) and any(".visual." in n for n in with_tower)
    assert "lm_head" not in with_tower


def test_the_output_head_is_adapted_only_when_named_and_never_when_tied(tiny_dir):
    model = M.model_from_config(tiny_dir("qwen2_5_vl"), meta=True)   # untied head
    every = lora.lora_targets(model, _mc())
    assert lora.lora_targets(model, _mc(lora_target_modules=["all-linear", "lm_head"])) == [
        *every, "lm_head"]
    assert lora.lora_targets(model, _mc(lora_target_modules=["lm_head"])) == ["lm_head"]
    text = M.model_from_config(tiny_dir("qwen3"), meta=True)         # tied to the embeddings
    assert text.get_output_embeddings().weight is text.get_input_embeddings().weight
    with pytest.raises(C.ConfigError, match="'lm_head' is the output head, which model.path="
                                            ".* ties to its input embeddings"):
        lora.lora_targets(text, _mc(lora_target_modules=["all-linear", "lm_head"]))


def test_a_target_that_matches_nothing_names_the_key_and_the_linear_layers(tiny_dir):
    model = M.model_from_config(tiny_dir("qwen2_5_vl"), meta=True)
    with pytest.raises(C.ConfigError) as e:
        lora.lora_targets(model, _mc(lora_target_modules=["q_proj", "qkv"]))  # qkv: the tower's
    msg = str(e.value)
    assert "model.lora_target_modules: 'qkv' matches no linear layer of the language model" in msg
    assert "self_attn.q_proj" in msg and "mlp.down_proj" in msg and "attn.qkv" in msg
    assert "model.lora_vision" in msg and "\n" not in msg
    assert lora.lora_targets(model, _mc(lora_target_modules=["qkv"], lora_vision=True))
    text = M.model_from_config(tiny_dir("qwen3"), meta=True)
    with pytest.raises(C.ConfigError, match="model.lora_vision=true: .* text-only"):
        lora.lora_targets(text, _mc(lora_vision=True))


@pytest.mark.parametrize("override, msg", [
    (["--model.lora_rank=-1"], "model.lora_rank must be >= 0"),
    (["--model.lora_alpha=0"], "model.lora_alpha must be > 0"),
    (["--model.lora_alpha=-2"], "model.lora_alpha must be > 0"),
    (["--model.lora_dropout=0.05"], "model.lora_dropout=0.05: adapter dropout is refused"),
    (["--model.lora_target_modules=[]"], "model.lora_target_modules: expected"),
])
def test_bad_lora_keys_are_config_errors_naming_the_key(override, msg):
    with pytest.raises(C.ConfigError, match=msg):
        C.load(None, override)


def test_targets_that_match_nothing_stop_the_run_before_anything_is_built(one_rank_world, tiny_dir):
    mc = _mc(lora_target_modules=["attn.q"])
    with pytest.raises(C.ConfigError, match="model.lora_target_modules: 'attn.q' matches no"):
        T.load_checked(one_rank_world, tiny_dir("qwen3"), C.Config(model=mc))


# ----------------------------------------------------------------------------- training
@pytest.mark.parametrize("kind, targets", [   # a VLM, a text-only family, the VLM's head too
    ("qwen2_5_vl", "all-linear"), ("qwen3", "all-linear"), ("qwen2_5_vl", ["all-linear", "lm_head"])])
def test_updates_change_only_the_adapters_and_engines_serve_the_merged_policy(one_rank_world, tiny_dir,
                                                                              kind, targets):
    path = tiny_dir(kind)
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    tr = T.build(path, one_rank_world, CPU, C.Config(model=_mc(lora_target_modules=targets),
                                            train=C.TrainConfig(lr=1e-2), loss=C.LossConfig(kl_coef=0.1)),
                 M.RowLayout())
    # no reference copy: the parameters held are the policy's (base + adapters)
    counts = T.parameter_counts(tr)
    n_base = sum(p.numel() for p in M.load_model(path).parameters())
    adapters = sum(p.numel() for n, p in tr.policy.named_parameters() if ".lora_" in n)
    assert tr.ref is None and counts["held"] == counts["total"] == n_base + adapters
    assert counts["trainable"] == adapters and counts["optimizer_bytes"] == 2 * 4 * adapters
    assert {id(p) for g in tr.opt.param_groups for p in g["params"]} == \
        {id(p) for n, p in tr.policy.named_parameters() if ".lora_" in n}

    eps, images = _episodes(path, procs)
    batch = I.collate(eps, images, procs, CPU)
    before = {n: p.detach().clone() for n, p in tr.policy.named_parameters()}
    engine = HF.HFEngine(path, torch.float32, procs, CPU)
    first = tr.sender.send(1, sink=engine.load_weights)        # every tensor, once
    for _ in range(2):
        _update(tr, batch, procs.tokens)
    for n, p in tr.policy.named_parameters():
        same = torch.equal(before[n], p.detach())
        assert same != (".lora_" in n), n                     # base bitwise unchanged; adapters moved

    # the reference is the base model: the policy with its adapters disabled, bitwise
    base = M.load_model(path).eval()
    with torch.no_grad():
        lp_base, _ = M.sequence_logprobs(base, batch, procs.tokens, 1.0)
        lp, _ = M.sequence_logprobs(tr.policy, batch, procs.tokens, 1.0)
    assert torch.equal(T.reference_logprobs(tr, batch, procs.tokens, 1.0), lp_base)

    # later syncs send the adapted layers (and their siblings) only, merged; verify is bitwise
    assert tr.sender.partial
    head = [t for t in lora.engine_tensors(tr.policy) if t.name == "lm_head.weight"]
    assert any(len(t.parts) == 3 and t.changes for t in head) == (targets != "all-linear")
    later = tr.sender.send(2, sink=engine.load_weights)
    assert 0 < later < first
    assert S.verify(one_rank_world, tr.policy, engine, "float32")
    with torch.no_grad():
        lp_engine, _ = M.sequence_logprobs(engine.model, batch, procs.tokens, 1.0)
    m = batch.response_mask.bool()
    assert float((lp_engine - lp)[m].abs().max()) <= 1e-4
    assert float((lp_engine - lp_base)[m].abs().max()) > 1e-2  # it is the adapted policy


def test_without_lora_the_kl_reference_is_a_second_copy(one_rank_world, tiny_dir):
    path = tiny_dir("qwen3")
    tr = T.build(path, one_rank_world, CPU, C.Config(loss=C.LossConfig(kl_coef=0.1)), M.RowLayout())
    counts = T.parameter_counts(tr)
    assert tr.ref is not None and counts["held"] == 2 * counts["total"]
    assert counts["trainable"] == counts["total"] and len(tr.sender.plans) == 1


def test_mixed_precision_and_checkpointing_over_the_frozen_base(one_rank_world, tiny_dir):
    """FSDP2 with bf16 compute and activation checkpointing, as without LoRA: every decoder layer
    recomputed in backward (the vision tower never is), gradients on the adapters only, fp32
    masters."""
    path = tiny_dir("qwen2_5_vl")
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    tr = T.build(path, one_rank_world, CPU,
                 C.Config(model=_mc(mixed_precision=True, activation_checkpointing=True)), M.RowLayout())
    count = CheckpointCounter(tr.policy)
    eps, images = _episodes(path, procs)
    batch = I.collate(eps, images, procs, CPU)
    lp, _ = M.sequence_logprobs(tr.policy, batch, procs.tokens, 1.0)
    (lp * batch.response_mask).sum().backward()
    assert (count.calls, count.recomputes) == (2, 2)
    for n, p in tr.policy.named_parameters():
        assert p.dtype == torch.float32 and (p.grad is not None) == (".lora_" in n), n


def test_startup_summary_says_trainable_total_and_optimizer_state(one_rank_world, tiny_dir):
    import tracking
    path = tiny_dir("qwen3")
    cfg = C.load(None, ["--model.lora_rank=8", "--model.lora_alpha=32"])
    tr = T.build(path, one_rank_world, CPU, cfg, M.RowLayout())
    counts = T.parameter_counts(tr)
    plan = {"progress": SimpleNamespace(step=0, version=0), "path": None}
    text = tracking.startup_summary(cfg, ["trainer"], "cpu", counts, 8, 0, 0, plan, "defaults")
    want = (f"({counts['total'] / 1e6:.2f}M parameters, {counts['trainable'] / 1e6:.3g}M trainable "
            f"(LoRA rank 8, alpha 32), AdamW state {counts['optimizer_bytes'] / 2**20:.3g} MiB;")
    assert want in text and counts["optimizer_bytes"] == 8 * counts["trainable"]
    full = T.build(path, one_rank_world, CPU, C.Config(), M.RowLayout())
    text = tracking.startup_summary(C.load(None), ["trainer"], "cpu", T.parameter_counts(full),
                                    8, 0, 0, plan, "defaults")
    assert "M parameters, all trainable, AdamW state" in text


def test_engine_tensors_send_every_sibling_vllm_fuses_with_an_adapted_layer(tiny_dir):
    """q_proj alone adapted: q/k/v (one qkv_proj layer in vLLM) change together, with their
    biases; o_proj and the MLP do not."""
    model = lora.add_lora(M.model_from_config(tiny_dir("qwen2_5_vl")), _mc(lora_target_modules=["q_proj"]))
    changing = [t.name for t in lora.engine_tensors(model) if t.changes]
    prefix = "model.language_model.layers.0.self_attn."
    assert [n for n in changing if n.startswith(prefix)] == [
        prefix + f"{m}_proj.{k}" for m in "qkv" for k in ("weight", "bias")] + [prefix + "o_proj.weight"]
    assert not any(".mlp." in n or ".visual." in n or "embed" in n for n in changing)
    merged = [t.name for t in lora.engine_tensors(model) if len(t.parts) == 3]
    assert merged == [f"model.language_model.layers.{i}.self_attn.q_proj.weight" for i in range(2)]


def test_a_partial_vllm_reload_holds_back_the_expected_warnings_and_refuses_a_part_layer():
    """vllm_worker.PartialReload (no vLLM needed): the per-layer "got no weights" warnings of a
    partial reload are held back; a layer loaded in part (vLLM's "Delayed processing") stops it,
    except a vocabulary layer (padded rows, one weight: the LoRA output head's later syncs)."""
    import logging

    import vllm_worker as V
    seen: list[str] = []

    class Keep(logging.Handler):  # on the loggers themselves: vLLM's own config may not propagate
        def emit(self, record):
            seen.append(record.getMessage())
    loggers = [logging.getLogger(n) for n in V.PartialReload.LOGGERS]
    layerwise, runner = loggers
    levels = [log.level for log in loggers]
    for log in loggers:
        log.addHandler(Keep())
    try:
        with V.PartialReload(True):
            layerwise.warning("%s: Failed to load weights", "RMSNorm")
            runner.warning("Following weights were not loaded from checkpoint: %s", {"x"})
        assert seen == []
        with pytest.raises(RuntimeError, match=r"vLLM layer\(s\) QKVParallelLinear got only part"):
            with V.PartialReload(True):
                layerwise.debug("%s: Delayed processing", "QKVParallelLinear")
        with V.PartialReload(True):       # a vocabulary layer's padding rows: it came whole
            layerwise.debug("%s: Delayed processing", "ParallelLMHead")
        assert seen == [] and not layerwise.filters and [g.level for g in loggers] == levels
        with V.PartialReload(False):                                 # a full sync: untouched
            layerwise.warning("%s: Failed to load weights", "Embedding")
        assert seen == ["Embedding: Failed to load weights"]
    finally:
        for log in loggers:
            log.handlers = [h for h in log.handlers if not isinstance(h, Keep)]


# ----------------------------------------------------------------------------- checkpoints
def _save(tr, procs, path: Path, out: Path) -> Path:
    folder = out / "step_000001"
    ckpt.save(folder, (tr.policy, tr.opt, tr.sched), rng={"cpu": torch.get_rng_state()},
              meta={"step": 1, "version": 1, "skipped_in_row": 0, "skipped_total": 0.0},
              export=ckpt.Export(procs, path, torch.float32), train_group=dist.group.WORLD,
              is_root=True, keep_last=5)
    return folder


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3", "qwen3_moe"])  # VLM; tied head; MoE layout
def test_export_is_base_plus_scaled_adapters_and_the_adapter_folder_loads_with_peft(one_rank_world,
                                                                                   tiny_dir, tmp_path, kind):
    path = tiny_dir(kind)
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    mc = _mc(lora_alpha=32.0)
    tr = T.build(path, one_rank_world, CPU, C.Config(model=mc, train=C.TrainConfig(lr=1e-2)),
                 M.RowLayout())
    eps, images = _episodes(path, procs)
    _update(tr, I.collate(eps, images, procs, CPU), procs.tokens, kl=False)
    folder = _save(tr, procs, path, tmp_path / "checkpoints")

    # the export is in the base folder's checkpoint layout (the same file keys)
    assert load_file(str(folder / "hf" / "model.safetensors")).keys() == \
        load_file(f"{path}/model.safetensors").keys()
    adapter = load_file(str(folder / "adapter" / "adapter_model.safetensors"))
    config = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 32 and config["base_model_name_or_path"] == path

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    Auto = AutoModelForImageTextToText if procs.vision else AutoModelForCausalLM
    merged = Auto.from_pretrained(str(folder / "hf")).state_dict()   # loads as a model
    base = Auto.from_pretrained(path).state_dict()
    assert merged.keys() == base.keys()
    adapted = 0
    for k in base:                                   # in-memory names, as the adapters' keys
        a = adapter.get(f"base_model.model.{k.removesuffix('.weight')}.lora_A.weight")
        if a is None:
            assert torch.equal(merged[k], base[k]), k                  # not adapted: the base, bitwise
            continue
        b = adapter[f"base_model.model.{k.removesuffix('.weight')}.lora_B.weight"]
        want = base[k] + (32.0 / 8) * (b.double() @ a.double()).float()
        assert (merged[k] - want).abs().max() <= 1e-6 and not torch.equal(merged[k], base[k]), k
        adapted += 1
    assert adapted == len(lora.lora_targets(M.load_model(path), mc))  # MoE: attention only
    peft = PeftModel.from_pretrained(Auto.from_pretrained(path), str(folder / "adapter"))
    theirs = peft.merge_and_unload().state_dict()                     # peft's own merge
    assert theirs.keys() == merged.keys()
    assert all((merged[k] - theirs[k]).abs().max() <= 1e-6 for k in merged)

    # the training state holds the adapters only (the base is model.path's)
    import torch.distributed.checkpoint as dcp
    keys = dcp.FileSystemReader(str(folder / "state")).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys)


def test_restore_puts_back_the_adapters_and_their_optimizer_state_exactly(one_rank_world, tiny_dir,
                                                                          tmp_path):
    path = tiny_dir("qwen3")
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    eps, images = _episodes(path, procs)
    batch = I.collate(eps, images, procs, CPU)

    def trainer(seed):
        cfg = C.Config(run=C.RunConfig(seed=seed), model=_mc(), train=C.TrainConfig(lr=1e-2),
                       loss=C.LossConfig(kl_coef=0.1))
        return T.build(path, one_rank_world, CPU, cfg, M.RowLayout())
    a = trainer(0)
    _update(a, batch, procs.tokens)
    a.sched.step()
    folder = _save(a, procs, path, tmp_path / "checkpoints")
    b = trainer(1)                                   # other adapters, no optimizer state
    assert not all(torch.equal(p, q) for p, q in zip(a.policy.parameters(), b.policy.parameters()))
    ckpt.load(folder, (b.policy, b.opt, b.sched), dist.group.WORLD, True, 0)
    for tr in (a, b):                                # one more identical update on both
        _update(tr, batch, procs.tokens)
    for (n, p), q in zip(a.policy.named_parameters(), b.policy.parameters()):
        assert torch.equal(p, q), n
    sa, sb = a.opt.state_dict()["state"], b.opt.state_dict()["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k][m], sb[k][m]) for k in sa for m in sa[k])
    assert a.sched.state_dict() == b.sched.state_dict()


@pytest.mark.slow
def test_bench_sync_puts_lora_beside_full_syncs(tmp_path):
    """bench/sync.py --lora-rank: bytes and time of every tensor, the merged adapted layers and
    the adapters alone (bench/step.py --lora-rank: tests/test_bench_smoke.py::test_step)."""
    import subprocess
    import sys

    from tests.util import ROOT, env
    sync = subprocess.run([sys.executable, str(ROOT / "bench" / "sync.py"), "--lora-rank", "4",
                           "--hidden", "128", "--layers", "2", "--repeat", "1"],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert sync.returncode == 0, sync.stderr[-3000:]
    r = json.loads(sync.stdout.strip().splitlines()[-1])
    assert 0 < r["adapters"]["bytes"] < r["merged"]["bytes"] < r["full"]["bytes"]
    # rank 4 x (in + out) per projection, hidden 128, kv 64, MLP 256: q 256, k 192, v 192, o 256,
    # gate 384, up 384, down 384 -> 2048 x 4 numbers a layer, 2 layers, 4 bytes each
    assert r["adapters"]["bytes"] == 2048 * 4 * 2 * 4
    assert all(r[m]["sync_s"] > 0 for m in ("full", "merged", "adapters"))
