"""Kernels as a dimension of the plan (issue 39): Liger's fused ops per block instance, on the CPU.

No Triton here: liger-kernel's Python imports under a stub (``tests/_triton_stub.py``) whose kernel
launches raise and are counted. Three kinds of tests:

- wiring without liger-kernel: the plan field and its round trip, the per-class choice of kernels, the
  refusal (one line naming ``pip install remat[kernels]``) where liger-kernel does not import;
- with liger-kernel (the ``liger`` fixture; skipped where it is not installed): per-instance install and
  undo, state_dict keys, other models and transformers' classes untouched, fake-tensor profiles and
  plans of models remat patched, liger-kernel patched class-wide, or the Trainer's way, none of which
  ever launches a Triton kernel, and the stand-ins' saved bytes;
- numerics of remat's wiring: Liger's autograd functions replaced by plain-torch references of their
  math (:func:`references`), so a CPU model with ``kernels="liger"`` must match a stock copy's loss and
  every gradient in fp32 (and the references must have run: a kernel installed on nothing fails here).
"""
import collections
import contextlib
import copy
import json
import pickle
import sys

import pytest
import torch
import torch.nn.functional as F

import remat
import _triton_stub
from remat.planning.kernels import block_kernels, kernel_choices, kernel_options, plan_kernels, with_kernels
from remat.planning.plans import Plan
from remat.planning.records import block_records
from remat.presets import build_model, load_config
# private: the stand-ins of Liger's functions on fake tensors, entered alone to read what each one
# saves and refuses; a fake profile (the public path) shows only a block's totals
from remat.profiling._liger import liger_stand_ins
from remat.treat import patches

pytest.importorskip("transformers")
BATCH, SEQ = 2, 64


def tiny(name="llama-tiny", seed=0):
    torch.manual_seed(seed)
    return build_model(load_config(name)).train()


