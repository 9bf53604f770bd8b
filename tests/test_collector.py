"""Python's garbage collector between steps (remat.integrations.collector), alone and in the
Hugging Face callback: off inside steps, a full collection every N steps, given back at the end."""
import gc
import warnings

import pytest

from remat.integrations.collector import EVERY, StepCollector, collect_every


@pytest.fixture
def full_collections():
    """The number of full (generation 2) collections started while the test runs."""
    starts = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            starts.append(1)
    gc.callbacks.append(count)
    yield starts
    gc.callbacks.remove(count)


@pytest.fixture(autouse=True)
def collector_on_afterwards():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_off_inside_steps_a_full_collection_every_n_then_back(full_collections):
    collector = StepCollector(3)
    collector.start()
    assert not gc.isenabled() and len(full_collections) == 1   # one collection to start from
    for step in range(1, 8):
        collector.step(step)
    assert len(full_collections) == 3                           # after steps 3 and 6
    collector.stop()
    assert gc.isenabled()


def test_zero_leaves_python_alone(full_collections):
    collector = StepCollector(0)
    collector.start()
    assert gc.isenabled() and not collector.active
    collector.step(50)
    collector.stop()
    assert gc.isenabled() and not full_collections


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    collector = StepCollector(2)
    collector.start()
    collector.stop()
    assert not gc.isenabled()


def test_auto_collects_under_several_ranks_only():
    assert collect_every("auto", 1) == 0
    assert collect_every("auto", 8) == EVERY
    assert collect_every(7, 1) == 7


@pytest.mark.parametrize("bad", [-1, 2.5, True, "often"])
def test_a_bad_setting_says_what_is_allowed(bad):
    with pytest.raises(ValueError, match="'auto', 0 .* or a positive number of steps"):
        StepCollector(bad)


def test_hf_callback_collects_between_steps_and_gives_the_collector_back(tmp_path, full_collections):
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from test_integrations_hf import TokenData, tiny_llama
    from remat.integrations.hf import RematCallback

    during = []

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            during.append(gc.isenabled())

    said = []
    callback = RematCallback(spec="full", collect_every=2, say=said.append)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2,
                             report_to="none", use_cpu=True, save_strategy="no")
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=TokenData(), callbacks=[callback, Probe()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert during == [False] * 4                 # no automatic collection inside any step
    assert len(full_collections) >= 3            # at the start, after steps 2 and 4
    assert gc.isenabled()
    assert any("garbage collector runs between steps, every 2 steps" in m for m in said)


def test_hf_callback_on_one_process_leaves_the_collector_alone(tmp_path):
    pytest.importorskip("transformers")
    from transformers import TrainingArguments
    from remat.integrations.hf import RematCallback
    callback = RematCallback(spec="full")
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    callback._collect(args)    # world_size 1: "auto" means Python's own collection
    assert callback._collector is None and gc.isenabled()


def test_hf_callback_refuses_a_bad_setting_at_once():
    pytest.importorskip("transformers")
    from remat.integrations.hf import RematCallback
    with pytest.raises(ValueError, match="collect_every"):
        RematCallback(spec="full", collect_every=-5)
