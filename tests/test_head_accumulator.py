"""The chunked head's weight-gradient accumulator for bf16 heads (issue 11), on the CPU.

A bf16 sum with the batch's target rows summed in fp32 beside it (``_TargetRows``): its
gradient error against an fp64 reference, its memory against the fp32 sum, when it is used,
and its in-place backward scaling under retained graphs, scaled losses and accumulation.
"""
from __future__ import annotations

import pytest
import torch

from remat.prove.memtrack import PeakTracker
# private names of chunked_loss below: unit tests of the accumulator's parts, which a public call runs only together
from remat.head import chunked_loss
from remat.head.chunked_loss import _Accumulator, _TargetRows, chunked_cross_entropy

HIDDEN, VOCAB, TOKENS, CHUNK = 64, 16384, 1024, 64   # 16 chunks: a bf16 sum rounds 16 times


def _head(seed=0, temperature=1.0, tokens=TOKENS):
    """bf16 hidden states and head, and targets drawn as natural text draws them (few tokens often)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, HIDDEN, generator=g)
    w = torch.randn(VOCAB, HIDDEN, generator=g) * temperature / HIDDEN ** 0.5
    targets = (torch.rand(tokens, generator=g) ** 3 * VOCAB).long().clamp(max=VOCAB - 1)
    targets[::7] = -100
    return h.bfloat16(), w.bfloat16(), targets


def _weight_grad(h, w, targets, accumulator=None, monkeypatch=None, chunk=CHUNK):
    w = w.clone().requires_grad_()
    if accumulator is not None:
        monkeypatch.setattr(chunked_loss, "_accumulator", accumulator)
    chunked_cross_entropy(h, w, None, targets, chunk_tokens=chunk).backward()
    return w.grad


def _reference(h, w, targets):
    """The weight gradient in fp64 from the same bf16 inputs."""
    valid = targets != -100
    p = torch.softmax(h.double() @ w.double().T, 1)
    p[valid.nonzero().squeeze(1), targets[valid]] -= 1
    p[~valid] = 0
    return (p / valid.sum()).T @ h.double()


def _bf16_sum(weight, targets, ignore_index, cd, chunk):
    """A plain bf16 running sum, rounded once a chunk (what Liger keeps)."""
    class Bf16Sum:
        full = torch.zeros(weight.shape, dtype=weight.dtype)

        def columns(self, m):
            return None

        def add(self, g, hc, gathered=False):
            self.full.addmm_(g.t(), hc)

        def finish(self, dtype):
            return [self.full]
    return Bf16Sum()


def _fp32_sum(weight, targets, ignore_index, cd, chunk):
    return _Accumulator(weight.shape, weight.device)


@pytest.mark.parametrize("temperature, bf16_worse", [(1.0, True), (8.0, False)])
def test_target_rows_keep_the_fp32_sums_error(monkeypatch, temperature, bf16_worse):
    """Against fp64: within 1.05x the fp32 sum's error. With a flat softmax a bf16 sum of the
    same chunks is measurably worse (so the comparison can fail); with a peaked one (8x the
    logits) the logits' own bf16 rounding dominates every path's error."""
    h, w, targets = _head(temperature=temperature)
    truth = _reference(h, w, targets)

    def error(grad):
        return ((grad.double() - truth).norm() / truth.norm()).item()

    with monkeypatch.context() as m:
        fp32 = error(_weight_grad(h, w, targets, _fp32_sum, m))
    with monkeypatch.context() as m:
        bf16 = error(_weight_grad(h, w, targets, _bf16_sum, m))
    seen = []
    with monkeypatch.context() as m:
        m.setattr(_TargetRows, "finish", lambda self, dtype, f=_TargetRows.finish: seen.append(1) or f(self, dtype))
        ours = error(_weight_grad(h, w, targets))
    assert seen, "the bf16 head did not use the target-rows accumulator"
    assert ours <= 1.05 * fp32
    if bf16_worse:
        assert bf16 >= 1.1 * ours


def test_target_rows_equal_the_fp32_sum_where_they_are_summed_in_fp32(monkeypatch):
    """The target rows are the fp32 sum's but for the bf16 roundings of what they got before
    their first use (``p`` terms only, small): within one bf16 rounding a row (2^-9 of its
    norm), and far closer on average than a bf16 running sum's; the other rows differ by a bf16
    rounding a chunk at most."""
    h, w, targets = _head(seed=1)
    with monkeypatch.context() as m:
        fp32 = _weight_grad(h, w, targets, _fp32_sum, m).float()
    with monkeypatch.context() as m:
        bf16 = _weight_grad(h, w, targets, _bf16_sum, m).float()
    ours = _weight_grad(h, w, targets).float()
    rows = torch.unique(targets[targets != -100])

    def row_errors(grad):
        return (grad[rows] - fp32[rows]).norm(dim=1) / fp32[rows].norm(dim=1)
    assert row_errors(ours).max() <= 2 ** -9
    assert row_errors(ours).mean() <= 0.05 * row_errors(bf16).mean()
    others = torch.ones(VOCAB, dtype=torch.bool)
    others[rows] = False
    torch.testing.assert_close(ours[others], fp32[others], rtol=2 ** -4, atol=1e-6)


def test_target_rows_come_in_the_order_of_their_first_use_with_a_prefix_a_chunk():
    targets = torch.tensor([5, 3, 5, 9, 3, 0, 7, 9])
    rows, in_use = chunked_loss._by_first_use(targets, chunk=3)
    assert rows.tolist() == [5, 3, 9, 0, 7] and in_use == [2, 4, 5]


def test_padding_the_target_rows_to_an_aligned_count_changes_no_gradient(monkeypatch):
    """The target rows are padded with row 0 to a multiple of ``_ALIGN_ROWS`` (cuBLAS's fast
    kernels need aligned rows): the gradient is bit for bit the unpadded one's, whose count
    is not a multiple of it here."""
    h, w, targets = _head(seed=5)
    count = torch.unique(targets.masked_fill(targets == -100, 0)).numel()
    assert count % chunked_loss._ALIGN_ROWS, "the targets must need padding for this test to say anything"
    padded = _weight_grad(h, w, targets)
    with monkeypatch.context() as m:
        m.setattr(chunked_loss, "_ALIGN_ROWS", 1)
        unpadded = _weight_grad(h, w, targets)
    assert torch.equal(padded, unpadded)


def test_target_rows_hold_fewer_bytes_than_the_fp32_sum(monkeypatch):
    """The whole head's peak (forward and backward): the fp32 sum (4 bytes a weight) and its
    scaled copy in backward give way to a bf16 sum scaled in place, plus fp32 target rows."""
    h, w, targets = _head(seed=2)

    def peak(accumulator=None):
        with monkeypatch.context() as m, PeakTracker() as tracker:
            _weight_grad(h, w, targets, accumulator, m)
        return tracker.peak

    weight_bytes = VOCAB * HIDDEN * 2
    saved = peak(_fp32_sum) - peak()
    # the fp32 rows, one chunk's gathered columns, the rows' bf16 copy, finding the targets
    target_rows = min(TOKENS + 1, VOCAB) * (HIDDEN * 4 + CHUNK * 2 + HIDDEN * 2) + 16 * TOKENS
    assert weight_bytes - target_rows <= saved <= weight_bytes


def test_small_vocabularies_and_other_dtypes_keep_the_fp32_sum():
    """Where the target rows would not hold fewer bytes (a vocabulary not much larger than the
    tokens), and for fp32 or fp16 heads, the fp32 sum stays."""
    w = torch.zeros(VOCAB, HIDDEN, dtype=torch.bfloat16)
    targets = torch.zeros(TOKENS, dtype=torch.long)
    assert isinstance(chunked_loss._accumulator(w, targets, -100, torch.bfloat16, CHUNK), _TargetRows)
    small = torch.zeros(2 * TOKENS, HIDDEN, dtype=torch.bfloat16)
    assert isinstance(chunked_loss._accumulator(small, targets, -100, torch.bfloat16, CHUNK), _Accumulator)
    for dtype in (torch.float32, torch.float16):
        assert isinstance(chunked_loss._accumulator(w.to(dtype), targets, -100, dtype, CHUNK), _Accumulator)
    assert isinstance(chunked_loss._accumulator(w, targets, -100, torch.float32, CHUNK), _Accumulator)


def test_in_place_scaling_under_retained_graphs_scaled_losses_and_accumulation():
    """The bf16 sum is scaled where it lies at the first backward and handed on as the weight's
    gradient: a gradient already handed out is never changed by a later backward."""
    h, w, targets = _head(seed=3, tokens=256)
    w = w.requires_grad_()
    loss = chunked_cross_entropy(h, w, None, targets, chunk_tokens=CHUNK)
    first = torch.autograd.grad(loss, w, retain_graph=True)[0]
    kept = first.clone()
    second = torch.autograd.grad(loss * 0.5, w, retain_graph=True)[0]
    assert torch.equal(first, kept)
    torch.testing.assert_close(second, 0.5 * kept, rtol=0, atol=0)  # a power of two: exact
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(w.grad, 2 * kept, rtol=0, atol=0)
    # micro-steps: the second step's gradient is added to the first's
    w.grad = None
    for _ in range(2):
        (chunked_cross_entropy(h, w, None, targets, chunk_tokens=CHUNK) * 0.25).backward()
    torch.testing.assert_close(w.grad, 0.5 * kept, rtol=0, atol=0)


def test_fake_tensors_plan_for_the_most_target_rows():
    """Planning without values (fake tensors): the first ``capacity`` rows stand in for the
    targets, so the memory is the most any batch of that shape needs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        h = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16)
        w = torch.empty(VOCAB, HIDDEN, dtype=torch.bfloat16)
        targets = torch.zeros(TOKENS, dtype=torch.long)
        acc = chunked_loss._accumulator(w, targets, -100, torch.bfloat16, CHUNK)
        assert isinstance(acc, _TargetRows) and acc.rows.numel() == chunked_loss._aligned(TOKENS + 1)
        acc.add(torch.empty(CHUNK, VOCAB, dtype=torch.bfloat16), h[:CHUNK])
        assert acc.finish(torch.bfloat16)[0].shape == (VOCAB, HIDDEN)


