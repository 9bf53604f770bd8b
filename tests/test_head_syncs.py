"""The chunked head waits for the device at most once a step, and not at all where the host holds the targets.

On the CPU nothing waits, so the test counts what *would* wait on a GPU: every aten op that reads
a tensor's values on the host (``_local_scalar_dense``: ``.item()``, ``bool()``; ``nonzero``,
``masked_select``, ``unique``; an index by a boolean mask), every tensor made from host data
(``lift_fresh``: ``torch.tensor([...])``, an upload to the device), and ``Tensor.tolist``. The GPU
test counts CUDA's own sync warnings (``torch.cuda.set_sync_debug_mode("warn")``).
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# private names of chunked_loss below: where the op decides to sync, which its results do not show
from remat.head import chunked_cross_entropy, chunked_loss

transformers = pytest.importorskip("transformers")

_READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique_dim", "_unique", "_unique2",
          "unique_consecutive", "equal", "lift_fresh", "lift_fresh_copy", "repeat_interleave"}


_HEAD = str(Path(chunked_loss.__file__).parent)


_OTHERS = (str(Path(chunked_loss.__file__).parent.parent), str(Path(transformers.__file__).parent))


def _in_head() -> bool:
    """Whether the innermost frame of remat's or the model's code is the head's (``src/remat/head``):
    the model's own ops, which the head's patched forward calls, are not counted."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_HEAD):
            return True
        if name.startswith(_OTHERS):
            return False
        frame = frame.f_back
    return False


class HostWaits(TorchDispatchMode):
    """Counts the ops that wait for the device on a GPU (module docstring), inside the head's code."""

    def __init__(self):
        super().__init__()
        self.waits = []
        self.on = False

    def __enter__(self):
        self.on = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.on = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if (name in _READS or (name == "index" and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]))) and _in_head():
            self.waits.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def waits(monkeypatch):
    mode = HostWaits()
    tolist = torch.Tensor.tolist

    def counted(self):
        if mode.on and _in_head():
            mode.waits.append("tolist")
        return tolist(self)
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    return mode


def _inputs(dtype=torch.bfloat16, tokens=96, hidden=32, vocab=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    targets[::5] = -100
    return h, w, targets


def _step(h, w, targets, **kwargs):
    loss = chunked_cross_entropy(h, w, None, targets, chunk_tokens=32, **kwargs)
    loss.backward()
    return loss


def test_a_bf16_head_with_target_rows_waits_once(waits):
    h, w, targets = _inputs()
    assert chunked_loss._wants_target_rows(w, targets, torch.bfloat16, 32)
    with waits:
        _step(h, w, targets)
    assert waits.waits == ["tolist"], waits.waits


@pytest.mark.parametrize("num_items", [None, 77, torch.tensor(77)], ids=["counted", "int", "tensor"])
def test_an_fp32_head_never_waits(waits, num_items):
    h, w, targets = _inputs(torch.float32)
    assert not chunked_loss._wants_target_rows(w, targets, torch.float32, 32)
    with waits:
        _step(h, w, targets, num_items_in_batch=num_items)
    assert waits.waits == [], waits.waits


def _old_by_first_use(targets, chunk):
    """The ordering as it was before it waited once (boolean indexing, two more waits)."""
    n = targets.numel()
    values, positions = torch.sort(targets, stable=True)
    starts = torch.ones_like(values, dtype=torch.bool)
    starts[1:] = values[1:] != values[:-1]
    firsts, order = torch.sort(positions[starts])
    ends = torch.arange(chunk, n + chunk, chunk, device=targets.device).clamp(max=n)
    return values[starts][order], torch.searchsorted(firsts, ends).tolist()


@pytest.mark.parametrize("seed", range(5))
def test_the_one_wait_orders_the_rows_as_the_three_did(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 400, (1,), generator=g))
    targets = (torch.rand(n, generator=g) ** 3 * 300).long()
    for chunk in (1, 7, 64, 512):
        rows, counts = chunked_loss._by_first_use(targets, chunk)
        old_rows, old_counts = _old_by_first_use(targets, chunk)
        assert torch.equal(rows, old_rows) and counts == old_counts


def test_a_tiny_llamas_chunked_step_waits_once_after_its_first(waits):
    """A whole training step of a bf16 Hugging Face model with the chunked head: the first step checks
    the logit transform on the probe (one wait, once per model and dtype); every later step waits
    once, for the target rows."""
    import remat
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=1024)
    model = transformers.LlamaForCausalLM(config).bfloat16()
    remat.apply(model, "full", head="chunked", chunk_tokens=32)
    ids = torch.randint(0, 1024, (2, 48))
    model(input_ids=ids, labels=ids).loss.backward()
    with waits:
        model(input_ids=ids, labels=ids).loss.backward()
    assert waits.waits == ["tolist"], waits.waits


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["device", "host"])
def test_on_a_gpu_the_op_waits_once_and_never_for_targets_on_the_host(where):
    """CUDA's own count: one synchronising call a step with the targets on the GPU, none with
    them on the host (ordered there). Same loss and gradients either way, bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    h, w, targets = _inputs(tokens=4096, hidden=256, vocab=32768)
    h, w = h.detach().cuda().requires_grad_(), w.detach().cuda().requires_grad_()
    reference = _step(h, w, targets.cuda())
    grads = (h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    given = targets.cuda() if where == "device" else targets
    _step(h, w, given)  # warm: kernels compiled
    h.grad = w.grad = None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loss = _step(h, w, given)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [c for c in caught if "synchroniz" in str(c.message)]
    assert len(syncs) == (1 if where == "device" else 0), [str(c.message) for c in syncs]
    assert torch.equal(loss, reference) and torch.equal(h.grad, grads[0]) and torch.equal(w.grad, grads[1])
