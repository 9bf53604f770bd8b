"""Every treatment against an untouched copy: same loss, input and parameter gradients, and the
treatment's mechanism seen (:mod:`oracle`: more ops where it recomputes, fewer bytes saved).

fp32 on CPU with dropout on: the math is identical, so equality is exact (torch.equal).
"""
import copy

import pytest
import torch
import torch.nn as nn

import remat
from remat.api import hf_argument_name, hf_disable_name, treatments
from remat.treat import patches
# private (_positional): the checkpoint's positional inputs made from a call; torch restores the RNG
# only of their devices (a GPU's, not shown on the CPU) and what the closure holds shows on it alone
from remat.treat.treatments import _positional, treatment_of

import oracle
from families import FAMILIES

SPECS = ("full", "selective", "attention", "mlp", "every:2", "first:1:selective")
NO_MLP_MODULE = {"opt", "bart"}  # fc1/fc2 directly in the layer: no MLP sub-module to recompute


def _batch(make_inputs):
    torch.manual_seed(123)
    return make_inputs()


def _old_t5_inplace(family, spec):
    """transformers < 5 T5 adds the position bias in place to its attention scores (``scores +=``):
    a matmul output that ``selective`` keeps is then changed behind torch's back (the add goes
    through an ``_unsafe_view``, which escapes the cache's version check), so the recompute
    adds the bias twice. remat's guard refuses it; transformers 5 computes it out of place."""
    import transformers
    return family == "t5" and "selective" in spec and int(transformers.__version__.split(".")[0]) < 5


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("spec", SPECS)
def test_gradients_equal_untouched_copy(family, spec):
    model, make_inputs = FAMILIES[family]()
    if _old_t5_inplace(family, spec):  # refused with a clear error instead of wrong gradients
        reference = copy.deepcopy(model)
        remat.apply(model, spec)
        with pytest.raises(ValueError, match="modifies in place"):
            oracle.compare(model, reference, _batch(make_inputs))
        return
    reference = copy.deepcopy(model)
    if spec == "mlp" and family in NO_MLP_MODULE:
        with pytest.raises(ValueError, match="no mlp sub-module"):
            remat.apply(model, spec)
        return
    remat.apply(model, spec)
    # a second step: nothing left over from the first (RNG, saved state) changes results
    oracle.check(model, reference, _batch(make_inputs), steps=2)


def test_state_dict_round_trip_and_keys_unchanged():
    model, _ = FAMILIES["llama"]()
    plain_sd = copy.deepcopy(model.state_dict())
    remat.apply(model, "selective")
    assert list(model.state_dict()) == list(plain_sd)
    other, _ = FAMILIES["llama"]()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    remat.apply(other, "full")
    other.load_state_dict(plain_sd)  # a plain checkpoint loads into a treated model
    for key, value in other.state_dict().items():
        assert torch.equal(value, plain_sd[key]), key
    fresh, _ = FAMILIES["llama"]()
    fresh.load_state_dict(model.state_dict())  # and a treated model's checkpoint into a plain one


def test_remove_restores_original_module_tree():
    model, make_inputs = FAMILIES["gpt2"]()
    reference = copy.deepcopy(model)
    before = [(name, type(m)) for name, m in model.named_modules()]
    remat.apply(model, "attention")
    remat.apply(model, "every:2:selective")
    remat.remove(model)
    assert [(name, type(m)) for name, m in model.named_modules()] == before
    assert not any("forward" in m.__dict__ or "_remat" in m.__dict__ for m in model.modules())
    oracle.check_untouched(oracle.compare(model, reference, _batch(make_inputs)).assert_equal())


def test_applying_twice_replaces_and_never_double_wraps():
    model, make_inputs = FAMILIES["llama"]()
    reference = copy.deepcopy(model)
    remat.apply(model, "full")
    remat.apply(model, "full")
    remat.apply(model, "selective")
    block = model.model.layers[0]
    forwards = [p for p in patches.patches(block) if p.attribute == "forward"]
    assert [p.module for p in forwards if p.tag == "treatment"] == [block]
    # transformers 5.25+: the hub-kernel wrappers' modules (remat.treat.hub_kernels), once each
    unwrapped = [id(p.module) for p in forwards if p.tag == "treatment-hub-kernels"]
    assert len(forwards) == 1 + len(unwrapped) and len(set(unwrapped)) == len(unwrapped)
    assert set(treatments(model).values()) == {"selective"}
    oracle.check(model, reference, _batch(make_inputs))
    remat.remove(model)
    assert "forward" not in block.__dict__  # the one patch was over the class forward: no remat forward under it


