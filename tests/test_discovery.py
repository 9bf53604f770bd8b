"""Block and head discovery across families, with no per-model code."""
import pytest
import torch.nn as nn

import remat
from remat.treat.discovery import find_submodules

from families import FAMILIES

EXPECTED_LISTS = {
    "llama": ("model.layers",), "mistral": ("model.layers",), "qwen2": ("model.layers",),
    "qwen3": ("model.layers",), "gemma": ("model.layers",), "gpt2": ("transformer.h",),
    "gpt_neox": ("gpt_neox.layers",), "phi": ("model.layers",), "opt": ("model.decoder.layers",),
    "bert": ("bert.encoder.layer",), "vit": ("vit.encoder.layer",), "plain": ("blocks",),
    "t5": ("encoder.block", "decoder.block"),
    "bart": ("model.encoder.layers", "model.decoder.layers"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_block_lists_found(family):
    model, _ = FAMILIES[family]()
    structure = remat.discover(model)
    expected = EXPECTED_LISTS[family]
    if family == "vit" and hasattr(model.vit, "layers"):  # transformers 5 renamed encoder.layer
        expected = ("vit.layers",)
    assert structure.block_lists == expected
    assert len(structure.block_names) == sum(len(model.get_submodule(n)) for n in structure.block_lists)


@pytest.mark.parametrize("family,head", [("llama", "lm_head"), ("gpt2", "lm_head"), ("qwen2", "lm_head"),
                                         ("bert", "cls.predictions.decoder"), ("plain", None)])
def test_head_found(family, head):
    model, _ = FAMILIES[family]()
    assert remat.discover(model).head_name == head


def test_nested_lists_are_not_blocks():
    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(Expert() for _ in range(3))

    model = nn.Module()
    model.layers = nn.ModuleList(Layer() for _ in range(2))
    assert remat.discover(model).block_names == ("layers.0", "layers.1")


class _Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        return x + self.fc2(self.fc1(x).relu())


class _StagedEncoder(nn.Module):
    """PoolFormer's shape: ``stages`` is a list of lists of layers, which the forward loops over; the
    inner lists are never called."""

    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(nn.ModuleList(_Stage() for _ in range(2)) for _ in range(2))

    def forward(self, x):
        for stage in self.stages:
            for layer in stage:
                x = layer(x)
        return x


def test_lists_of_lists_give_their_layers_not_the_uncalled_lists():
    import copy

    import torch

    import oracle
    torch.manual_seed(0)
    model = _StagedEncoder().train()
    assert remat.discover(model).block_names == ("stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1")
    reference = copy.deepcopy(model)
    remat.apply(model, "full")
    # a treatment on a list that is never called would change nothing: the oracle's "saves less" fails then
    oracle.check(model, reference, torch.randn(4, 8), loss=lambda m, x: m(x).square().mean())


@pytest.mark.parametrize("model_type", ["poolformer", "pvt"])
def test_staged_vision_models_treat_their_layers(model_type):
    """PoolFormer's and PVT's stages are lists of layers (transformers' own models, from their config's
    defaults, shrunk by the zoo): ``full`` trains bitwise and saves less than the untouched model, which
    it would not were the never-called stage lists the blocks (the cell's mechanism check), and the
    stage layers are among the blocks."""
    import warnings

    import registry_cells as cells
    import registry_zoo as rz
    import zoo
    case = rz.case(model_type)
    blocks = remat.discover(zoo.build(case)).block_names
    assert any(name.count(".") >= 3 and name.split(".")[-2].isdigit() for name in blocks), blocks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cell = cells.run_cell(case, "full")
    assert cell.verdict == "exact", cell


def test_explicit_blocks_by_container_names_and_predicate():
    model, _ = FAMILIES["t5"]()
    assert len(remat.discover(model, blocks="decoder.block").block_names) == 2
    pred = remat.discover(model, blocks=lambda name, m: type(m).__name__ == "T5Block")
    assert pred.block_names == remat.discover(model).block_names
    with pytest.raises(ValueError, match="nested"):
        remat.discover(model, blocks=lambda name, m: "block" in name)


def test_clear_error_when_nothing_repeats():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    with pytest.raises(ValueError) as info:
        remat.discover(model)
    message = str(info.value)
    assert "blocks=" in message and "Containers found" in message


def test_bad_container_name_lists_candidates():
    model, _ = FAMILIES["llama"]()
    with pytest.raises(ValueError, match="model.layers"):
        remat.discover(model, blocks="model.blocks")


@pytest.mark.parametrize("family,attention,mlp", [
    ("llama", ["self_attn"], ["mlp"]), ("gpt2", ["attn"], ["mlp"]), ("bert", ["attention"], ["intermediate"]),
    ("t5", ["layer.0"], ["layer.1"]), ("opt", ["self_attn"], []),
])
def test_submodules(family, attention, mlp):
    model, _ = FAMILIES[family]()
    block = remat.discover(model).blocks(model)[0][1]
    assert [n for n, _ in find_submodules(block, "attention")] == attention
    assert [n for n, _ in find_submodules(block, "mlp")] == mlp


def test_t5_decoder_block_has_self_and_cross_attention():
    model, _ = FAMILIES["t5"]()
    assert [n for n, _ in find_submodules(model.decoder.block[0], "attention")] == ["layer.0", "layer.1"]


class Residual(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1))

    def forward(self, x):
        return x + self.mlp(x)


@pytest.mark.parametrize("container", [nn.Sequential, nn.ModuleList])
def test_model_that_is_its_block_list(container):
    blocks = [Residual() for _ in range(3)]
    model = nn.Sequential(*blocks) if container is nn.Sequential else nn.ModuleList(blocks)
    structure = remat.discover(model)
    assert structure.block_lists == ("",)
    assert structure.block_names == ("0", "1", "2")
    assert [m for _, m in structure.blocks(model)] == list(model)
    assert remat.discover(model, blocks="").block_names == ("0", "1", "2")


def test_root_sequential_of_blocks_is_treated_exactly():
    import copy

    import torch
    torch.manual_seed(0)
    model = nn.Sequential(*(Residual() for _ in range(3))).train()
    reference = copy.deepcopy(model)
    remat.apply(model, "full")
    x = torch.randn(4, 8)
    results = []
    for m in (model, reference):
        torch.manual_seed(1)
        m(x).square().mean().backward()
        results.append([p.grad for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert remat.api.treatments(model) == {"0": "full", "1": "full", "2": "full"}


def test_root_blocks_win_over_lists_inside_them():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(Residual() for _ in range(2))

    assert remat.discover(nn.Sequential(Block(), Block())).block_names == ("0", "1")


class OneBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Residual()])
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.layers[0](x))


