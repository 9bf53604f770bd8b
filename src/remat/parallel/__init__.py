"""Context parallelism: a sequence split over ranks, trained under any remat treatment.

    from remat.parallel import context_parallel, shard_sequence
    local = shard_sequence(batch, cp_group, model=model)   # labels shifted, then cut head-tail: each rank its share
    with context_parallel(model, cp_group):                # torch's ring attention on NCCL, all-gather on gloo
        loss = model(**local).loss                         # this rank's share of the whole sequence's loss
        loss.backward()

:mod:`remat.parallel.sequence` cuts the batch, :mod:`remat.parallel.attention` runs attention over
the whole sequence; :mod:`remat.planning.context` is what the planner charges for it
(``remat.plan(..., cp_world=N)``).
"""
from remat.parallel.attention import CPAttention, context_parallel, plain_attention, reduce_gradients, torch_balances
from remat.parallel.groups import rank_and_world
from remat.parallel.sequence import check_batch, check_model, positions, shard_for, shard_sequence

__all__ = ["CPAttention", "check_batch", "check_model", "context_parallel", "plain_attention", "positions",
           "rank_and_world", "reduce_gradients", "shard_for", "shard_sequence", "torch_balances"]
