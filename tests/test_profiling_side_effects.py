"""Planning and profiling leave a model exactly as they found it (issue 10).

Checked on CPU (the fake-tensor path) on a tiny Llama built with its config's defaults and on a
tiny CNN with BatchNorm: an applied plan (treatments, chunked head, the plan record), parameter
values, every ``.grad``, buffers, RNG state, training flags and ``requires_grad`` flags.
"""
import torch
import torch.nn as nn

import remat
from remat.api import current_plan, treatments
from remat.treat import patches


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config)


class Stage(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=stride, padding=1)
        self.bn = nn.BatchNorm2d(cout)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class TinyCNN(nn.Module):
    """Stages that change channels and resolution, then a pooled classifier."""

    def __init__(self):
        super().__init__()
        self.stages = nn.Sequential(Stage(3, 8, 1), Stage(8, 16, 2), Stage(16, 16, 1), Stage(16, 32, 2))
        self.classifier = nn.Linear(32, 5)

    def forward(self, x):
        return self.classifier(self.stages(x).mean((2, 3)))


def cnn_loss(model, batch):
    images, labels = batch
    return nn.functional.cross_entropy(model(images), labels)


def state(model):
    """Everything a plan must leave alone, as comparable values."""
    return {
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "grads": {k: (None if v.grad is None else v.grad.clone()) for k, v in model.named_parameters()},
        "grad_ids": {k: id(v.grad) for k, v in model.named_parameters()},
        "requires_grad": {k: v.requires_grad for k, v in model.named_parameters()},
        "buffers": {k: v.clone() for k, v in model.named_buffers()},
        "training": {k: m.training for k, m in model.named_modules()},
        "rng": torch.get_rng_state(),
        "patches": [(p.module, p.attribute, p.tag, id(p)) for p in patches.patches(model)],
        "forwards": {k: m.__dict__.get("forward") for k, m in model.named_modules()},
    }


def assert_same(before, after):
    for key in ("params", "buffers"):
        assert before[key].keys() == after[key].keys()
        for name in before[key]:
            assert torch.equal(before[key][name], after[key][name]), (key, name)
    for name, grad in before["grads"].items():
        other = after["grads"][name]
        assert (grad is None) == (other is None), name
        assert grad is None or torch.equal(grad, other), name
    assert before["grad_ids"] == after["grad_ids"]
    for key in ("requires_grad", "training", "forwards"):
        assert before[key] == after[key], key
    assert torch.equal(before["rng"], after["rng"])
    assert before["patches"] == after["patches"]


def test_plan_leaves_a_treated_llama_as_it_found_it():
    model = tiny_llama()  # use_cache=True, as from_pretrained gives it
    ids = torch.randint(0, 128, (2, 16))
    model.model.embed_tokens.weight.requires_grad_(False)   # a frozen parameter
    model(input_ids=ids, labels=ids).loss.backward()         # gradients the user has not used yet
    remat.apply(model, {"model.layers.0": "full", "model.layers.1": "selective"}, head="chunked")
    model.model.layers[2].eval()                              # mixed training flags
    torch.manual_seed(123)
    before_plan, before_treatments = current_plan(model), treatments(model)
    before = state(model)
    remat.plan(model, ids, "1GiB", gpu="h100")
    assert_same(before, state(model))
    assert current_plan(model) is before_plan
    assert treatments(model) == before_treatments == {"model.layers.0": "full", "model.layers.1": "selective",
                                                      "model.layers.2": "keep"}
    assert patches.patches(model, tag="head"), "the chunked head was taken off"
    assert not patches.patches(model, tag="profile-stub")


def test_profile_leaves_a_cnn_with_batchnorm_as_it_found_it():
    torch.manual_seed(0)
    model = TinyCNN()
    batch = (torch.randn(2, 3, 16, 16), torch.randint(0, 5, (2,)))
    cnn_loss(model, batch).backward()    # running statistics and gradients that are the user's
    remat.apply(model, "every:2")
    model.stages[1].bn.eval()
    before = state(model)
    remat.profile(model, batch, loss_fn=cnn_loss, gpu="h100")
    assert_same(before, state(model))
    assert treatments(model) == {"stages.0": "full", "stages.1": "keep", "stages.2": "full", "stages.3": "keep"}


def test_stubs_go_through_the_patch_registry():
    torch.manual_seed(0)
    model = TinyCNN()
    batch = (torch.randn(2, 3, 16, 16), torch.randint(0, 5, (2,)))
    seen = []

    def loss_fn(m, b):
        seen.append(sorted({(p.tag, type(p.module).__name__) for p in patches.patches(m)}))
        return cnn_loss(m, b)

    remat.profile(model, batch, loss_fn=loss_fn, gpu="h100")
    assert [("profile-stub", "Stage")] in seen          # the stubbed steps: every stage, through the registry
    assert not patches.patches(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
