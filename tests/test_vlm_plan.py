"""Vision-language models planned as users train them (issue 29): LLaVA, Qwen2-VL and PaliGemma,
built from their config classes with the defaults (``use_cache`` on), sizes shrunk, on image +
text batches as their processors make them.

On the CPU the image-token merge, M-RoPE positions and the vision tower's image lengths read the
batch's values, which fake tensors do not have: those steps run for real
(:class:`remat.profiling._fake.ValuedFakeMode`) and the plan's notes say where. Checked here: the
plan covers the vision tower's blocks and the language model's; profiling leaves the model, its
gradients and the RNG as found; each block's predicted bytes kept for backward equal the bytes its
saved tensors hold in a real step (saved-tensor hooks); an applied plan recomputes (forwards
counted) and gives the untouched copy's gradients exactly; ``remat plan`` takes a VLM preset or
config.json with ``--images``.
"""
import copy
import inspect
import json

import pytest
import torch

import remat
from remat.cli import main
from remat.profiling.profiler import profile

transformers = pytest.importorskip("transformers")


def _needs(name):
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return cls


def llava(attn="sdpa"):
    """LLaVA: CLIP tower (its last layer unused: ``vision_feature_layer=-2``, as LLaVA-1.5), frozen
    as LLaVA fine-tunes keep it; the image token repeated once per patch."""
    cls = _needs("LlavaForConditionalGeneration")
    config = transformers.LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=4, image_size=32, patch_size=8, projection_dim=32),
        text_config=dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        image_token_index=255, image_seq_length=16)
    torch.manual_seed(0)
    model = cls._from_config(config, attn_implementation=attn)
    model.model.vision_tower.requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 250, (2, 40), generator=g)
    ids[:, 2:18] = 255
    labels = ids.masked_fill(ids == 255, -100)
    return model, dict(input_ids=ids, pixel_values=torch.randn(2, 3, 32, 32, generator=g),
                       attention_mask=torch.ones_like(ids), labels=labels)


def qwen2_vl(attn="sdpa"):
    """Qwen2-VL: two images of different sizes (their own lengths in the vision tower's attention),
    M-RoPE positions, attention dropout on."""
    cls = _needs("Qwen2VLForConditionalGeneration")
    config = transformers.Qwen2VLConfig(
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1, bos_token_id=0,
                         eos_token_id=1, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]}),
        image_token_id=250, vision_start_token_id=251, vision_end_token_id=252, video_token_id=253)
    torch.manual_seed(0)
    model = cls._from_config(config, attn_implementation=attn)
    grid = torch.tensor([[1, 4, 4], [1, 4, 6]])        # 4 and 6 image tokens after the 2x2 merge
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 240, (2, 32), generator=g)
    ids[0, 1], ids[0, 2:6], ids[0, 6] = 251, 250, 252
    ids[1, 3], ids[1, 4:10], ids[1, 10] = 251, 250, 252
    batch = dict(input_ids=ids, pixel_values=torch.randn(40, 3 * 2 * 14 * 14, generator=g), image_grid_thw=grid,
                 attention_mask=torch.ones_like(ids), labels=ids.masked_fill(ids == 250, -100))
    if "mm_token_type_ids" in inspect.signature(cls.forward).parameters:  # transformers >= 5
        batch["mm_token_type_ids"] = (ids == 250).int()
    return model, batch


def paligemma(attn="sdpa"):
    """PaliGemma: SigLIP tower, the prefix (image and prompt) attending both ways, loss on the suffix."""
    cls = _needs("PaliGemmaForConditionalGeneration")
    config = transformers.PaliGemmaConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        text_config=dict(model_type="gemma", vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16),
        image_token_index=255, projection_dim=64)
    torch.manual_seed(0)
    model = cls._from_config(config, attn_implementation=attn)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 250, (2, 36), generator=g)
    ids[:, :16] = 255
    token_types = torch.zeros_like(ids)
    token_types[:, 24:] = 1
    return model, dict(input_ids=ids, pixel_values=torch.randn(2, 3, 32, 32, generator=g),
                       attention_mask=torch.ones_like(ids), token_type_ids=token_types,
                       labels=ids.masked_fill(token_types == 0, -100))