@pytest.mark.parametrize("blocks", ["layers", "layers.0", ["layers.0"], lambda name, m: isinstance(m, Residual)])
def test_single_named_block_is_treated(blocks):
    model = OneBlock()
    assert remat.discover(model, blocks=blocks).block_names == ("layers.0",)
    remat.apply(model, "full", blocks=blocks)
    assert remat.api.treatments(model, blocks=blocks) == {"layers.0": "full"}


def test_single_block_is_not_discovered_automatically_and_the_message_says_how():
    with pytest.raises(ValueError) as info:
        remat.discover(OneBlock())
    message = str(info.value)
    assert "layers (ModuleList): 1 x ['Residual'] -- not taken: only one module" in message
    assert "blocks='layers'" in message


def test_message_names_a_root_sequential():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    with pytest.raises(ValueError) as info:
        remat.discover(model)
    message = str(info.value)
    assert "the model itself (Sequential): 3 x ['Linear', 'ReLU']" in message
    assert "no nn.ModuleList or nn.Sequential at all" not in message
    assert "single layers" in message


def test_message_when_there_is_no_container():
    with pytest.raises(ValueError, match="Linear holds no nn.ModuleList or nn.Sequential at all"):
        remat.discover(nn.Linear(3, 4))


def test_mixed_classes_are_explained():
    model = nn.Module()
    model.stages = nn.Sequential(Residual(), OneBlock())
    with pytest.raises(ValueError, match=r"stages \(Sequential\): 2 x \['OneBlock', 'Residual'\] -- not taken: mixed"):
        remat.discover(model)


def test_root_cannot_be_a_block():
    with pytest.raises(ValueError, match="names the model itself"):
        remat.discover(OneBlock(), blocks="")
    with pytest.raises(ValueError, match="the model itself"):
        remat.discover(OneBlock(), blocks=["", "layers.0"])


def test_moe_in_a_class_name_marks_only_the_mlp():
    """Qwen2-MoE's block holds Qwen2MoeAttention, Qwen2MoeSparseMoeBlock and Qwen2MoeRMSNorm."""
    def named(cls_name, base=nn.Linear):
        return type(cls_name, (base,), {})

    block = nn.Module()
    block.self_attn = named("FooMoeAttention")(4, 4)
    block.mlp = named("FooSparseMoeBlock")(4, 4)
    block.input_layernorm = named("FooMoeRMSNorm", nn.LayerNorm)(4)
    block.post_attention_layernorm = named("FooMoeRMSNorm", nn.LayerNorm)(4)
    assert [n for n, _ in find_submodules(block, "mlp")] == ["mlp"]
    assert [n for n, _ in find_submodules(block, "attention")] == ["self_attn"]
