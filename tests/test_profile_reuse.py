"""remat.profiling.reuse: a second fake profile of the same model, batch and settings is the first one,
and anything that could change what a profile measures makes it measure again."""
import gc
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

import remat  # noqa: E402
from remat.planning.costs import rates_for  # noqa: E402
from remat.profiling import ProfileRequest, reuse  # noqa: E402
from remat.profiling.profiler import hf_loss  # noqa: E402

REUSED = "the one a previous call measured"


def _tiny(**overrides):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, **overrides)
    return transformers.LlamaForCausalLM(config)


def _batch():
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids.clone()}


def _profiled(model, batch, **kwargs):
    """(the profile, whether it was reused)."""
    said = []
    prof = remat.profile(model, batch, progress=said.append, **kwargs)
    return prof, any(REUSED in message for message in said)


def test_a_second_plan_reuses_the_profile_and_makes_the_plan_a_new_profile_makes(fresh_caches):
    model, batch = _tiny(), _batch()
    first, reused = _profiled(model, batch)
    assert not reused
    said = []
    with pytest.raises(remat.NoPlanFits) as error:
        remat.plan(model, batch, "1KiB", progress=said.append)
    tight = error.value.smallest_peak   # the smallest budget: blocks treated
    plan = remat.plan(model, batch, tight, progress=said.append)
    assert sum(REUSED in message for message in said) == 2, said
    assert plan.summary() != "2x keep; head plain"
    fresh_caches.clear()
    assert plan.to_dict() == remat.plan(model, batch, tight).to_dict()
    again, reused = _profiled(model, batch)
    assert reused and again is not first
    assert (again.classes, again.heads, again.static_bytes) == (first.classes, first.heads, first.static_bytes)
    again.notes["changed"] = True   # a copy: what a caller does to it never reaches the next call
    assert "changed" not in _profiled(model, batch)[0].notes


def test_an_applied_plan_does_not_stop_reuse(fresh_caches):
    model, batch = _tiny(), _batch()
    first, _ = _profiled(model, batch)
    remat.apply(model, "full")
    again, reused = _profiled(model, batch)
    assert reused and repr(again) == repr(first)
    remat.remove(model)


def _step(model, batch):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.0)   # what an optimizer step does to a parameter's version


def _hook(model, batch):
    model.model.layers[0].register_forward_hook(lambda module, args, out: None)


def _key(model, batch, loss_fn=hf_loss, **settings):
    return reuse.key_of(model, batch, loss_fn, ProfileRequest(rates=rates_for("h100"), **settings), None)


@pytest.mark.parametrize("change", [
    _step,
    lambda model, batch: batch["labels"].__setitem__((0, 0), -100),
    lambda model, batch: setattr(model.model.layers[0].self_attn, "attention_dropout", 0.1),
    lambda model, batch: setattr(model.config, "rms_norm_eps", 1e-3),
    lambda model, batch: model.to(torch.float64),
    _hook,
    lambda model, batch: model.model.layers[0].mlp.down_proj.__setattr__("bias", torch.nn.Parameter(torch.zeros(32))),
], ids=["optimizer-step", "batch-values", "module-attribute", "config", "dtype", "forward-hook", "new-parameter"])
def test_what_could_change_the_profile_changes_its_key(change):
    model, batch = _tiny(), _batch()
    before = _key(model, batch)
    assert before is not None and _key(model, batch) == before
    change(model, batch)
    assert _key(model, batch) != before


def test_other_settings_loss_or_model_change_the_key():
    model, batch = _tiny(), _batch()
    before = _key(model, batch)
    assert _key(model, batch, optimizer="adamw") != before
    assert _key(model, batch, loss_fn=lambda m, b: m(**b).loss) != before
    assert _key(_tiny(), batch) != before   # an equal model is another model


def test_a_profile_after_an_optimizer_step_measures_again(fresh_caches):
    model, batch = _tiny(), _batch()
    _profiled(model, batch)
    _step(model, batch)
    assert not _profiled(model, batch)[1]


def test_a_batch_that_cannot_be_keyed_is_not_kept():
    class Opaque:
        pass
    assert _key(_tiny(), dict(_batch(), extra=Opaque())) is None


def test_the_kept_profiles_are_bounded_and_hold_their_model_weakly(fresh_caches):
    model, batch = _tiny(), _batch()
    prof, _ = _profiled(model, batch)
    alive = weakref.ref(model)
    for seq in range(8, 8 + reuse.KEPT + 1):
        ids = torch.randint(0, 128, (1, seq))
        reuse.keep(model, _key(model, {"input_ids": ids, "labels": ids}), hf_loss, prof)
    assert len(reuse.PROFILES) == reuse.KEPT
    del model
    gc.collect()
    assert alive() is None


def test_a_model_whose_forward_writes_its_config_once_reuses_its_profile(fresh_caches):
    """ViT's classification head sets ``config.problem_type`` on its first call with labels."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4, num_labels=3)
    model = transformers.ViTForImageClassification(config)
    batch = {"pixel_values": torch.randn(2, 3, 16, 16), "labels": torch.tensor([0, 2])}
    assert config.problem_type is None
    _profiled(model, batch)
    assert config.problem_type is not None
    assert _profiled(model, batch)[1]