# family -> (builder, vision block prefix, language block prefix, where the notes must say values were read)
FAMILIES = {
    "llava": (llava, "model.vision_tower.encoder.layers.", "model.language_model.layers.",
              ("get_placeholder_mask",)),
    "qwen2_vl": (qwen2_vl, "model.visual.blocks.", "model.language_model.layers.",
                 ("get_placeholder_mask", "get_rope_index", "model.visual.blocks.*.attn")),
    "paligemma": (paligemma, "model.vision_tower.encoder.layers.", "model.language_model.layers.",
                  ("get_placeholder_mask",)),
}


def _step(model, batch, seed=3):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _state(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {n: (p.grad.clone() if p.grad is not None else None, p.requires_grad) for n, p in model.named_parameters()},
            [(m, dict(m.__dict__)) for m in model.modules()], torch.get_rng_state())


@pytest.mark.parametrize("family", FAMILIES)
def test_planned_on_the_cpu_covering_vision_and_language_blocks_and_leaving_the_model_as_found(family):
    build, vision, language, places = FAMILIES[family]
    model, batch = build()
    _step(model, batch)  # the user's gradients (and Qwen's cached rope_deltas) are there before planning
    before = _state(model)
    plan = remat.plan(model, batch, "1GiB", gpu="h100")
    names = list(plan.blocks)
    assert any(n.startswith(vision) for n in names) and any(n.startswith(language) for n in names), names
    assert len(names) == len([n for n in names if n.startswith((vision, language))])
    note = plan.notes["ran_for_real"]
    assert all(place in note for place in places), note
    after = _state(model)
    assert before[0].keys() == after[0].keys() and all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    for name, (grad, requires_grad) in before[1].items():
        now, now_requires = after[1][name]
        assert now_requires == requires_grad and (grad is None) == (now is None), name
        assert grad is None or torch.equal(grad, now), name
    for module, attributes in before[2]:  # every attribute is the very object it was: no fake tensor left behind
        assert module.__dict__.keys() == attributes.keys()
        assert all(module.__dict__[k] is v for k, v in attributes.items()), type(module).__name__
    if family == "qwen2_vl":
        assert isinstance(model.model.rope_deltas, torch.Tensor)  # the real one, from the step before planning
    assert torch.equal(before[3], after[3])
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