def test_a_second_backward_after_a_zero_scale_or_through_copying_hooks():
    """A first backward whose gradient is 0 leaves nothing to rescale: a second one says so
    instead of returning nan. Under a saved-tensor hook that unpacks copies (``save_on_cpu``)
    each backward scales its own copy."""
    h, w, targets = _head(seed=4, tokens=256)
    w = w.requires_grad_()
    loss = chunked_cross_entropy(h, w, None, targets, chunk_tokens=CHUNK)
    assert not torch.autograd.grad(loss * 0, w, retain_graph=True)[0].any()
    with pytest.raises(RuntimeError, match="scaled the weight gradient by 0"):
        torch.autograd.grad(loss, w)
    expected = torch.autograd.grad(chunked_cross_entropy(h, w, None, targets, chunk_tokens=CHUNK), w)[0]
    with torch.autograd.graph.save_on_cpu():
        loss = chunked_cross_entropy(h, w, None, targets, chunk_tokens=CHUNK)
    halved = torch.autograd.grad(loss * 0.5, w, retain_graph=True)[0]
    whole = torch.autograd.grad(loss, w)[0]
    torch.testing.assert_close(halved, 0.5 * expected, rtol=0, atol=0)
    torch.testing.assert_close(whole, expected, rtol=0, atol=0)


