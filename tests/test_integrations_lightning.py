"""Lightning: ``remat.integrations.lightning.RematCallback`` in a CPU ``Trainer`` run of three
steps gives the per-step losses of the same run with Hugging Face non-reentrant checkpointing,
exactly (plain head); with a budget it plans from the first real batch and re-plans on a
longer one."""
import warnings

import pytest
import torch

import remat
from remat.api import current_plan

L = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install lightning)")
from test_integrations_hf import STEPS, VOCAB, tiny_llama  # noqa: E402


class LitLM(L.LightningModule):
    def __init__(self, hf_checkpointing=False):
        super().__init__()
        self.model = tiny_llama()
        if hf_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _loader(lengths=(16,)):
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, VOCAB, (2, lengths[i % len(lengths)]), generator=g) for i in range(STEPS)]
    batches = [{"input_ids": r, "labels": r.clone()} for r in rows]
    return torch.utils.data.DataLoader(batches, batch_size=None)   # each item is a whole batch


def _fit(module, callbacks=(), loader=None):
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks))
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train_dataloaders=loader or _loader())
    return torch.stack(module.losses)


def test_spec_matches_hf_checkpointing():
    from remat.integrations.lightning import RematCallback
    reference = _fit(LitLM(hf_checkpointing=True))
    module = LitLM()
    losses = _fit(module, [RematCallback(spec="full", say=lambda m: None)])
    assert len(losses) == STEPS and torch.equal(losses, reference)
    assert set(current_plan(module).blocks.values()) == {"full"}


def test_budget_plans_from_real_batches_and_replans_on_a_longer_one():
    from remat.integrations.lightning import RematCallback
    said = []
    module = LitLM()
    callback = RematCallback(budget="1GB", say=said.append)
    losses = _fit(module, [callback], loader=_loader(lengths=(8, 16, 8)))
    assert len(losses) == STEPS
    assert callback.replans == 2 and callback.planned_tokens == 32
    assert current_plan(module) == callback.plan and len([m for m in said if "planned" in m]) == 2
    remat.remove(module)


def test_collects_between_batches_and_gives_the_collector_back_also_after_an_exception():
    import gc
    from remat.integrations.lightning import RematCallback

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            during.append(gc.isenabled())

    during, said = [], []
    _fit(LitLM(), [RematCallback(spec="full", collect_every=2, say=said.append), Probe()])
    assert during == [False] * STEPS and gc.isenabled()
    assert any("between batches, every 2" in m for m in said)

    class Failing(LitLM):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("a failing step")
    with pytest.raises(RuntimeError, match="a failing step"):
        _fit(Failing(), [RematCallback(spec="full", collect_every=2, say=said.append)])
    assert gc.isenabled()   # on_exception gave it back


def test_one_process_auto_leaves_the_collector_alone_and_a_bad_setting_fails_at_once():
    import gc
    from remat.integrations.lightning import RematCallback
    callback = RematCallback(spec="full", say=lambda m: None)
    _fit(LitLM(), [callback])
    assert callback._collector is None and gc.isenabled()
    with pytest.raises(ValueError, match="collect_every"):
        RematCallback(spec="full", collect_every=-1)