def _saved_bytes_per_block(model, batch, names):
    """Bytes of the storages each block saves for backward in a real step (saved-tensor hooks), less
    parameters and the block's own inputs (which exist before it runs)."""
    modules = dict(model.named_modules())
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, open_hooks, handles = {}, {}, []

    def pre(name, module, args, kwargs):
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        seen = saved.setdefault(name, {})

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and ptr not in inputs:
                seen[ptr] = t.untyped_storage().nbytes()
            return t
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        hooks.__enter__()
        open_hooks[name] = hooks

    def post(name, module, args, kwargs, out):
        open_hooks.pop(name).__exit__(None, None, None)

    for name in names:
        handles.append(modules[name].register_forward_pre_hook(
            lambda m, a, k, name=name: pre(name, m, a, k), with_kwargs=True))
        handles.append(modules[name].register_forward_hook(
            lambda m, a, k, o, name=name: post(name, m, a, k, o), with_kwargs=True))
    try:
        loss = model(**batch).loss
    finally:
        for handle in handles:
            handle.remove()
    del loss
    return {name: sum(seen.values()) for name, seen in saved.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_predicted_bytes_kept_by_each_block_are_what_its_saved_tensors_hold(family):
    """Eager attention (the same kernels fake and real; the SDPA stand-in plans for the GPU's) and the
    CPU's rates (no allocator rounding): what the profile says each block keeps under ``keep`` is
    what autograd saves for it in a real step of the whole model, vision and language blocks alike."""
    build, vision, language, _ = FAMILIES[family]
    model, batch = build(attn="eager")
    prof = profile(model, batch, gpu="cpu")
    real = _saved_bytes_per_block(model, batch, prof.block_names)
    modules = dict(model.named_modules())
    for index, name in enumerate(prof.block_names):
        keep, full = prof.cost(index, "keep"), prof.cost(index, "full")
        # the profile's mark also holds one 0-d scalar (its autograd sink's output), as under full
        assert keep.kept - full.kept == real[name], (name, keep.kept, full.kept, real[name])
        trained = name.startswith(language) or any(p.requires_grad for p in modules[name].parameters())
        # a frozen tower (LLaVA's) has no backward: it keeps nothing, and the profile says so
        assert (real[name] > 0) == trained and full.saves_input == trained and full.kept < 64, name
    assert any(n.startswith(vision) for n in prof.block_names)
    assert len({c for c, n in zip(prof.block_class, prof.block_names) if n.startswith(vision)}) == 1


def _forwards(model, names):
    """Per named block, how often its first linear layer ran in a step (a recompute runs the block's
    forward function, not its ``__call__``: hooks on the block itself see one call)."""
    modules = dict(model.named_modules())
    counts, handles = dict.fromkeys(names, 0), []
    for name in names:
        first = next(m for m in modules[name].modules() if isinstance(m, torch.nn.Linear))
        handles.append(first.register_forward_pre_hook(
            lambda m, a, name=name: counts.__setitem__(name, counts[name] + 1)))
    return counts, handles


@pytest.mark.parametrize("family", FAMILIES)
def test_an_applied_plan_recomputes_and_gives_the_untouched_models_gradients(family):
    build, vision, language, _ = FAMILIES[family]
    model, batch = build()
    reference = copy.deepcopy(model)
    prof = profile(model, batch, gpu="h100")
    with pytest.raises(remat.NoPlanFits) as nothing_fits:  # the smallest peak any plan reaches, plain head
        remat.plan(model, batch, 1, profiled=prof, heads=["plain"])
    smallest = nothing_fits.value.smallest_peak
    modules = dict(model.named_modules())
    for budget, treatments in ((smallest, None), (2**30, ["full"])):
        plan = remat.plan(model, batch, budget, profiled=prof, treatments=treatments, heads=["plain"])
        assert plan.notes["predicted_peak_bytes"] <= budget
        remat.apply(model, plan)
        counts, handles = _forwards(model, list(plan.blocks))
        assert plan.head == "plain"  # the chunked head sums per-chunk losses: equal to fp32 rounding, not bitwise
        loss, grads = _step(model, batch)
        expected_loss, expected = _step(reference, batch)
        assert torch.equal(loss, expected_loss)
        assert grads.keys() == expected.keys()
        assert all(torch.equal(grads[k], expected[k]) for k in grads), \
            [k for k in grads if not torch.equal(grads[k], expected[k])]
        # the mechanism: a block under `full` runs its forward again in backward, where its backward
        # runs at all (LLaVA's frozen tower needs none); a kept block runs once
        for name, treatment in plan.blocks.items():
            trained = name.startswith(language) or any(p.requires_grad for p in modules[name].parameters())
            if treatment == "full":
                assert counts[name] == (2 if trained else 1), (name, counts[name])
            elif treatment == "keep":
                assert counts[name] == 1, (name, counts[name])
        if treatments == ["full"]:
            assert set(plan.blocks.values()) == {"full"}
            assert any(n.startswith(vision) for n in plan.blocks)
        remat.remove(model)
        for handle in handles:
            handle.remove()


# -- remat plan on a VLM config, without weights or downloads ---------------------------------------------

def _plan_cli(capsys, argv):
    assert main(["plan", *argv]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_remat_plan_takes_the_qwen2_vl_preset_with_images_described_on_the_command_line(capsys):
    out = _plan_cli(capsys, ["--model", "qwen2-vl-tiny", "--batch", "1", "--seq", "48", "--images", "2",
                             "--image-size", "112x84", "--budget", "1GiB"])
    # 112x84 pixels: 8 x 6 patches of 14, merged 2x2 into 12 image tokens
    assert "images     2 per sequence, 112x84 pixels, 12 image tokens each (24 of the 48 tokens)" in out
    assert "plan       4x " in out and "get_rope_index" in out and "real       " in out


def test_remat_plan_takes_a_vlm_config_json(capsys, tmp_path):
    model, _ = llava()
    path = tmp_path / "config.json"
    model.config.to_json_file(path)
    out = _plan_cli(capsys, ["--model", str(tmp_path), "--batch", "2", "--seq", "40", "--images", "2",
                             "--budget", "1GiB", "--json"])
    plan = json.loads(out)
    assert len(plan["blocks"]) == 5 and "get_placeholder_mask" in plan["notes"]["ran_for_real"]


@pytest.mark.parametrize("argv, match", [
    (["--model", "llama-tiny", "--images", "1"], "--images is for vision-language models"),
    (["--model", "qwen2-vl-tiny", "--images", "0"], "--images must be a whole number >= 1"),
    (["--model", "qwen2-vl-tiny", "--seq", "40", "--images", "1"], "pass --seq 259 or more"),
    (["--model", "qwen2-vl-tiny", "--image-size", "big"], "--image-size must be HEIGHTxWIDTH"),
])
def test_image_options_that_cannot_work_are_one_line_errors(capsys, argv, match):
    assert main(["plan", "--budget", "1GiB", *argv]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


def test_a_fixed_size_tower_refuses_another_image_size(capsys, tmp_path):
    model, _ = paligemma()
    model.config.to_json_file(tmp_path / "config.json")
    assert main(["plan", "--model", str(tmp_path), "--seq", "64", "--image-size", "64x64", "--budget", "1GiB"]) == 2
    assert "takes 32x32 images only" in capsys.readouterr().err


# -- on a GPU: measured, not fake ----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_planned_measured_on_a_gpu_and_exact(family):
    """On a GPU the profile is measured (nothing runs on fake tensors, nothing is noted as run for
    real); a plan between the smallest and the untouched peak, and one of ``full`` everywhere, apply
    and give the untouched copy's loss and gradients, ``full`` recomputing every trained block."""
    build, vision, language, _ = FAMILIES[family]
    model, batch = build()
    model.cuda()
    batch = {k: v.cuda() for k, v in batch.items()}
    reference = copy.deepcopy(model)
    prof = profile(model, batch)
    assert prof.rates.measured and "ran_for_real" not in prof.notes
    keep = remat.plan(model, batch, 2**30, profiled=prof, treatments=["keep"]).notes["predicted_peak_bytes"]
    with pytest.raises(remat.NoPlanFits) as nothing_fits:
        remat.plan(model, batch, 1, profiled=prof)
    modules = dict(model.named_modules())
    for budget, treatments in (((keep + nothing_fits.value.smallest_peak) // 2, None), (2**30, ["full"])):
        plan = remat.plan(model, batch, budget, profiled=prof, treatments=treatments)
        assert any(n.startswith(vision) for n in plan.blocks) and any(n.startswith(language) for n in plan.blocks)
        remat.apply(model, plan)
        counts, handles = _forwards(model, list(plan.blocks))
        loss, grads = _step(model, batch)
        expected_loss, expected = _step(reference, batch)
        # the same forward: the same loss (the chunked head sums its chunks' losses: fp32 rounding);
        # backward kernels may accumulate in another order on the GPU
        assert grads.keys() == expected.keys()
        torch.testing.assert_close(loss, expected_loss, rtol=0 if plan.head == "plain" else 1e-6, atol=0)
        for k in expected:
            error = (grads[k] - expected[k]).norm() / expected[k].norm().clamp_min(1e-12)
            assert error < 1e-5, (k, plan.summary(), float(error))
        for name, treatment in plan.blocks.items():
            trained = name.startswith(language) or any(p.requires_grad for p in modules[name].parameters())
            if treatment == "full":
                assert counts[name] == (2 if trained else 1), (name, counts[name])
        remat.remove(model)
        for handle in handles:
            handle.remove()
