"""The profiling request, the one classification of what cannot run, and what makes planning fast
without changing a plan: heads dropped before the search, a ``tolist()`` of values read at once.

The refusal table is checked case by case (each branch the block and head runs had as its own
``except``); the dropped heads against the solver without the drop, on random profiles with heads
added that another beats and heads that no other does.
"""
from dataclasses import FrozenInstanceError, replace

import pytest
import torch
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st
from test_properties import SETTINGS, profiles
from test_solver_exact import stack
from torch.utils.checkpoint import CheckpointError

import remat
from remat.planning import solver
from remat.planning.costs import rates_for
from remat.planning.solver import NoPlanFits, solve, undominated_heads
# private: the profiler's one table of what is left out, noted or raised, checked case by case; a profile
# shows a case only for a model that fails that way, and several (OOM, inductor errors) need a GPU
from remat.profiling._measure import MissingLoss, refusal
from remat.profiling import ProfileRequest


def test_a_request_is_built_by_keyword_and_cannot_change():
    request = ProfileRequest(rates=rates_for("h100"), min_offload_bytes=0)
    with pytest.raises(TypeError):
        ProfileRequest(rates_for("h100"))  # noqa: the positional form is what the request replaced
    with pytest.raises(FrozenInstanceError):
        request.repeats = 3
    assert request.backend is None and request.head_backend is None
    compiled = replace(request, scope="blocks", backend="inductor")
    assert compiled.backend == "inductor" and compiled.head_backend is None   # only the blocks compiled
    assert replace(compiled, scope="model").head_backend == "inductor"


class InductorFailure(Exception):
    """What a compile failure that is not a RuntimeError looks like to :func:`refusal` (by its name)."""


def oom():
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


BLOCK = nn.Linear(2, 2)
TREATMENTS = [  # (error, treatment, kernel, backend) -> the notes key, or "raise"
    (ValueError("no attention sub-module"), "attention", None, None, None),
    (CheckpointError("recomputed 3 tensors, saved 4"), "full", None, None, "full"),
    (CheckpointError("recomputed 3 tensors, saved 4"), "keep", None, None, "raise"),
    (RuntimeError("selective activation checkpoint: in-place write"), "selective", None, None, "selective"),
    (RuntimeError("selective activation checkpoint: in-place write"), "full", None, None, "raise"),
    (RuntimeError("a kernel failed"), "mlp", "liger", None, "liger:mlp"),
    (RuntimeError("a kernel failed"), "keep", "liger", None, "raise"),
    (oom(), "mlp", "liger", None, "raise"),
    (RuntimeError("the model's own error"), "mlp", None, None, "raise"),
    (InductorFailure("lowering"), "mlp", None, "inductor", "compile:mlp"),
    (InductorFailure("lowering"), "keep", None, "inductor", "raise"),
    (InductorFailure("lowering"), "mlp", None, None, "raise"),
    (TypeError("the model's own error"), "mlp", None, "inductor", "raise"),
    (MissingLoss("no loss"), "mlp", None, None, "raise"),
    (KeyboardInterrupt(), "mlp", None, None, "raise"),
]


@pytest.mark.parametrize("error, treatment, kernel, backend, key", TREATMENTS,
                         ids=[f"{type(e).__name__}-{t}-{k}-{b}" for e, t, k, b, _ in TREATMENTS])
def test_a_treatment_that_cannot_run_is_left_out_or_raised(error, treatment, kernel, backend, key):
    why = refusal(error, block=BLOCK, treatment=treatment, kernel=kernel, backend=backend)
    if key == "raise":
        assert why is None
        return
    assert why is not None and why.key == key
    assert why.warn == (key is not None and key.startswith("compile:"))   # a compiled plan without it is warned
    assert (why.note == "") == (key is None)                # a treatment the block cannot take: silent


def test_a_head_mode_that_cannot_run_is_noted_and_an_oom_is_not_warned():
    memory = refusal(oom(), mode="plain")
    assert memory.key == "plain" and memory.release and not memory.warn
    assert "needs more GPU memory than planning may take" in memory.note
    other = refusal(TypeError("no logits"), mode="chunked")
    assert other.key == "chunked" and other.warn and not other.release and "TypeError: no logits" in other.note
    assert refusal(MissingLoss("no loss"), mode="plain") is None
    assert refusal(KeyboardInterrupt(), mode="plain") is None