def test_treatment_replaced_on_one_block_keeps_others():
    model, _ = FAMILIES["llama"]()
    names = list(treatments(model))
    remat.apply(model, {names[0]: "mlp", names[2]: "full"})
    assert [treatment_of(b) for b in model.model.layers] == ["mlp", "keep", "full"]


def test_instance_forward_set_by_another_library_is_restored():
    model, make_inputs = FAMILIES["plain"]()
    block = model.blocks[1]
    calls = []
    original = block.forward

    def hooked(*args, **kwargs):  # what accelerate's add_hook_to_module does
        calls.append(1)
        return original(*args, **kwargs)
    block.forward = hooked
    remat.apply(model, "full")
    torch.manual_seed(0)
    model(**make_inputs()).loss.backward()
    assert calls, "the pre-existing instance forward must still run under the treatment"
    remat.remove(model)
    assert block.__dict__["forward"] is hooked


def test_deepcopy_of_treated_model_uses_its_own_parameters():
    model, make_inputs = FAMILIES["llama"]()
    remat.apply(model, "full")
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(0.5)
    reference = copy.deepcopy(clone)
    remat.remove(reference)
    oracle.check(clone, reference, _batch(make_inputs))


def test_no_grad_forward_is_untouched():
    model, make_inputs = FAMILIES["llama"]()
    reference = copy.deepcopy(model).eval()
    remat.apply(model, "full")
    model.eval()
    inputs = make_inputs()
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, reference(**inputs).logits)


def test_lora_with_frozen_embeddings_gets_gradients_without_input_require_grads():
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from families import SMALL, _config
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(_config("llama", **SMALL))
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    model = peft.get_peft_model(base, lora).train()
    reference = copy.deepcopy(model)
    remat.apply(model, "full")
    assert len(remat.discover(model).block_names) == 3
    ids = torch.randint(0, 97, (2, 10))
    oracle.check(model, reference, {"input_ids": ids, "labels": ids}, seed=5)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.grad is not None for n, p in model.named_parameters() if n in trainable)


def test_hf_gradient_checkpointing_is_refused_before_and_after():
    model, _ = FAMILIES["llama"]()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(ValueError, match=hf_disable_name(model)):
        remat.apply(model, "full")
    model.gradient_checkpointing_disable()
    remat.apply(model, "full")
    with pytest.raises(ValueError, match=f"{hf_argument_name()}=False"):
        model.gradient_checkpointing_enable()  # what the Trainer does at train()
    if hasattr(type(model), "activation_checkpointing_enable"):  # transformers >= 5.x's new name
        with pytest.raises(ValueError, match=f"{hf_argument_name()}=False"):
            model.activation_checkpointing_enable()
    remat.remove(model)
    model.gradient_checkpointing_enable()  # allowed again once remat is removed


@pytest.mark.parametrize("spec", ["full", "selective"])
def test_compile_of_each_block_after_apply(spec):
    model, make_inputs = FAMILIES["llama"]()
    reference = copy.deepcopy(model)
    remat.apply(model, spec)
    for block in model.model.layers:
        block.compile(backend="aot_eager")
    for m in (model, reference):
        m.config.attention_dropout = 0.0  # compiled dropout draws RNG differently from eager
        for layer in m.model.layers:
            layer.self_attn.attention_dropout = 0.0
    # compiled kernels sum in another order; dynamo traces no dispatch mode or saved-tensor hook
    # (fp32, aot_eager's decompositions: sums in another order, 1e-5 norm-wise relative)
    oracle.compare(model, reference, _batch(make_inputs), meter=False).assert_close(1e-5)


def test_selective_refuses_in_place_change_of_a_kept_matmul_output():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)
            self.w = torch.nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            scores = torch.matmul(self.proj(x), self.w)  # 3-D matmul: an _unsafe_view of the bmm/mm
            scores += 1.0  # what transformers < 5 T5 does with its position bias
            return scores.softmax(-1)

    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([Block(), Block()])
    remat.apply(model, "selective", blocks="blocks")
    x = torch.randn(2, 3, 8, requires_grad=True)
    with pytest.raises(ValueError, match="modifies in place"):
        model.blocks[0](x).sum().backward()
    remat.apply(model, "full", blocks="blocks")  # full recomputes everything: correct, allowed
    model.blocks[0](x).sum().backward()


