"""RematCallback under the Trainer's context parallelism (accelerate's ``ParallelismConfig(cp_size=N)``),
on the CPU, one process.

A real CP Trainer run needs N processes, FSDP2 and torch's ring attention, which has no CPU kernel
behind ``scaled_dot_product_attention``; what runs here is the callback's side of it, with the
Trainer stood in for: ``TrainingArguments.parallelism_config`` (an accelerate ``ParallelismConfig``
as the Trainer reads it, or the accelerate state an ``Accelerator`` leaves), the model handed a
rank's share of each sequence inside a step where SDPA is not torch's (as torch's
``context_parallel`` replaces it), and the plan the callback makes for it: one rank of a ``cp x
fsdp`` mesh, planned on the whole sequences, with torch's SDPA in place while it profiles.
"""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from remat.api import current_plan

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

VOCAB, SEQ, LAYERS = 128, 32, 2


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def parallelism(cp, dp_shard=1):
    try:
        from accelerate import ParallelismConfig
    except ImportError:
        pytest.skip(f"accelerate {accelerate.__version__} has no ParallelismConfig")
    return ParallelismConfig(cp_size=cp, dp_shard_size=dp_shard)


def trainer_args(config):
    # world_size 1: the garbage collector stays Python's (several ranks would switch it off until
    # on_train_end, which these tests, standing in for train(), do not all reach)
    return SimpleNamespace(optim="adamw_torch", gradient_checkpointing=False, activation_checkpointing=False,
                           world_size=1, parallelism_config=config)


@pytest.fixture(autouse=True)
def _collector_left_alone():
    import gc
    yield
    assert gc.isenabled()


