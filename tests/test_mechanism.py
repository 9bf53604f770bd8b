"""The mechanism, not only the result: recomputed FLOPs and bytes kept for backward."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import remat
from remat.prove.memtrack import PeakTracker

from families import FAMILIES


def _step_flops(model, inputs):
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        model(**inputs).loss.backward()
    return counter.get_total_flops()


def _forward_flops(module, *args, **kwargs):
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        module(*args, **kwargs)
    return counter.get_total_flops()


def _llama_with_block_inputs():
    model, make_inputs = FAMILIES["llama"]()
    torch.manual_seed(0)
    inputs = make_inputs()
    captured = []
    hook = model.model.layers[0].register_forward_hook(
        lambda mod, args, kwargs, out: captured.append((args, kwargs)), with_kwargs=True)
    with torch.no_grad():
        model(**inputs)
    hook.remove()
    return model, inputs, captured[0]


def test_full_recomputes_exactly_one_forward_of_each_block():
    model, inputs, (args, kwargs) = _llama_with_block_inputs()
    block = model.model.layers[0]
    block_forward = _forward_flops(block, *args, **kwargs)
    hidden = args[0] if args else kwargs["hidden_states"]
    # non-reentrant checkpoint stops recomputing once every saved tensor is back: the last
    # projection (down_proj) saves nothing its own backward needs, so it is not re-run
    mlp_inner = block.mlp.act_fn(block.mlp.gate_proj(hidden)) * block.mlp.up_proj(hidden)
    last_projection = _forward_flops(block.mlp.down_proj, mlp_inner)
    keep = _step_flops(model, inputs)
    remat.apply(model, "full")
    full = _step_flops(model, inputs)
    assert block_forward > 0 and last_projection > 0
    assert full - keep == len(model.model.layers) * (block_forward - last_projection)


def test_selective_recomputes_no_matmul():
    model, inputs, _ = _llama_with_block_inputs()
    keep = _step_flops(model, inputs)
    remat.apply(model, "selective")
    assert _step_flops(model, inputs) == keep  # FLOPs counted are matmul/attention FLOPs


def test_attention_and_mlp_recompute_only_their_submodule():
    model, inputs, (args, kwargs) = _llama_with_block_inputs()
    block = model.model.layers[0]
    hidden = args[0] if args else kwargs["hidden_states"]
    mlp_forward = _forward_flops(block.mlp, hidden)
    keep = _step_flops(model, inputs)
    down_proj = _forward_flops(block.mlp.down_proj, torch.zeros(*hidden.shape[:-1], block.mlp.down_proj.in_features))
    remat.apply(model, "mlp")
    # early stop: the MLP's last projection is not re-run (see the test above)
    assert _step_flops(model, inputs) - keep == len(model.model.layers) * (mlp_forward - down_proj)
    remat.apply(model, "attention")
    extra = _step_flops(model, inputs) - keep
    assert 0 < extra < len(model.model.layers) * _forward_flops(block, *args, **kwargs) - mlp_forward * 3


def _kept_by_blocks(model, inputs):
    """Bytes still alive after the forward that the blocks' forwards allocated."""
    params = list(model.parameters())  # baseline: views of weights are not new memory
    tracker = PeakTracker(baseline=params)
    handles = []
    for block in model.model.layers:
        handles.append(block.register_forward_pre_hook(lambda *a: (tracker.__enter__(), None)[1]))
        handles.append(block.register_forward_hook(lambda *a: (tracker.__exit__(None, None, None), None)[1]))
    loss = model(**inputs).loss  # the graph (and what it saved) is alive while loss is
    kept = tracker.live_bytes() - sum(p.untyped_storage().nbytes() for p in params)
    for h in handles:
        h.remove()
    del loss
    return kept


def test_saved_bytes_drop_as_each_treatment_promises():
    model, make_inputs = FAMILIES["llama"]()
    torch.manual_seed(0)
    inputs = make_inputs(batch=4, seq=64)
    saved = {}
    for spec in ("keep", "selective", "attention", "mlp", "full"):
        remat.apply(model, spec)
        saved[spec] = _kept_by_blocks(model, inputs)
    hidden_bytes = inputs["inputs_embeds"].numel() * 4
    layers = len(model.model.layers)
    # full keeps only each block's output (the next block's input)
    assert layers * hidden_bytes <= saved["full"] < layers * hidden_bytes * 1.1
    assert saved["full"] < saved["selective"] < saved["keep"]
    assert saved["attention"] < saved["keep"] and saved["mlp"] < saved["keep"]
    # selective keeps matmul outputs but drops norms/activations: a large cut, not all
    assert saved["selective"] < 0.8 * saved["keep"]


@pytest.mark.parametrize("spec", ["every:2", "first:2"])
def test_shorthands_treat_the_blocks_they_name(spec):
    model, _ = FAMILIES["llama"]()
    remat.apply(model, spec)
    got = [b.__dict__.get("_remat") is not None for b in model.model.layers]
    assert got == ([True, False, True] if spec == "every:2" else [True, True, False])