def ids(seed=1, seq=SEQ):
    return torch.randint(0, 500, (BATCH, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def liger():
    """liger-kernel imported (under the Triton stub where Triton is absent) for the module's tests."""
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(_triton_stub.liger_imported())
    except ImportError as error:
        pytest.skip(f"liger-kernel is not installed ({error}): pip install remat[kernels]")
    with stack:
        yield sys.modules["liger_kernel.ops"]


@pytest.fixture
def no_launch():
    del _triton_stub.LAUNCHES[:]
    yield
    assert _triton_stub.LAUNCHES == [], f"Triton kernels launched: {_triton_stub.LAUNCHES}"


# -- without liger-kernel -------------------------------------------------------------------------

NAMES = [f"model.layers.{i}" for i in range(4)]


def test_a_plan_records_its_kernels_and_round_trips(tmp_path):
    plan = Plan({n: "full" for n in NAMES}, head="liger", kernels={NAMES[0]: "liger", NAMES[1]: "stock"})
    assert [plan.kernel_of(n) for n in NAMES] == ["liger", "stock", "stock", "stock"]
    path = tmp_path / "plan.json"
    plan.save(str(path))
    loaded = Plan.load(str(path))
    assert loaded == plan and dict(loaded.kernels) == {NAMES[0]: "liger", NAMES[1]: "stock"}
    assert "Liger kernels on 1 of 4 blocks" in loaded.summary()
    assert [r.kernel for r in block_records(loaded, NAMES)] == ["liger", "stock", "stock", "stock"]
    every = Plan({n: "keep" for n in NAMES}, kernels="liger")
    assert every.summary().endswith("; Liger kernels") and pickle.loads(pickle.dumps(every)) == every
    # a plan file from before kernels (no field) loads as stock
    old = plan.to_dict()
    del old["kernels"]
    old["head"] = "plain"
    assert Plan.from_dict(old).kernels is None and Plan.from_dict(old).kernel_of(NAMES[0]) == "stock"


def test_a_plan_names_its_kernels_by_block_through_a_wrapper_prefix():
    plan = Plan({n: "full" for n in NAMES}, kernels={n: "liger" for n in NAMES[:2]})
    wrapped = [f"base_model.model.{n}" for n in NAMES]
    renamed = remat.planning.plans.resolve(plan, wrapped)
    assert renamed.kernel_of(wrapped[0]) == "liger" and renamed.kernel_of(wrapped[3]) == "stock"


@pytest.mark.parametrize("kernels, match", [
    ("fused", "'kernels' must be one of stock, liger"),
    ({"model.layers.9": "liger"}, "names blocks the plan does not have"),
    ({NAMES[0]: "triton"}, "mapping entries"),
])
def test_a_wrong_kernels_field_is_named(tmp_path, kernels, match):
    data = Plan({n: "full" for n in NAMES}).to_dict()
    data["kernels"] = kernels
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
        Plan.load(str(path))


def test_kernel_options_read_as_the_planner_takes_them():
    assert kernel_options(None) == () and kernel_options("liger") == ("liger",)
    assert kernel_options(["stock", "liger", "stock"]) == ("stock", "liger")
    for bad in ("triton", (), 3):
        with pytest.raises(ValueError, match="kernels must be None"):
            kernel_options(bad)


def test_a_choice_of_kernels_per_class_turns_the_profile_into_its_variant():
    model = tiny()
    prof = remat.profile(model, ids(seq=16), gpu="h100", head_modes=("plain",))
    keep = prof.classes[0]["keep"]
    fused = {t: type(c)(**{**c.__dict__, "kept": c.kept // 2, "fwd_s": c.fwd_s / 2}) for t, c in prof.classes[0].items()}
    two = type(prof)(**{**prof.__dict__, "classes": prof.classes + (fused,), "class_kernels": ("stock", "liger"),
                        "kernel_variants": ({"stock": 0, "liger": 1},) * 2})
    assert kernel_choices(two) == [{0: "stock"}, {0: "liger"}]   # the measured kernel first: ties go to it
    chosen = with_kernels(two, {0: "liger"})
    assert chosen.classes == (fused,) and chosen.class_kernels == ("liger",) and chosen.kernel_variants == ()
    assert block_kernels(chosen) == ["liger"] * 4 and with_kernels(two, {0: "stock"}).classes[0]["keep"] == keep
    assert plan_kernels(NAMES, ["liger"] * 4) == "liger" and plan_kernels(NAMES, ["stock"] * 4) is None
    assert plan_kernels(NAMES, ["liger", "stock", "stock", "stock"]) == dict(zip(NAMES, ["liger"] + ["stock"] * 3))
    with pytest.raises(ValueError, match="not profiled with kernels 'triton'"):
        with_kernels(two, {0: "triton"})


@pytest.fixture
def without_liger(monkeypatch):
    """liger-kernel made unimportable, whether or not it is installed."""
    for name in [n for n in sys.modules if n.startswith("liger_kernel")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    from remat.treat import kernels
    monkeypatch.setattr(kernels, "_LIGER", {})


def test_liger_kernels_without_liger_kernel_are_refused_in_one_line_naming_the_extra(without_liger):
    model = tiny()
    with pytest.raises(ValueError, match=r"needs liger-kernel.*pip install remat\[kernels\]") as info:
        remat.apply(model, "full", kernels="liger")
    assert "\n" not in str(info.value) and not patches.patches(model)
    with pytest.raises(ValueError, match=r"pip install remat\[kernels\]"):
        remat.plan(model, ids(), "1GiB", kernels=("stock", "liger"))
    with pytest.raises(ValueError, match=r"pip install remat\[kernels\]"):
        remat.apply(model, Plan({f"model.layers.{i}": "full" for i in range(4)}, kernels="liger"))
    from remat.cli import main
    assert main(["plan", "--model", "llama-tiny", "--batch", "2", "--seq", "64", "--budget", "4MiB",
                 "--kernels", "liger"]) == 2
    remat.apply(model, "full", kernels="stock")   # stock needs nothing
    assert remat.current_plan(model).kernels is None


# -- with liger-kernel ----------------------------------------------------------------------------


def kernel_patches(model):
    return {(type(p.module).__name__, p.tag) for p in patches.patches(model) if p.tag.startswith("kernels")}


def test_liger_kernels_are_installed_per_instance_and_remove_undoes_them(liger):
    from transformers.models.llama import modeling_llama
    rope, mlp_forward = modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaMLP.forward
    model, other = tiny(), tiny()
    keys = list(model.state_dict())
    remat.apply(model, "full", kernels="liger")
    assert kernel_patches(model) == {("LlamaRMSNorm", "kernels"), ("LlamaMLP", "kernels"),
                                     ("LlamaAttention", "kernels"), ("LlamaForCausalLM", "kernels-head"),
                                     ("LlamaRMSNorm", "kernels-head")}
    layer = model.model.layers[0]
    for module in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp, layer.self_attn):
        assert "forward" in module.__dict__
    assert remat.current_plan(model).kernels == "liger" and remat.current_plan(model).head == "liger"
    assert list(model.state_dict()) == keys
    # nothing class-wide: transformers' classes and module globals, and the other model, as they were
    assert modeling_llama.apply_rotary_pos_emb is rope and modeling_llama.LlamaMLP.forward is mlp_forward
    assert not patches.patches(other) and "forward" not in other.model.layers[0].mlp.__dict__
    copied = copy.deepcopy(model)
    assert kernel_patches(copied) == kernel_patches(model)
    assert kernel_patches(pickle.loads(pickle.dumps(model))) == kernel_patches(model)
    remat.remove(model)
    assert not patches.patches(model)
    for module in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp, layer.self_attn, model):
        assert "forward" not in module.__dict__
    remat.apply(model, "full", head="plain", kernels="liger")   # a head asked for stays
    assert ("LlamaForCausalLM", "kernels-head") not in kernel_patches(model)


def test_a_family_liger_does_not_serve_keeps_its_modules_and_says_so(liger):
    model = tiny("gpt2-tiny") if "gpt2-tiny" in remat.presets.PRESETS else None
    if model is None:
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=500, n_positions=64))
    with pytest.warns(UserWarning, match="keep some or all of their stock modules"):
        remat.apply(model, "full", kernels="liger")
    assert not kernel_patches(model)
    notes = remat.current_plan(model).notes["kernels_stock"]
    assert "not a family remat installs Liger's kernels on" in next(iter(notes.values()))
    plan = remat.plan(model, torch.randint(0, 500, (2, 32)), "1GiB", kernels="liger", gpu="h100")
    assert plan.kernels is None and "not a family" in next(iter(plan.notes["kernels_stock"].values()))


def test_selective_is_refused_over_liger_s_in_place_rotary_embedding(liger):
    model = tiny()
    with pytest.raises(ValueError, match="rotates q and k in place"):
        remat.apply(model, "selective", kernels="liger")
    assert not patches.patches(model)


@contextlib.contextmanager
def references(ops):
    """Liger's autograd functions computed by plain torch (their math, fp32), counted per kernel."""
    import liger_kernel.transformers.rope as rope_module
    from transformers.models.llama.modeling_llama import rotate_half
    calls = collections.Counter()

    def rms_norm(x, weight, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None):
        calls["rms_norm"] += 1
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight)

    def silu_mul(a, b, gate_multiplier=1.0, down_multiplier=1.0):
        calls["swiglu"] += 1
        return F.silu(a) * b

    def dispatch(op, q, k, cos, sin, position_ids=None, unsqueeze_dim=1, **_):
        calls[op] += 1
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def gelu_mul(a, b):
        calls["geglu"] += 1
        return F.gelu(a, approximate="tanh") * b

    def fused_loss(x, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse=0.0, smoothing=0.0,
                   reduction="mean", softcap=None, *rest):
        calls["fused_loss"] += 1
        logits = F.linear(x, weight, bias).float()
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
        return loss, None, None, None

    swaps = [(ops.LigerRMSNormFunction, "apply", staticmethod(rms_norm)),
             (ops.LigerSiLUMulFunction, "apply", staticmethod(silu_mul)),
             (ops.LigerGELUMulFunction, "apply", staticmethod(gelu_mul)),
             (ops.LigerFusedLinearCrossEntropyFunction, "apply", staticmethod(fused_loss)),
             (rope_module, "dispatch", dispatch)]
    before = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in swaps]
    for owner, name, value in swaps:
        setattr(owner, name, value)
    try:
        yield calls
    finally:
        for owner, name, value in before:
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def step(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("spec, tile", [("keep", None), ("full", None), ("full+tiled", 16), ("attn-saved", None)])
def test_liger_kernels_give_the_stock_model_s_loss_and_gradients(liger, spec, tile):
    stock = tiny()
    fused = copy.deepcopy(stock)
    want_loss, want = step(stock, ids())
    with references(liger) as calls:
        remat.apply(fused, spec, kernels="liger", tile_tokens=tile)
        loss, grads = step(fused, ids())
    layers = len(fused.model.layers)
    assert calls["rope"] >= layers and calls["swiglu"] >= layers and calls["fused_loss"] == 1
    assert calls["rms_norm"] >= 2 * layers + 1   # the blocks' norms and the final one
    if tile:   # the tiled sub-modules ran Liger's kernels a chunk at a time: many calls per block
        assert calls["swiglu"] >= layers * (BATCH * SEQ // tile)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_fake_profile_of_liger_kernels_never_launches_triton_and_keeps_less(liger, no_launch):
    from liger_kernel.ops import LigerRMSNormFunction
    apply_before = LigerRMSNormFunction.__dict__.get("apply")
    model = tiny()
    prof = remat.profile(model, ids(), kernels=("stock", "liger"), gpu="h100")
    assert prof.class_kernels == ("stock", "liger") and prof.kernel_variants == ({"stock": 0, "liger": 1},) * 2
    stock, fused = prof.classes
    assert fused["keep"].kept < stock["keep"].kept and fused["keep"].fwd_s < stock["keep"].fwd_s
    assert "selective" in stock and "selective" not in fused and "rotates q and k" in prof.notes["liger:selective"]
    liger_head = prof.head("liger")
    assert liger_head.head_fwd_peak < prof.head("plain").head_fwd_peak
    assert LigerRMSNormFunction.__dict__.get("apply") is apply_before   # the stand-ins are put back
    plan = remat.plan(model, ids(), "4MiB", kernels=("stock", "liger"), profiled=prof)
    assert plan.kernels == "liger"
    remat.apply(model, Plan.from_dict(json.loads(json.dumps(plan.to_dict()))))
    assert ("LlamaMLP", "kernels") in kernel_patches(model)


def _stand_in_saves(function, *inputs):
    """The storages (by bytes) ``function``'s stand-in saves, and its outputs, on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    saved = []
    with FakeTensorMode(), liger_stand_ins():
        fakes = [torch.empty(s, dtype=d).requires_grad_(d.is_floating_point) if isinstance(s, tuple) else s
                 for s, d in inputs]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = function.apply(*fakes)
    return fakes, {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in saved}, out


def test_the_stand_ins_save_what_liger_s_functions_save(liger):
    bf16, f32 = torch.bfloat16, torch.float32
    x, saved, y = _stand_in_saves(liger.LigerRMSNormFunction, ((2, 8, 64), bf16), ((64,), bf16), (1e-6, None),
                                  (0.0, None), ("llama", None), (True, None), (None, None))
    assert saved == {id(x[0].untyped_storage()): 2 * 8 * 64 * 2, id(x[1].untyped_storage()): 128,
                     next(k for k in saved if k not in (id(x[0].untyped_storage()), id(x[1].untyped_storage()))): 16 * 4}
    assert y.shape == x[0].shape and y.dtype == bf16
    (a, b), saved, c = _stand_in_saves(liger.LigerSiLUMulFunction, ((16, 96), bf16), ((16, 96), bf16))
    assert set(saved) == {id(a.untyped_storage()), id(b.untyped_storage())} and c.shape == (16, 96)
    (h, w, target), saved, out = _stand_in_saves(liger.LigerFusedLinearCrossEntropyFunction, ((128, 64), bf16),
                                                 ((500, 64), bf16), ((128,), torch.long))
    assert sorted(saved.values()) == [128 * 64 * 2, 500 * 64 * 2] and out[0].shape == () and out[0].dtype == f32


def test_the_stand_in_rotary_embedding_rotates_q_and_k_in_place_and_saves_its_tables(liger):
    from torch._subclasses.fake_tensor import FakeTensorMode
    saved = []
    with FakeTensorMode(), liger_stand_ins():
        q = torch.empty(2, 16, 4, 8).transpose(1, 2)    # [batch, heads, seq, dim] as the attention makes it
        k = torch.empty(2, 16, 2, 8).transpose(1, 2)
        cos, sin = torch.empty(1, 16, 8), torch.empty(1, 16, 8)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            from liger_kernel.transformers.rope import liger_rotary_pos_emb
            q2, k2 = liger_rotary_pos_emb(q.requires_grad_(), k.requires_grad_(), cos, sin)
    assert q2.untyped_storage() is q.untyped_storage() or q2.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
    assert {id(t.untyped_storage()) for t in saved} == {id(cos.untyped_storage()), id(sin.untyped_storage())}
    assert q2.shape == q.shape and k2.shape == k.shape


@pytest.fixture
def llama_restored(liger, monkeypatch):
    """transformers' Llama module as it was after the test: liger-kernel's patches rebind its classes and
    its ``apply_rotary_pos_emb`` (its instance patching, the Trainer's ``use_liger_kernel=True``, too)."""
    from transformers.models.llama import modeling_llama
    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    monkeypatch.setattr(modeling_llama.LlamaForCausalLM, "forward", modeling_llama.LlamaForCausalLM.forward)


@pytest.fixture
def class_patched(llama_restored):
    """transformers' Llama classes patched by liger-kernel itself (``apply_liger_kernel_to_llama()``), undone after."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    apply_liger_kernel_to_llama()


def test_a_model_liger_kernel_patched_class_wide_plans_on_fake_tensors_and_applies(class_patched, no_launch):
    model = tiny()
    assert type(model.model.layers[0].mlp).__name__ == "LigerSwiGLUMLP"
    with pytest.raises(ValueError, match="does not undo another library's patches"):
        remat.apply(model, "full", kernels="stock")
    with pytest.raises(ValueError, match="does not undo another library's patches"):
        remat.plan(model, ids(), "4MiB", kernels="stock")
    plan = remat.plan(model, ids(), "4MiB", kernels=("stock", "liger"), gpu="h100")
    assert plan.kernels == "liger" and plan.head in ("plain", "chunked") and "no stock variant" in plan.notes["kernels"]
    remat.apply(model, plan)
    assert not kernel_patches(model)          # Liger's own kernels are there already: nothing installed


def test_a_model_patched_as_the_trainer_patches_it_plans_and_remove_leaves_liger_s_patch(llama_restored, no_launch):
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    model = tiny()
    _apply_liger_kernel_to_instance(model=model)       # what use_liger_kernel=True does at train()
    liger_forward = model.model.layers[0].mlp.__dict__["forward"]
    plan = remat.plan(model, ids(), "4MiB", gpu="h100")
    assert plan.kernels == "liger" and plan.head != "liger"   # its plain head is Liger's fused loss already
    remat.apply(model, plan)
    remat.remove(model)
    assert model.model.layers[0].mlp.__dict__["forward"] is liger_forward


def test_remat_plan_kernels_liger_on_the_cpu(liger, no_launch, capsys, tmp_path):
    from remat.cli import main
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-tiny", "--batch", "2", "--seq", "64", "--budget", "4MiB",
                 "--kernels", "both", "--out", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Liger kernels" in out and "Liger's fused norms, gated MLP and rotary embedding on 4 of 4 blocks" in out
    assert Plan.load(str(path)).kernels == "liger"


class _Rows(torch.utils.data.Dataset):
    def __init__(self, count=8, seq=32):
        g = torch.Generator().manual_seed(3)
        self.rows = [torch.randint(0, 500, (seq,), generator=g) for _ in range(count)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i].clone()}


def _train(tmp_path, callbacks):
    from transformers import Trainer, TrainingArguments
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, report_to="none",
                             use_cpu=True, seed=7, learning_rate=1e-2, save_strategy="no", use_liger_kernel=True,
                             logging_steps=1)
    trainer = Trainer(model=tiny(), args=args, train_dataset=_Rows(), callbacks=callbacks)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer.model


def test_the_trainer_s_use_liger_kernel_with_remat_s_callback_trains_as_liger_alone(liger, llama_restored, tmp_path):
    from transformers.utils import is_liger_kernel_available
    if not is_liger_kernel_available():
        pytest.skip("transformers does not see liger-kernel's package metadata")
    from remat.integrations.hf import RematCallback
    said = []
    with references(liger) as calls:
        alone, _ = _train(tmp_path / "alone", [])
        fused = calls["fused_loss"]
        losses, model = _train(tmp_path / "remat", [RematCallback(budget="4MiB", say=said.append)])
    plan = remat.current_plan(model)
    assert fused == 3 and plan is not None and plan.kernels == "liger"
    assert any("use_liger_kernel=True" in line for line in said)
    assert any(t != "keep" for t in plan.blocks.values())   # the budget made it treat blocks
    assert losses == pytest.approx(alone, rel=1e-5)


def test_liger_kernels_under_lora_train_the_adapters_as_the_stock_model_does(liger):
    from peft import LoraConfig, get_peft_model
    stock = get_peft_model(tiny(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    fused = copy.deepcopy(stock)
    want_loss, want = step(stock, ids())
    with references(liger) as calls:
        remat.apply(fused, "full", kernels="liger")
        loss, grads = step(fused, ids())
    assert calls["fused_loss"] == 1 and calls["swiglu"] >= 4 and remat.current_plan(fused).head == "liger"
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert [n for n in grads if "lora" in n]
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_liger_function_without_a_stand_in_is_refused_by_name_on_fake_tensors(liger):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(), liger_stand_ins():
        x, w, b = torch.empty(4, 8), torch.empty(8), torch.empty(8)
        with pytest.raises(ValueError, match="cannot profile Liger's LigerLayerNormFunction with fake tensors"):
            liger.LigerLayerNormFunction.apply(x, w, b, 1e-5)


def test_tiled_runs_the_liger_modules_of_a_class_patched_model_chunk_by_chunk(liger, llama_restored):
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    stock = tiny()
    want_loss, want = step(stock, ids())
    apply_liger_kernel_to_llama()
    fused = tiny()
    fused.load_state_dict(stock.state_dict())
    assert type(fused.model.layers[0].post_attention_layernorm).__name__ == "LigerRMSNorm"
    with references(liger) as calls:
        remat.apply(fused, "full+tiled", tile_tokens=16)
        loss, grads = step(fused, ids())
    assert calls["swiglu"] >= len(fused.model.layers) * (BATCH * SEQ // 16)   # a chunk at a time
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _family(kind):
    from transformers import AutoModelForCausalLM, Gemma2Config, GemmaConfig, Qwen3Config
    shape = dict(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    config = {"qwen3": lambda: Qwen3Config(**shape), "gemma": lambda: GemmaConfig(**shape),
              "gemma2": lambda: Gemma2Config(**shape, attn_implementation="eager")}[kind]()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).train()


@pytest.mark.parametrize("kind", ["qwen3", "gemma", "gemma2"])
def test_each_family_s_kernels_match_its_stock_modules(liger, kind):
    """Liger's settings per family (norm offset and casting, Qwen3's q/k norms, Gemma-2's four norms not in
    place, GeGLU, the soft-capped fused loss) reproduce the family's own modules."""
    stock = _family(kind)
    fused = copy.deepcopy(stock)
    want_loss, want = step(stock, ids())
    with references(liger) as calls:
        remat.apply(fused, "full", kernels="liger")
        loss, grads = step(fused, ids())
    norms = {"qwen3": 4, "gemma": 2, "gemma2": 4}[kind] * 2 + 1
    assert calls["rms_norm"] >= norms and calls["rope"] >= 2 and calls["fused_loss"] == 1
    assert calls["geglu" if kind.startswith("gemma") else "swiglu"] >= 2
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("kernels, head", [("liger", None), (None, "liger"), ({"model.layers.0": "liger"}, None)])
def test_the_doctor_simulates_a_liger_plan_on_liger_s_kernels(liger, kernels, head):
    """``remat doctor`` on a model with a plan on Liger's kernels (or its fused-loss head) profiles with
    those kernels: the plan's ``liger`` head was once not among the profiled heads and the doctor raised.
    Its ``keep-fits`` peak is the one a profile with Liger's kernels predicts, not the stock model's."""
    from remat.diagnosis import doctor
    from remat.planning.kernels import with_kernels
    model = tiny()
    with references(liger):
        plan = Plan({n: "full" for n in NAMES}, head=head or "liger", kernels=kernels)
        remat.apply(model, plan)
        findings = doctor(model, ids(), budget="1GiB")
        assert [f.check for f in findings] == ["keep-fits"]
        stock = remat.simulate(remat.profile(model, ids()), Plan({n: "keep" for n in NAMES}))
        prof = remat.profile(model, ids(), kernels=("stock", "liger") if kernels != "liger" else "liger")
        if prof.kernel_variants:
            prof = with_kernels(prof, {0: plan.kernel_of(NAMES[0])})
        fused = remat.simulate(prof, Plan({n: "keep" for n in NAMES}, head="liger"))
    assert findings[0].predicted_peak_bytes == fused.peak_bytes != stock.peak_bytes