class TorchRing:
    """Stands in for torch's ``context_parallel`` replacing SDPA during a CP step: counts the calls
    that reach it (plain SDPA underneath, so the step runs)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return torch._C._nn.scaled_dot_product_attention(*args, **kwargs)

    def __enter__(self):
        self.previous = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self
        return self

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self.previous


def share(seq=SEQ, cp=2, rank=0):
    """What the Trainer hands the model on a CP rank: torch cut ids, labels and positions in place
    (head-tail), and added shift_labels and a mask of ones."""
    from remat.parallel import shard_for
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))
    local = shard_for({"input_ids": ids, "labels": ids.clone()}, rank, cp)
    local.pop("num_items_in_batch")
    return local


@pytest.mark.parametrize("cp, dp_shard", [(2, 1), (2, 2), (4, 1)])
def test_sizes_are_read_from_the_trainings_parallelism_config(cp, dp_shard):
    from remat.integrations.hf import context_parallel_sizes
    assert context_parallel_sizes(trainer_args(parallelism(cp, dp_shard))) == (cp, cp * dp_shard)
    assert context_parallel_sizes(trainer_args(parallelism(1, 2))) is None
    assert context_parallel_sizes(SimpleNamespace()) is None


def test_sizes_are_read_from_the_accelerate_state_when_the_arguments_have_none(monkeypatch):
    """An ``Accelerator(parallelism_config=...)`` leaves its config in accelerate's shared state;
    the callback reads it there (never creating a state)."""
    from accelerate.state import AcceleratorState

    from remat.integrations.hf import context_parallel_sizes
    shared = AcceleratorState._shared_state
    monkeypatch.setitem(shared, "parallelism_config", parallelism(4, 2))
    assert context_parallel_sizes(trainer_args(None)) == (4, 8)


@pytest.mark.parametrize("seq, balanced", [(SEQ, True), (SEQ + 2, False)], ids=["head-tail", "contiguous"])
def test_the_first_cp_forward_is_planned_for_one_rank_of_the_mesh(seq, balanced, monkeypatch):
    """Inside a CP step the model gets a share of ``seq / cp`` tokens; the callback plans one rank of
    the ``cp x fsdp`` mesh on the whole sequences (cp_world, fsdp_world = dp_shard x cp, torch's
    layout: head-tail where the length divides into 2 x cp chunks) with torch's own SDPA in place
    while it plans (a profile measured on a GPU calls it; the CPU's fake-tensor profile brings its
    own), then runs the step through the stand-in ring."""
    import remat.planner
    from remat.integrations.hf import RematCallback
    planning_sdpa, make_plan = [], remat.planner.plan

    def plan(*args, **kwargs):
        planning_sdpa.append(F.scaled_dot_product_attention)
        return make_plan(*args, **kwargs)
    monkeypatch.setattr(remat.planner, "plan", plan)
    said, model = [], tiny_llama()
    callback = RematCallback(budget="1GB", say=said.append)
    config = parallelism(2, dp_shard=2)
    callback.on_train_begin(trainer_args(config), None, None, model=model)
    assert callback.context_parallel == (2, 4)
    assert any("splits each sequence over 2 context-parallel ranks (FSDP2 over 4)" in m for m in said), said
    local = share(seq, cp=2) if balanced else _contiguous_share(seq)
    with TorchRing() as ring:
        loss = model(**local).loss
        loss.backward()
    assert ring.calls == LAYERS, ring.calls   # the step's attention
    assert planning_sdpa == [torch._C._nn.scaled_dot_product_attention], planning_sdpa
    notes = callback.plan.notes
    assert (notes["cp_world"], notes["fsdp_world"], notes["cp_seq"], notes["seq"]) == (2, 4, seq, seq // 2), notes
    assert notes["cp_balance"] is balanced and notes["batch"] == 2
    assert current_plan(model) == callback.plan
    assert any(m.startswith("remat: planned for the first batch") and "one of 2 context-parallel shares" in m
               for m in said), said
    callback.on_train_end(trainer_args(config), None, None)


def _contiguous_share(seq):
    """torch without its load balancer (a length that does not divide into 2 x cp chunks)."""
    from remat.parallel import shard_for
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))
    local = shard_for({"input_ids": ids, "labels": ids.clone()}, 0, 2, balance=False)
    local.pop("num_items_in_batch")
    return local


def test_a_given_batch_is_taken_as_whole_sequences():
    """``batch=`` is planned at on_train_begin, before any CP step: the whole sequences, cut by the
    planner."""
    from remat.integrations.hf import RematCallback
    ids = torch.zeros(2, 64, dtype=torch.long)
    callback = RematCallback(budget="1GB", batch={"input_ids": ids, "labels": ids}, say=lambda m: None)
    callback.on_train_begin(trainer_args(parallelism(4)), None, None, model=tiny_llama())
    notes = callback.plan.notes
    assert (notes["cp_world"], notes["fsdp_world"], notes["cp_seq"], notes["seq"], notes["cp_balance"]) == \
        (4, 4, 64, 16, True), notes


def test_plan_options_win_and_no_cp_plans_as_before():
    from remat.integrations.hf import RematCallback
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    callback = RematCallback(budget="1GB", batch={"input_ids": ids}, say=lambda m: None, fsdp_world=1,
                             cp_balance=False)
    callback.on_train_begin(trainer_args(parallelism(2)), None, None, model=tiny_llama())
    notes = callback.plan.notes
    assert notes["cp_world"] == 2 and "fsdp_world" not in notes and notes["cp_balance"] is False, notes
    plain = RematCallback(budget="1GB", batch={"input_ids": ids}, say=lambda m: None)
    plain.on_train_begin(trainer_args(None), None, None, model=tiny_llama())
    assert plain.context_parallel is None and "cp_world" not in plain.plan.notes


def test_guard_trainer_is_refused_under_cp():
    """The Trainer shards the batch in place for its CP step: a redo would shard the shares again."""
    from remat.integrations.hf import RematCallback, guard_trainer
    callback = RematCallback(budget="1GB", say=lambda m: None)
    trainer = SimpleNamespace(args=trainer_args(parallelism(2)), callback_handler=SimpleNamespace(callbacks=[callback]))
    with pytest.raises(ValueError, match="cannot redo a step under context parallelism"):
        guard_trainer(trainer)


def test_plain_attention_puts_torchs_sdpa_back_for_the_with_only():
    from remat.parallel import plain_attention
    with TorchRing() as ring:
        with pytest.raises(RuntimeError, match="inside"):
            with plain_attention():
                assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
                raise RuntimeError("inside")
        assert F.scaled_dot_product_attention is ring
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def test_whole_sequences_stand_in_for_the_share():
    from remat.integrations.hf import whole_sequences
    local = share(SEQ, cp=4)
    whole = whole_sequences(local, 4)
    assert sorted(whole) == ["input_ids", "labels"]
    assert whole["input_ids"].shape == (2, SEQ) and whole["labels"].shape == (2, SEQ)
    with pytest.raises(ValueError, match="input_ids, labels"):
        whole_sequences({"pixel_values": torch.zeros(2, 3, 4, 4)}, 2)