class _AddsToKeptScores(torch.nn.Module):
    """Adds in place to a matmul output that ``selective`` keeps: refused by its guard, inside the checkpoint."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        scores = torch.matmul(self.proj(x), self.proj.weight)
        scores += 1.0
        return scores.softmax(-1)


def test_a_fake_tensor_profile_leaves_out_selective_where_the_guard_refuses_it():
    """On fake tensors (``remat plan`` without a GPU) the guard refuses what it refuses on real ones:
    a block that adds in place to a kept matmul output has no ``selective`` (nor a plan with it),
    a block beside it that does not keeps it. (Flaubert's and XLM's attention blocks: a plan of
    ``selective`` that ``remat.plan`` returned was refused at its first step.)"""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([_AddsToKeptScores(), torch.nn.Sequential(torch.nn.Linear(8, 8))])

        def forward(self, x):
            return self.blocks[1](self.blocks[0](x))

    prof = remat.profile(Net(), torch.randn(2, 3, 8), loss_fn=lambda m, x: m(x).square().mean(), device="fake",
                         gpu="h100", blocks="blocks")
    assert "selective" not in prof.treatments(0) and "selective" in prof.treatments(1)


def test_selective_guard_watches_the_first_forward_of_each_call_structure(monkeypatch):
    """The in-place guard's per-op dispatch runs on a block's first forward of each call structure
    (arguments, keywords, which are None) and is skipped after one passes; a forward it refused
    is watched again, and gradients are the same with and without it."""
    from remat.treat import selective
    watched = []

    class CountingGuard(selective._KeptOutputGuard):
        def __enter__(self):
            watched.append(self)
            return super().__enter__()
    # private: how often the guard is entered is its cost, which no public result shows
    monkeypatch.setattr(selective, "_KeptOutputGuard", CountingGuard)
    model, make_inputs = FAMILIES["llama"]()
    reference = copy.deepcopy(model)
    remat.apply(model, "selective")
    blocks = len(model.model.layers)
    for step in range(2):
        oracle.check(model, reference, _batch(make_inputs))
        assert len(watched) == blocks, step  # each block once, on the first step only
    padded = torch.ones(2, 11, dtype=torch.long)
    padded[0, :2] = 0  # a padding mask reaches the blocks: another call structure, watched again
    model(**make_inputs(), attention_mask=padded)
    assert len(watched) == 2 * blocks

    bad = torch.nn.Module()
    bad.blocks = torch.nn.ModuleList([_AddsToKeptScores()])
    remat.apply(bad, "selective", blocks="blocks")
    for _ in range(2):  # refused, and so still watched
        with pytest.raises(ValueError, match="modifies in place"):
            bad.blocks[0](torch.randn(2, 3, 8, requires_grad=True)).sum().backward()


@pytest.mark.parametrize("backward", [True, False])
def test_a_selective_checkpoint_leaves_nothing_for_the_collector(backward):
    """What a selective checkpoint holds (its policy, torch's caching modes and their storage of
    kept outputs) goes with the step's graph, not at Python's next collection: a graph dropped
    before its backward (a loss under grad that is never backpropagated) gives back what it kept
    at once, and each step leaves no reference cycle of these behind."""
    import gc
    from torch.utils._python_dispatch import TorchDispatchMode
    from remat.treat import selective
    model, make_inputs = FAMILIES["llama"]()
    remat.apply(model, "selective")
    model(**make_inputs()).loss.backward()  # the guarded first forward, as any step's
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds stays in gc.garbage, to look at
    try:
        loss = model(**make_inputs()).loss
        if backward:
            loss.backward()
        del loss
        gc.collect()
        # private (_Policy): what is looked for among the collector's garbage is the policy object itself
        cyclic = [type(o).__name__ for o in gc.garbage if isinstance(o, (selective._Policy, TorchDispatchMode))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cyclic == []


def test_a_forward_that_raises_leaves_no_checkpoint_state_entered():
    """Torch < 2.7 leaves a checkpoint's saved-tensor hooks and ``context_fn`` modes entered when
    the forward raises, for as long as the traceback lives (here ``info`` keeps it): remat closes
    them, so the process goes on as before (a later model's step is exact, no mode is left)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([_AddsToKeptScores(), _AddsToKeptScores()])
    remat.apply(model, "selective", blocks="blocks")
    with pytest.raises(ValueError, match="modifies in place") as info:
        model.blocks[0](torch.randn(2, 3, 8, requires_grad=True)).sum().backward()
    assert info.traceback and _get_current_dispatch_mode_stack() == []
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    reference = copy.deepcopy(plain)
    result = oracle.compare(plain, reference, torch.randn(4, 8), loss=lambda m, x: m(x).square().sum())
    oracle.check_untouched(result.assert_equal())


def test_tensor_keywords_become_checkpoint_inputs():
    """checkpoint restores the RNG of the devices of its positional tensors only: a module
    called with keywords only (HF attention) must still have its tensors seen there."""
    seen = {}

    def forward(x, *, hidden_states, mask=None, scale=1.0):
        seen.update(x=x, hidden_states=hidden_states, mask=mask, scale=scale)
        return hidden_states * scale

    h, m = torch.randn(2), torch.ones(2)
    function, args = _positional(forward, (torch.zeros(1),), {"hidden_states": h, "mask": m, "scale": 3.0})
    assert len(args) == 3 and args[1] is h and args[2] is m
    assert torch.equal(function(*args), h * 3.0) and seen["mask"] is m and seen["scale"] == 3.0


def test_a_tensor_passed_twice_is_one_checkpoint_input():
    """``mha(x, x, x)`` under saved-tensor hooks: each saved input comes back as its own alias,
    so the recompute must rebuild the aliasing from one input, or it takes another path."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.Sequential(layer, copy.deepcopy(layer))
    reference = copy.deepcopy(model)
    remat.apply(model, "attention", blocks="")
    x = torch.randn(2, 5, 16)
    with torch.autograd.graph.save_on_cpu():
        model(x).sum().backward()
    reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)


def test_positional_closure_holds_no_tensor():
    """The function ``full``/``full+offload`` checkpoints lives until the recompute; if it held the
    block's input, offloading that input would free nothing on the GPU (a ViT under
    ``full+offload`` measured the peak of ``full`` plus the engine's bytes on an H100)."""
    import weakref
    x, mask = torch.randn(4, 3), torch.ones(4, 3)
    function, inputs = _positional(lambda h, m, scale, *, bias: h * m * scale + bias, (x, mask, 2.0),
                                   {"bias": torch.zeros(3)})
    expected = x * mask * 2.0
    held = [weakref.ref(t) for t in inputs]
    flat = [t.clone() for t in inputs]
    del x, mask, inputs
    assert all(ref() is None for ref in held)
    assert torch.equal(function(*flat), expected)


def test_hub_kernel_wrappers_in_a_checkpointed_block_call_their_modules_own_forward(monkeypatch):
    """transformers 5.25's attention classes run under the ``kernels`` package's wrapper, which writes a
    context variable at every call (a write dynamo refuses inside a checkpoint: the compiled graph broke
    at every treated block). A checkpointed block's wrapped modules with no kernel installed call their
    class's own forward: the variable is never written in a treated step, the gradients are the
    untouched model's, and ``remat.remove`` puts the wrapper back; a module with a kernel installed
    keeps it."""
    import types as pytypes
    from remat.treat import hub_kernels
    model, make_inputs = FAMILIES["llama"]()
    wrapped = [m for m in model.modules() if hub_kernels._wrapped_forward(m) is not None]
    if not wrapped:
        pytest.skip("this transformers has no hub-kernel wrappers (before 5.25)")
    from kernels._internals.layer import layer as kernels_layer
    variable = kernels_layer._ACTIVE_KERNEL_FUNCS
    writes = []
    write = variable.set
    monkeypatch.setattr(variable, "set", lambda value: writes.append(value) or write(value))
    reference = copy.deepcopy(model)
    remat.apply(model, "full")
    assert all(patches.patch_of(m, "forward", tag="treatment-hub-kernels") is not None for m in wrapped)
    oracle.check(model, reference, _batch(make_inputs))
    writes.clear()   # the untouched copy's steps wrote it
    model(**_batch(make_inputs)).loss.backward()
    assert writes == []
    remat.remove(model)
    assert all("forward" not in m.__dict__ for m in wrapped)
    model(**_batch(make_inputs))
    assert len(writes) >= len(wrapped)
    # a kernel installed (kernelize sets its wrapper module's own forward): the module keeps the wrapper
    kernel = next(iter(wrapped[0]._kernel_funcs.values()))
    kernel.forward = pytypes.MethodType(type(kernel).forward, kernel)
    remat.apply(model, "full")
    assert patches.patch_of(wrapped[0], "forward", tag="treatment-hub-kernels") is None
    assert patches.patch_of(wrapped[1], "forward", tag="treatment-hub-kernels") is not None