def test_a_model_as_loaded_gets_the_target_rows_and_the_plain_paths_error(monkeypatch):
    """Through a model built from its config's defaults (``use_cache`` on, tied embeddings as in
    Llama-3.2-1B, a vocabulary large beside the batch) in bf16 under ``remat.apply``: the head
    takes the target-rows sum, and every gradient, the tied embedding's included, stays within
    the bf16 test's factor of the plain path's error against fp64."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    import remat
    from test_head import BF16_FACTOR, _labels, _rel, _step
    config = AutoConfig.for_model("llama", vocab_size=8192, hidden_size=32, intermediate_size=48,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, tie_word_embeddings=True)
    assert config.use_cache
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).train()
    plain, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    remat.apply(model, "keep", head="chunked", chunk_tokens=32)
    used = []
    monkeypatch.setattr(_TargetRows, "finish",
                        lambda self, dtype, f=_TargetRows.finish: used.append(1) or f(self, dtype))
    ids = torch.randint(0, config.vocab_size, (3, 45))
    ours = _step(model, ids, _labels(ids))
    assert used, "a bf16 model with a large vocabulary did not use the target-rows sum"
    ref, truth = _step(plain, ids, _labels(ids)), _step(exact, ids, _labels(ids))
    assert _rel(ours[0], truth[0]) <= BF16_FACTOR * _rel(ref[0], truth[0]) + 1e-6
    assert "model.embed_tokens.weight" in truth[1]
    for name, true_grad in truth[1].items():
        if "k_proj.bias" not in name:
            assert _rel(ours[1][name], true_grad) <= BF16_FACTOR * _rel(ref[1][name], true_grad), name


def test_in_place_scaling_under_compiled_autograd():
    """Under compiled autograd (``torch._dynamo.compiled_autograd``, which traces the backward
    graph, the head's ``.data.mul_`` included, through AOT autograd) the weight's and the hidden
    states' gradients equal the eager backward's, bit for bit, at scale 1 and at a scaled loss.
    (A whole bf16 Llama under remat.apply, checked by hand: bit for bit on torch 2.13; on 2.6
    its blocks' gradients differ by bf16 roundings, AOT's own, while the head's are exact here.)"""
    compiled_autograd = pytest.importorskip("torch._dynamo.compiled_autograd")
    if not hasattr(compiled_autograd, "_enable"):
        pytest.skip("this torch has no compiled_autograd._enable")
    h, w, targets = _head(seed=3, tokens=256)

    def grads(scale, compiled):
        hidden, weight = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = chunked_cross_entropy(hidden * 1, weight, None, targets, chunk_tokens=CHUNK) * scale
        if compiled:
            torch._dynamo.reset()
            with compiled_autograd._enable(torch.compile(backend="aot_eager")):
                loss.backward()
        else:
            loss.backward()
        return hidden.grad, weight.grad

    unscaled = grads(1.0, False)[1]
    for scale in (1.0, 0.5):
        traced = grads(scale, True)
        for got, eager in zip(traced, grads(scale, False)):
            torch.testing.assert_close(got, eager, rtol=0, atol=0)
        torch.testing.assert_close(traced[1], unscaled * scale, rtol=0, atol=0)  # a power of two: exact


def test_nothing_on_the_graph_outlives_the_heads_backward():
    """After the head's backward, the graph (alive while the caller holds the loss) keeps no
    tensor: the scale applied in place sits in a saved tensor, freed with the others, so the rest
    of the model's backward does not carry it (the bench step's peak was one 512-byte block over
    Liger's when it sat on the graph)."""
    h, w, targets = _head(seed=6, tokens=256)
    w = w.requires_grad_()
    loss = chunked_cross_entropy(h, w, None, targets, chunk_tokens=CHUNK)
    (loss / 3).backward()
    node = loss.grad_fn
    assert node.scaled_pointer is not None  # the in-place path ran

    def tensors(value):
        if isinstance(value, torch.Tensor):
            return [value]
        if isinstance(value, (tuple, list)):
            return [t for v in value for t in tensors(v)]
        return []
    assert [k for k, v in vars(node).items() if tensors(v)] == []


def test_a_fake_profile_bounds_the_real_heads_peak():
    """What the planner measures without a GPU (fake tensors: ``capacity`` rows, all in use
    from the first chunk) is at least what a real batch of distinct targets holds (its rows
    in use growing chunk by chunk), and not far above it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from remat.planning.costs import rates_for
    # private: the planner's byte meter on fake tensors, the measure bounded here; no public call meters one head
    from remat.profiling._meters import _Tracker
    h, w, _ = _head(seed=7)
    targets = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))[:TOKENS]  # all distinct

    def peak(h, w, targets):
        with _Tracker(rates_for("h100")) as tracker:
            chunked_cross_entropy(h, w.requires_grad_(), None, targets, chunk_tokens=CHUNK).backward()
        return tracker.peak
    real = peak(h, w.clone(), targets)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = peak(*(mode.from_tensor(t) for t in (h, w, targets)))
    assert real <= fake <= 1.02 * real