def test_a_block_that_does_not_run_with_kernels_keeps_its_modules():
    why = refusal(RuntimeError("triton"), block=BLOCK, kernel="liger")
    assert why.key is None and why.note.startswith("Linear did not run with liger kernels (RuntimeError: triton)")
    assert refusal(oom(), block=BLOCK, kernel="liger") is None
    assert refusal(TypeError("bad"), block=BLOCK, kernel="liger") is None


def _beaten(head, more_bytes: int, more_s: float, chunk: int = 7777):
    """``head`` as the chunked head at ``chunk`` tokens (an option of its own), every phase ``more_bytes``
    larger and its backward ``more_s`` slower."""
    fields = dict(pre_peak=head.pre_peak + more_bytes, pre_end=head.pre_end + more_bytes,
                  head_fwd_peak=head.head_fwd_peak + more_bytes, head_fwd_end=head.head_fwd_end + more_bytes,
                  head_bwd_peak=head.head_bwd_peak + more_bytes, head_bwd_end=head.head_bwd_end + more_bytes,
                  pre_bwd_peak=head.pre_bwd_peak + more_bytes, pre_bwd_end=head.pre_bwd_end + more_bytes)
    return replace(head, mode="chunked", chunk_tokens=chunk, head_bwd_s=head.head_bwd_s + more_s, **fields)


def test_a_head_another_beats_is_dropped_and_a_tie_or_a_trade_is_kept():
    prof = stack(blocks=4)
    plain = prof.head("plain")
    chunked = _beaten(plain, 0, 0.0, chunk=1024)
    # the model's own head beats a chunked one of the same bytes and seconds: that one pays the margin
    assert undominated_heads(prof, [plain, chunked]) == [plain]
    slower = _beaten(plain, 0, 1e-3, chunk=2048)         # the same bytes, slower: beaten
    tied = _beaten(plain, 0, 0.0, chunk=4096)            # the same head again: a tie, both kept
    trade = _beaten(plain, -1, 1e-3, chunk=8192)         # fewer bytes, slower: a trade, kept
    bigger = _beaten(plain, 1, 0.0, chunk=16384)         # more bytes, as fast: not fewer seconds, kept
    assert undominated_heads(prof, [chunked, slower, tied, trade, bigger]) == [chunked, tied, trade, bigger]
    # slower in its forward only: that forward can hide more of the last block's offload copy, kept
    longer = replace(chunked, chunk_tokens=32768, head_fwd_s=chunked.head_fwd_s + 1e-3)
    assert longer in undominated_heads(prof, [chunked, longer])


@SETTINGS
@given(prof=profiles(), data=st.data())
def test_dropping_beaten_heads_never_changes_a_plan(prof, data):
    """Random profiles with beaten heads added: the plan (and a NoPlanFits' smallest budget) is the
    one the solver finds searching every head."""
    head = data.draw(st.sampled_from(prof.heads))
    extra = _beaten(head, data.draw(st.integers(0, 4096)), data.draw(st.floats(1e-6, 1e-2)))
    prof = replace(prof, heads=prof.heads + (extra,))
    budget = data.draw(st.integers(prof.static_bytes + 1, prof.static_bytes + 2**22))

    def result(drop):
        original = solver.undominated_heads
        solver.undominated_heads = drop
        try:
            return solve(prof, budget).to_dict()
        except NoPlanFits as error:
            return ("no fit", error.smallest_peak, error.plan.to_dict() if error.plan else None)
        finally:
            solver.undominated_heads = original
    assert result(undominated_heads) == result(lambda profile, heads, margin=0.0: list(heads))


class ReadsItsIds(nn.Module):
    """A model whose forward reads its ids' values with ``tolist()`` (as Qwen2-VL's M-RoPE positions do)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, ids):
        lengths = (ids > 0).sum(dim=1).tolist()           # values: the batch's, a fake profile keeps them
        x = self.embed(ids)[:, :max(lengths)]
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def test_a_tolist_of_values_is_read_at_once_and_named():
    model = ReadsItsIds()
    ids = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]])
    prof = remat.profile(model, ids, loss_fn=lambda m, b: m(b), blocks="blocks")
    assert prof.seq == 4 and "the model (ReadsItsIds.forward)" in prof.notes["ran_for_real"]
    # the blocks ran on the first three positions, the longest sequence: the values were read, not guessed
    assert prof.hidden_bytes == 2 * 3 * 8 * 4
    assert torch.equal(ids, torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]]))
