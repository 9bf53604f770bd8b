"""An out-of-memory error inside the Hugging Face Trainer's ``training_step`` is redone
(issue 14): ``guard_trainer`` runs the step under :func:`remat.guard.redo_out_of_memory`.

The error is injected once, in the forward or in the backward of a block, on the second
micro-batch of an optimizer step (``gradient_accumulation_steps=2``), so the gradients the
first micro-batch accumulated must survive the redo; attention dropout is on, so the RNG must
be restored too. The Trainer runs with its default arguments otherwise (CPU, no reporting or
saving). Its per-micro-batch losses and the trained parameters equal, bit for bit, the same
run that never ran out of memory.
"""
import os
import sys
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import remat
from remat.api import current_plan

sys.path.insert(0, os.path.dirname(__file__))
from test_integrations_hf import BATCH, SEQ, TokenData, tiny_llama, training_args  # noqa: E402

transformers = pytest.importorskip("transformers")

STEPS = 4


def _model():
    model = tiny_llama()
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1      # the redo must draw the same dropout masks
    return model


class _OOMOnce:
    """A block's forward hook: at the ``at``-th real training forward (from 0) raise
    torch.OutOfMemoryError there (``phase="forward"``) or in that block's backward, after the
    later blocks' gradients were accumulated (``"backward"``). Fake-tensor profiling runs are
    not counted."""

    def __init__(self, at, phase):
        self.at, self.phase, self.count, self.raised = at, phase, 0, 0

    def __call__(self, module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, FakeTensor) or not (module.training and torch.is_grad_enabled()):
            return
        self.count += 1
        if self.count - 1 != self.at:
            return
        if self.phase == "forward":
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        hidden.register_hook(self.raise_oom)

    def raise_oom(self, grad):
        self.raised += 1
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def _budget():
    """Just above what keeping everything needs: the re-plan at 0.85 of it must checkpoint."""
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    plan = remat.plan(_model(), {"input_ids": ids, "labels": ids}, "64GiB", heads=["plain"], optimizer="adamw",
                      treatments=["keep", "full"])
    return int(plan.notes["predicted_peak_bytes"] * 1.02)


def _run(tmp_path, budget, hook=None):
    from transformers import Trainer

    from remat.integrations.hf import RematCallback, guard_trainer

    class Recording(Trainer):
        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.losses.append(loss.detach().clone())   # only steps that completed
            return loss

    model = _model()
    if hook is not None:
        model.model.layers[1].register_forward_hook(hook)
    callback = RematCallback(budget=budget, head="plain", treatments=["keep", "full"], say=lambda m: None)
    trainer = Recording(model=model, args=training_args(tmp_path, max_steps=STEPS, gradient_accumulation_steps=2),
                        train_dataset=TokenData(count=2 * BATCH * STEPS), callbacks=[callback])
    trainer.losses = []
    assert guard_trainer(trainer) is trainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert "training_step" not in trainer.__dict__          # the patch is undone at on_train_end
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return torch.stack(trainer.losses), params, callback, model


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    budget = _budget()
    return budget, _run(tmp_path_factory.mktemp("ref"), budget)


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_trainer_redoes_an_out_of_memory_micro_batch(reference, tmp_path, phase):
    budget, (want_losses, want_params, want_callback, _) = reference
    assert want_callback.recovered == 0 and set(want_callback.plan.blocks.values()) == {"keep"}

    hook = _OOMOnce(at=3, phase=phase)               # step 2, second micro-batch: grads of the first exist
    losses, params, callback, model = _run(tmp_path, budget, hook)

    assert hook.raised == 1 and callback.recovered == 1
    assert len(losses) == 2 * STEPS
    assert torch.equal(losses, want_losses), (losses, want_losses)
    for name in params:
        assert torch.equal(params[name], want_params[name]), name
    assert "full" in set(current_plan(model).blocks.values())       # the re-plan at a lower budget checkpoints
    assert current_plan(model).head == "plain"


def test_trainer_gives_up_after_max_retries(tmp_path):
    from transformers import Trainer

    from remat.integrations.hf import RematCallback, guard_trainer
    model = _model()

    def always(module, args, output):
        if module.training and torch.is_grad_enabled() and not isinstance(output[0], FakeTensor):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
    model.model.layers[0].register_forward_hook(always)
    callback = RematCallback(budget="1GiB", head="plain", max_retries=1, say=lambda m: None)
    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=1), train_dataset=TokenData(),
                      callbacks=[callback])
    guard_trainer(trainer)
    with pytest.raises(RuntimeError, match="budgets tried: 1.00 GiB, 870.40 MiB"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()


def test_guard_trainer_refusals(tmp_path):
    from transformers import Trainer

    from remat.integrations.hf import RematCallback, guard_trainer
    trainer = Trainer(model=tiny_llama(), args=training_args(tmp_path), train_dataset=TokenData())
    with pytest.raises(ValueError, match="RematCallback"):
        guard_trainer(trainer)
    trainer.add_callback(RematCallback(spec="full", say=lambda m: None))
    with pytest.raises(ValueError, match="fixed spec"):
        guard_trainer(trainer)
    with pytest.raises(ValueError, match="shrink"):
        RematCallback(budget="1GiB", shrink=1.0)
    with pytest.raises(ValueError, match="profile_device"):
        RematCallback(budget="1GiB", profile_device="gpu")
